"""Reporting for ``vmkv compare`` / ``vmkv bench``: environment, JSON, rich tables, markdown, PNG plots.

BENCHMARKS.md, "Output": a rich table on the terminal, JSON with every raw sample and the environment
(GPU, driver, CUDA, torch, triton, commit), a markdown summary, PNG plots where a curve says more.
Plots use matplotlib's Agg backend (no display needed); matplotlib is imported only when plotting.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from vmkv.envs import git_commit_override

logger = logging.getLogger(__name__)

__all__ = [
    "environment", "to_jsonable", "write_json", "make_table", "markdown_table", "progress",
    "fmt_bytes", "fmt_num", "fmt_size", "console", "plot_waste_vs_unit", "plot_latency_cdfs", "plot_throughput_vs_rate",
    "plot_memory_timeline", "MEMORY_TIMELINE_QUANTITIES", "plot_normalized_latency_vs_rate", "plot_batch_size",
    "plot_memory_breakdown", "MEMORY_BREAKDOWN_PARTS",
]

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _gpus() -> list[dict]:
    """GPUs from ``nvidia-smi`` (no CUDA context is created in this process)."""
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader,nounits"])
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory_total_mib": parts[2]})
    return gpus


def environment(argv: Sequence[str] | None = None, seed: int | None = None) -> dict:
    """The environment a result was measured in: hardware, versions, git commit, command line.

    Never initialises CUDA (GPU facts come from ``nvidia-smi``), so the caller's later memory
    measurements are unaffected.
    """
    import numpy
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a Linux dependency
        triton_version = None
    # a tree copied without its .git (e.g. ``git archive`` onto a GPU machine) names its commit in
    # VMKV_GIT_COMMIT; otherwise git is asked, in the repository this file belongs to
    override = git_commit_override()
    commit = override or _run(["git", "rev-parse", "HEAD"], cwd=_REPO_ROOT)
    dirty = None if override else bool(_run(["git", "status", "--porcelain", "--untracked-files=no"],
                                           cwd=_REPO_ROOT))
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name in ("vmkv", "cli.py", "__main__.py"):
        argv[0] = "vmkv"  # `python -m vmkv.cli ...` and the console script are the same command
    return {
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in argv),
        "seed": seed,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "numpy": numpy.__version__,
        "gpus": _gpus(),
        "git_commit": commit or None,
        "git_dirty": dirty,
    }


def to_jsonable(obj: Any, strict: bool = True) -> Any:
    """Dataclasses to dicts, tuples to lists, NaN/inf floats to None (``strict``: standard JSON) or
    kept (``strict=False``: Python's ``Infinity``/``NaN`` extension, for files only Python reads back,
    such as a worker's configuration, where ``inf`` is a value: ``--kv-shrink-grace-s inf``)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        obj = obj.to_dict() if hasattr(obj, "to_dict") else asdict(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, strict) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, strict) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) or not strict else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return to_jsonable(obj.item(), strict)
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if hasattr(obj, "tolist"):
        return to_jsonable(obj.tolist(), strict)
    return str(obj)


# an indented JSON array of numbers; real newlines never occur inside JSON strings, so strings are safe
_NUMERIC_ARRAY = re.compile(r"\[\n\s*((?:-?[0-9][0-9.eE+-]*|null)(?:,\n\s*(?:-?[0-9][0-9.eE+-]*|null))*)\n\s*\]")


def results_dir(out: str | None, kind: str) -> Path:
    """``out``, or ``vmkv-results/<kind>-<UTC time>``, created."""
    path = Path(out or f"vmkv-results/{kind}-{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_summary(out_dir: Path, md: list[str], plots: Sequence[Path], console: Any) -> None:
    """``summary.md`` from ``md`` lines with the ``plots`` embedded, and the console line saying what was written."""
    md = md + [f"![{p.stem}]({p.name})" for p in plots]
    (out_dir / "summary.md").write_text("\n".join(md) + "\n")
    console.print(f"wrote {out_dir}/results.json, summary.md, raw/, {len(plots)} plots")


def write_json(path: str | Path, obj: Any, indent: int | None = 1, strict: bool = True) -> Path:
    """Write ``obj`` as JSON (see :func:`to_jsonable`; ``strict=False`` keeps non-finite floats);
    ``indent=None`` for compact raw samples."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sep = None if indent else (",", ":")
    text = json.dumps(to_jsonable(obj, strict), indent=indent, separators=sep, allow_nan=not strict)
    if indent:  # keep arrays of numbers on one line: raw samples stay readable and small
        text = _NUMERIC_ARRAY.sub(lambda m: "[" + "".join(m.group(1).split()) + "]", text)
    path.write_text(text + "\n")
    return path


# ---------------------------------------------------------------------------------------- formatting
def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_num(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:,.{digits}f}"


def make_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]):
    """A :class:`rich.table.Table` (numbers right-aligned, first column left).  On a console narrower
    than the table its cells wrap and fold, never cut with an ellipsis (:func:`fitting_tables` splits
    the columns instead)."""
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*[str(c) for c in row])
    return table


def fitting_tables(console, title: str, columns: Sequence[str], rows: Iterable[Sequence[str]],
                   key_columns: int = 2) -> list:
    """:func:`make_table` as one table when it fits ``console.width``, else as several that each fit:
    the columns in order, every part repeating the first ``key_columns`` (which row is which) and
    titled ``title (i/n)``.  A part of one key and one other column that is still too wide folds."""
    from rich.measure import Measurement

    rows = [list(r) for r in rows]

    def part(cols: list[int], part_title: str):
        return make_table(part_title, [columns[i] for i in cols], [[r[i] for i in cols] for r in rows])

    unbounded = console.options.update_width(1 << 20)   # the natural width, not clamped to the console's

    def fits(cols: list[int]) -> bool:
        return Measurement.get(console, unbounded, part(cols, title)).maximum <= console.width

    keys = list(range(min(key_columns, len(columns))))
    groups, current = [], list(keys)
    for i in range(len(keys), len(columns)):
        if len(current) > len(keys) and not fits(current + [i]):
            groups.append(current)
            current = keys + [i]
        else:
            current.append(i)
    groups.append(current)
    if len(groups) == 1:
        return [make_table(title, columns, rows)]
    return [part(g, f"{title} ({n}/{len(groups)})") for n, g in enumerate(groups, 1)]


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def console():
    """A rich console: the terminal's width, or ``COLUMNS`` when set (rich reads it); 160 columns when
    stdout is not a terminal and ``COLUMNS`` is not set (logs, CI)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else Console(width=160)


def fmt_size(n: int, digits: int | None = None) -> str:
    """Compact power-of-1024 size: ``4K``, ``2M``, ``1.5G``, ``512``; ``digits`` fixes the decimals."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}" if digits is None else f"{n / scale:.{digits}f}{unit}"
    return str(int(n))


def progress(console=None):
    """A rich progress bar (spinner, description, bar, done/total, elapsed)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


# ---------------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_waste_vs_unit(results: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Waste % vs paged block size (tokens) and vs vmem page size (bytes, one curve per layout).

    Args:
        results: :meth:`vmkv.compare.alloc_sim.SchemeResult.to_dict` rows.
    """
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    paged = [r for r in results if r["scheme"] == "paged"]
    ax1.plot([r["block_size"] for r in paged], [r["waste_pct"] for r in paged], "o-", label="paged")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("block size (tokens)")
    ax1.set_ylabel("waste (% of allocated KV)")
    ax1.set_title("paged: waste vs block size")
    for scheme in sorted({r["scheme"] for r in results if r["scheme"].startswith("vmem")}):
        rows = [r for r in results if r["scheme"] == scheme]
        ax2.plot([r["page_size_bytes"] / 1024 for r in rows], [r["waste_pct"] for r in rows], "o-",
                 label=scheme)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("page size (KiB)")
    ax2.set_title("vmem: waste vs page size")
    for r in results:
        if r["scheme"] == "reservation":
            for ax in (ax1, ax2):
                ax.axhline(r["waste_pct"], color="grey", ls="--", label="max-length reservation")
    for ax in (ax1, ax2):
        ax.set_ylim(0, 100)
    return _finish(fig, (ax1, ax2), path, title, 8)


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _finish(fig, axes, path, title: str, legend_fontsize: int, *, figure_title: bool = True) -> Path:
    """Grid and legend on every axis of ``axes``, the title (figure-wide, or on the single axis when
    ``figure_title`` is false; none when empty), tight layout, then :func:`_save`."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_fontsize)
    if title:
        if figure_title:
            fig.suptitle(title, fontsize=10)
        else:
            axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_latency_cdfs(series: dict[str, dict[str, Sequence[float]]], path: str | Path, title: str = "") -> Path:
    """Empirical CDFs, one panel per metric.

    Args:
        series: ``{label: {"TTFT (ms)": [...], "TPOT (ms)": [...], "ITL (ms)": [...], "E2E (ms)": [...]}}``.
    """
    import numpy as np

    plt = _pyplot()
    metrics = list(dict.fromkeys(m for s in series.values() for m in s))
    fig, axes = plt.subplots(1, max(1, len(metrics)), figsize=(4 * max(1, len(metrics)), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for label, s in series.items():
            vals = np.sort(np.asarray([v for v in s.get(metric, []) if v is not None], dtype=float))
            if vals.size:
                ax.plot(vals, np.arange(1, vals.size + 1) / vals.size, label=label, lw=1.3)
        ax.set_xlabel(metric)
        ax.set_ylabel("fraction of samples")
    return _finish(fig, axes[0][:len(metrics)], path, title, 7)


def plot_throughput_vs_rate(points: dict[str, list[tuple[float, float, float]]], path: str | Path,
                            title: str = "") -> Path:
    """Output token throughput and mean TTFT vs request rate, one line per backend.

    Args:
        points: ``{backend: [(request_rate, output_tok_per_s, ttft_p50_ms), ...]}``.
    """
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, pts in points.items():
        pts = sorted(pts)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
    ax1.set_ylabel("output tokens / s")
    ax2.set_ylabel("TTFT p50 (ms)")
    for ax in (ax1, ax2):
        ax.set_xlabel("request rate (req/s, Poisson)")
    return _finish(fig, (ax1, ax2), path, title, 8)


#: the KV quantities of :func:`plot_memory_timeline`, with their line style
MEMORY_TIMELINE_QUANTITIES = (("created_bytes", "created", "-"), ("mapped_bytes", "mapped", "--"),
                              ("in_use_bytes", "in use", ":"), ("idle_bytes", "idle", "-."))


def _byte_unit(top: float) -> tuple[str, int]:
    return next(((u, k) for u, k in (("GiB", 1 << 30), ("MiB", 1 << 20)) if top >= k), ("KiB", 1 << 10))


def plot_memory_timeline(series: dict[str, dict[str, Sequence[float]]], path: str | Path, title: str = "") -> Path:
    """KV memory over time: physical KV bytes created, mapped, in use and idle (left; one colour per
    label, one line style per quantity) and the device memory in use (right), x = seconds since start.

    Args:
        series: ``{label: {"t_s": [...], "created_bytes": [...], "mapped_bytes": [...], "in_use_bytes":
            [...], "idle_bytes": [...], "device_used_bytes": [...]}}`` (a run's ``raw["steps"]``); a
            missing quantity is skipped, and ``allocated_bytes`` stands in for a missing ``in_use_bytes``
            (results written before these columns existed).
    """
    plt = _pyplot()
    fig, (ax, ax_dev) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    quantities = MEMORY_TIMELINE_QUANTITIES
    cols = {label: {**({"in_use_bytes": s["allocated_bytes"]} if "allocated_bytes" in s else {}), **s}
            for label, s in series.items()}
    top = max((max(s.get(k) or [0]) for s in cols.values() for k, _, _ in quantities), default=0)
    unit, scale = _byte_unit(top)
    for i, (label, s) in enumerate(cols.items()):
        for key, name, ls in quantities:
            if s.get(key):
                ax.plot(s["t_s"], [b / scale for b in s[key]], color=f"C{i}", ls=ls, lw=1.3,
                        drawstyle="steps-post", label=f"{label} {name}")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"KV memory ({unit})")
    ax.set_title("KV memory over time" + (f"; {title}" if title else ""), fontsize=10)
    top_dev = max((max(s.get("device_used_bytes") or [0]) for s in cols.values()), default=0)
    dunit, dscale = _byte_unit(top_dev)
    for i, (label, s) in enumerate(cols.items()):
        if s.get("device_used_bytes"):
            ax_dev.plot(s["t_s"], [b / dscale for b in s["device_used_bytes"]], color=f"C{i}", lw=1.3,
                        drawstyle="steps-post", label=f"{label} device used")
    ax_dev.set_xlabel("time since start (s)")
    ax_dev.set_ylabel(f"device memory in use ({dunit})")
    ax_dev.set_title("device memory (CUDA: total - free; CPU: RSS)", fontsize=10)
    return _finish(fig, [ax, ax_dev], path, "", 7)


def plot_normalized_latency_vs_rate(points: dict[str, list[tuple[float, float]]], path: str | Path,
                                    title: str = "", sustained: dict[str, float | None] | None = None) -> Path:
    """Normalized latency (s/token) vs request rate, one line per design (the PagedAttention paper's
    Fig. 12); a design's sustained rate (``sustained``) is marked by a dotted vertical line.

    Args:
        points: ``{design: [(request_rate, normalized_latency_s), ...]}``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = 0.0
    for i, (label, pts) in enumerate(points.items()):
        pts = sorted((r, v) for r, v in pts if v is not None and math.isfinite(v))
        if not pts:
            continue
        top = max(top, max(v for _, v in pts))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=label)
        rate = (sustained or {}).get(label)
        if rate is not None:
            ax.axvline(rate, color=f"C{i}", ls=":", lw=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_ylim(bottom=0)
    return _finish(fig, [ax], path, title, 8, figure_title=False)


def plot_batch_size(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: str | Path,
                    title: str = "") -> Path:
    """Sequences in the running batch over time, one line per design (the batch size of the
    PagedAttention paper's Fig. 13, over the run rather than its mean).

    Args:
        series: ``{design: (t_s, running_seqs)}`` per engine step.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, (label, (t, n)) in enumerate(series.items()):
        if len(t):
            mean = sum(n) / len(n)
            ax.plot(t, n, color=f"C{i}", lw=1.1, drawstyle="steps-post", label=f"{label} (mean {mean:.1f})")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("running sequences (batch size)")
    ax.set_ylim(bottom=0)
    return _finish(fig, [ax], path, title, 8, figure_title=False)


#: the parts of :func:`plot_memory_breakdown`, bottom of the stack first: (step column, label, colour)
MEMORY_BREAKDOWN_PARTS = (("token_bytes", "token states", "C2"), ("reserved_unused_bytes", "reserved, unused", "C1"),
                          ("waste_bytes", "block/page tails", "C3"), ("idle_bytes", "idle (free, kept)", "0.85"))


def plot_memory_breakdown(series: dict[str, dict[str, Sequence[float]]], path: str | Path, title: str = "") -> Path:
    """The KV memory breakdown over time (the PagedAttention paper's Fig. 2 over a run), one column per
    design: top, stacked areas of token states, reserved but unused, block or page tails and idle memory,
    which add up to the created bytes, with the budget (``capacity``) dashed when given; bottom, the three
    parts of the in-use memory alone (idle memory, a static pool's free blocks, would hide them).

    Args:
        series: ``{design: steps}``, ``steps`` a run's ``raw["steps"]`` columns (``t_s`` and the
            :data:`MEMORY_BREAKDOWN_PARTS` columns; a missing one is drawn as zeros), optionally
            ``capacity_bytes`` (a number).
    """
    plt = _pyplot()
    n = max(1, len(series))
    fig, axes = plt.subplots(2, n, figsize=(4.6 * n, 6.4), squeeze=False, sharex="col")
    parts = MEMORY_BREAKDOWN_PARTS
    for col, (label, s) in enumerate(series.items()):
        t = list(s.get("t_s") or [])
        raw = [list(s.get(k) or [0] * len(t)) for k, _, _ in parts]
        for row, k in ((0, len(parts)), (1, len(parts) - 1)):
            ax = axes[row][col]
            top = max([sum(v) for v in zip(*raw[:k])] + [0])
            if row == 0:
                top = max(top, s.get("capacity_bytes") or 0)
            unit, scale = _byte_unit(top)
            if t:
                ax.stackplot(t, *[[v / scale for v in ys] for ys in raw[:k]], labels=[p[1] for p in parts[:k]],
                             colors=[p[2] for p in parts[:k]], step="post")
            if row == 0 and s.get("capacity_bytes"):
                ax.axhline(s["capacity_bytes"] / scale, color="k", ls="--", lw=1, label="budget")
            ax.set_ylabel(f"{'KV memory' if row == 0 else 'in use'} ({unit})")
            ax.set_title(label if row == 0 else f"{label}: in use only", fontsize=10)
        axes[1][col].set_xlabel("time since start (s)")
    return _finish(fig, [ax for row in axes for ax in row], path, title, 7)
