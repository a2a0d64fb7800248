"""Tables, target checks and the plot of :mod:`vmkv.compare.kernel_bench` results (issue 5 targets)."""

from __future__ import annotations

import math
from pathlib import Path

from vmkv.compare.report import environment, markdown_table, write_json

DECODE_TARGET = (64, 4096)        # batch, context
PREFILL_TARGET = 8192             # context
CONTIG = "triton_contig_megacache"
PAGED = "triton_paged_bs16"
PEER_PREFIX = "flashinfer"        # peer variants (vmkv.compare.kernel_bench_peers) compared with PAGED
PEER_TARGET_BATCH = 256           # issue 11: ours vs FlashInfer paged decode at B=256, every context
PEER_NOTE = ("ours/FI speed = FlashInfer ms / triton_paged_bs16 ms at the same point, on the same paged K/V "
             "and block table (> 1: ours faster)")


def peer_variants(rows: list[dict]) -> list[str]:
    """The FlashInfer variants present in ``rows``, sorted."""
    return sorted({r["variant"] for r in rows if r["variant"].startswith(PEER_PREFIX)})


def peer_column(variant: str) -> str:
    """Table column of the ours/FlashInfer speed ratio against ``variant``."""
    return f"ours/FI speed ({variant.removeprefix(PEER_PREFIX + '_paged_')})"


def _speed(ours: dict | None, peer: dict | None) -> float | None:
    """``peer ms / ours ms`` (> 1: ours faster), or None when either was not measured."""
    return peer["ms"] / ours["ms"] if ours and peer else None


def _index(rows: list[dict], keys: tuple[str, ...]) -> dict:
    return {(*(r[k] for k in keys), r["variant"]): r for r in rows if "ms" in r}


def summarize(result: dict) -> dict:
    """The issue's targets at their points: measured values, thresholds and pass/fail."""
    dec = _index(result["decode"], ("batch", "context"))
    pre = _index(result["prefill"], ("context",))
    b, c = DECODE_TARGET
    out: dict = {"copy_gbps": result["copy_bandwidth"]["gbps"], "decode_point": [b, c],
                 "prefill_context": PREFILL_TARGET, "targets": []}

    def target(name, value, threshold, ok):
        out["targets"].append({"target": name, "value": value, "threshold": threshold,
                               "met": bool(ok) if value is not None else None})

    for variant in (CONTIG, "triton_contig_per_layer", PAGED, "triton_paged_bs256"):
        r = dec.get((b, c, variant))
        pct = r["pct_copy_bw"] if r else None
        target(f"decode {b}x{c} {variant}: % of copy bandwidth", pct, ">= 80", pct is not None and pct >= 80)
    for paged in (PAGED, "triton_paged_bs256"):
        rp, rc = dec.get((b, c, paged)), dec.get((b, c, CONTIG))
        ratio = rp["ms"] / rc["ms"] if rp and rc else None
        target(f"decode {b}x{c} {paged} / {CONTIG} time", ratio, "<= 1.10", ratio is not None and ratio <= 1.10)
    flex = next((r for (bb, cc, v), r in dec.items() if (bb, cc) == (b, c) and v.startswith("flex")), None)
    rp = dec.get((b, c, PAGED))
    ratio = rp["ms"] / flex["ms"] if rp and flex else None
    target(f"decode {b}x{c} {PAGED} / flex_attention paged time", ratio, "< 1.0", ratio is not None and ratio < 1)
    for fv in peer_variants(result["decode"]):
        for (bb, cc, v), r in sorted(dec.items()):
            if v == fv and bb == PEER_TARGET_BATCH:
                speed = _speed(dec.get((bb, cc, PAGED)), r)
                target(f"decode {bb}x{cc} {PAGED} vs {fv}: speed (FI ms / ours ms)", speed, ">= 1.0",
                       speed is not None and speed >= 1.0)
    sd = pre.get((PREFILL_TARGET, "sdpa_flash_contiguous"))
    for variant in (CONTIG, "triton_contig_per_layer", PAGED):
        r = pre.get((PREFILL_TARGET, variant))
        frac = sd["ms"] / r["ms"] if r and sd else None
        target(f"prefill {PREFILL_TARGET} {variant}: throughput / SDPA flash", frac, ">= 0.80",
               frac is not None and frac >= 0.8)
    return out


def _cell(r: dict | None, key: str) -> str:
    if r is None:
        return "-"
    if "ms" not in r:
        return "error"
    v = r.get(key)
    return f"{r['ms']:.3f} ({v:.0f})" if v is not None and math.isfinite(v) else f"{r['ms']:.3f}"


def tables(result: dict) -> str:
    """Markdown: decode pivot (ms (% copy BW)) with paged/contiguous ratios, prefill pivot, targets."""
    lines = []
    cbw = result["copy_bandwidth"]
    lines.append(f"Copy bandwidth (read + write): **{cbw['gbps']:.0f} GB/s** "
                 f"({cbw['buffer_bytes'] / 2**30:.0f} GiB buffer, {cbw['ms']:.3f} ms)\n")
    if result.get("peers"):
        lines.append("Peers: " + ", ".join(f"{k} {v}" for k, v in result["peers"].items()) + "\n")
    dec = _index(result["decode"], ("batch", "context"))
    variants = sorted({r["variant"] for r in result["decode"]},
                      key=lambda v: (not v.startswith("triton"), not v.startswith("sdpa"), v))
    points = sorted({(r["batch"], r["context"]) for r in result["decode"]}, key=lambda p: (p[1], p[0]))
    paged = [v for v in variants if v.startswith("triton_paged")]
    peers = peer_variants(result["decode"])
    cols = ["batch", "context", *variants, *[f"{p.removeprefix('triton_')}/contig" for p in paged],
            *[peer_column(v) for v in peers]]
    rows = []
    for b, c in points:
        cells = [_cell(dec.get((b, c, v)), "pct_copy_bw") for v in variants]
        rc = dec.get((b, c, CONTIG))
        ratios = []
        for p in paged:
            rp = dec.get((b, c, p))
            ratios.append(f"{rp['ms'] / rc['ms']:.3f}" if rp and rc else "-")
        speeds = [_speed(dec.get((b, c, PAGED)), dec.get((b, c, v))) for v in peers]
        rows.append([str(b), str(c), *cells, *ratios, *["-" if x is None else f"{x:.3f}" for x in speeds]])
    lines.append("Decode attention: ms (% of copy bandwidth)\n")
    lines.append(markdown_table(cols, rows))
    if peers:
        lines.append("\n" + PEER_NOTE)
    gb_rows = []
    for b, c in points:
        gb_rows.append([str(b), str(c), *[(f"{dec[(b, c, v)]['gbps']:.0f}" if (b, c, v) in dec else "-")
                                          for v in variants]])
    lines.append("\nDecode attention: achieved GB/s (KV + q + out bytes / time)\n")
    lines.append(markdown_table(["batch", "context", *variants], gb_rows))
    pre = _index(result["prefill"], ("context",))
    pv = sorted({r["variant"] for r in result["prefill"]}, key=lambda v: (not v.startswith("triton"), v))
    ppeers = peer_variants(result["prefill"])
    prow = []
    for c in sorted({r["context"] for r in result["prefill"]}):
        sd = pre.get((c, "sdpa_flash_contiguous"))
        speeds = [_speed(pre.get((c, PAGED)), pre.get((c, v))) for v in ppeers]
        prow.append([str(c), *[_cell(pre.get((c, v)), "tflops") for v in pv],
                     *[(f"{sd['ms'] / pre[(c, v)]['ms']:.2f}" if sd and (c, v) in pre else "-")
                       for v in (CONTIG, PAGED)], *["-" if x is None else f"{x:.3f}" for x in speeds]])
    lines.append("\nPrefill attention (causal, one sequence): ms (TFLOP/s)\n")
    lines.append(markdown_table(["context", *pv, "contig/SDPA thr.", "paged16/SDPA thr.",
                                 *[peer_column(v) for v in ppeers]], prow))
    if ppeers:
        lines.append("\n" + PEER_NOTE)
    if "summary" in result:
        lines.append("\nTargets\n")
        lines.append(markdown_table(
            ["target", "value", "threshold", "met"],
            [[t["target"], "-" if t["value"] is None else f"{t['value']:.3f}", t["threshold"],
              {True: "yes", False: "NO", None: "not measured"}[t["met"]]] for t in result["summary"]["targets"]]))
    errors = [r for r in result["decode"] + result["prefill"] if "error" in r]
    if errors:
        lines.append("\nFailed variants\n")
        for r in errors:
            lines.append(f"- {r['variant']} {r.get('batch')}x{r.get('context')}: {r['error']}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    b0, c0 = DECODE_TARGET
    for ax, key, fixed, xlabel in ((axes[0], "context", ("batch", b0), "context (tokens)"),
                                   (axes[1], "batch", ("context", c0), "batch (sequences)")):
        rows = [r for r in result["decode"] if r[fixed[0]] == fixed[1] and "ms" in r]
        for v in sorted({r["variant"] for r in rows}):
            pts = sorted((r[key], r["pct_copy_bw"]) for r in rows if r["variant"] == v)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if v.startswith("triton") else "s--",
                    label=v, ms=4)
        ax.axhline(80, color="grey", ls=":", label="target 80%")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("% of measured copy bandwidth")
        ax.set_title(f"decode, {fixed[0]} {fixed[1]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rows = [r for r in result["prefill"] if "ms" in r]
    for v in sorted({r["variant"] for r in rows}):
        pts = sorted((r["context"], r["tflops"]) for r in rows if r["variant"] == v)
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], "o-" if v.startswith("triton") else "s--",
                     label=v, ms=4)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("context (tokens)")
    axes[2].set_ylabel("TFLOP/s (causal)")
    axes[2].set_title("prefill, one sequence")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    gpu = (result.get("environment", {}).get("gpus") or [{}])[0].get("name", "")
    fig.suptitle(f"vmkv attention kernels, {gpu}, copy bandwidth {result['copy_bandwidth']['gbps']:.0f} GB/s",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(out_dir: Path, result: dict, *, with_plot: bool = True) -> dict:
    """Write ``kernel_bench.json`` and ``kernel_bench.md`` (and ``kernel_bench.png``); returns the paths."""
    out_dir = Path(out_dir)
    result.setdefault("environment", environment())
    paths = {"json": write_json(out_dir / "kernel_bench.json", result), "md": out_dir / "kernel_bench.md"}
    paths["md"].write_text(tables(result))
    if with_plot and (result["decode"] or result["prefill"]):
        paths["png"] = plot(result, out_dir / "kernel_bench.png")
    return paths
