"""Allocator peers side by side: vmem, vAttention (synchronous API) and kvcached on one sequence-length trace.

    python3 -m vmkv.compare.alloc_peers --out DIR [--allocators vmem,vattention,kvcached,...]

Every allocator gets the same seeded trace (:func:`make_trace`): ``--num-seqs`` sequences are admitted at
once with a prompt (``--prompt-len``), grow ``--decode-tokens`` positions per decode step until their final
length (``--final-len``), and are freed when they reach it; the burst ends with the last free.  Then
``--admit-reps`` admissions of one ``--admit-len``-token prompt, **warm** (right after one of that size was
freed) and **cold** (after the allocator returned its idle memory: vmem ``release_idle`` past its grace
period, vAttention ``step(..., eager_reclaim=True)``, kvcached ``trim()``).

What is timed: ``time.perf_counter_ns`` around one adapter call on the host (all three allocate
synchronously; nothing runs on the GPU meanwhile).  *grow* is the call that takes one sequence from n to
n + decode_tokens positions: vmem ``extend(seq, 1)``; vAttention ``step(seq_lens, True)`` with that one
length changed (Sarathi-Serve's synchronous mode); kvcached ``alloc(1)`` when a 16-token block boundary is
crossed (nothing otherwise).  A **page-boundary call** is a grow after which the allocator's own count of
KV bytes in use by sequences rose; its latency per 2 MiB is the call's time / (bytes newly in use / 2 MiB),
since one call brings 2 MiB (vmem megacache), 32 MiB (``vmem-32MiB``, ``vmem-32MiB-prefetch``: 32 MiB pages),
4 MiB (vAttention megacache) or 128 MiB (vAttention and vmem per-layer: a page in each of 64 K/V tensors;
kvcached: its compound page) into use.  *admission* is the call
(vAttention: ``alloc_new_batch_idx`` + ``step``) that backs a new 2048-token prompt.  vAttention's step()
walks every request slot, so calling it once per sequence change (needed to time one sequence's page
boundary) inflates its *grow total*; the time in page-boundary calls (*map total*) is the trace-level figure
to compare.  ``vmem-prealloc`` creates every page up front as vAttention does (``preallocate=True``);
``vmem-prefetch`` also makes the engine's ``prefetch`` call between steps (its total: "+ N prefetch") and
its ``prefetch_admission`` call before each admission (as the engine makes it while the previous step's
forward runs; timed apart, its p50 shown beside the admission's: "+ N prefetch").

Memory: ``torch.cuda.mem_get_info`` used bytes less those before the allocator was built (``device``) and
the allocator's own count (``held``: vmem ``usage().created_bytes``; vAttention its page pool, created up
front; kvcached in-use + reserved pages), at the peak, right after the burst, after ``--idle-s`` idle
seconds (vmem: plus ``release_idle`` with its clock advanced past ``kv_shrink_grace_s``) and after the
return of idle memory.  Each allocator runs in its own process (a fresh CUDA context; vAttention keeps
global state); a peer that is not installed, or needs CUDA on a CPU run, is skipped with one log line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from vmkv.compare import report
from vmkv.compare.alloc_adapters import (ALLOCATORS, DEFAULT_ALLOCATORS, AllocatorAdapter, AllocatorEntry,
                                         BenchConfig, COLD_FIRST_ID, Counters, PeerUnavailableError, WARM_FIRST_ID,
                                         missing_reason)
from vmkv.compare.alloc_kvcached import KvcachedAdapter
from vmkv.compare.alloc_trace import ADMIT, FREE, GROW, TraceConfig, make_trace, trace_digest
from vmkv.compare.alloc_vattention import VAttentionAdapter
from vmkv.compare.alloc_vmem import VMemAdapter, admit_prefetch_note, prefetch_note
from vmkv.compare.shapes import SHAPES
from vmkv.engine.args import parse_size

# the trace and adapter names stay importable from here (tests, scripts)
__all__ = ["ADMIT", "ALLOCATORS", "COLD_FIRST_ID", "DEFAULT_ALLOCATORS", "FREE", "GROW", "MIB2", "WARM_FIRST_ID",
           "AllocatorAdapter", "AllocatorEntry", "BenchConfig", "Counters", "KvcachedAdapter",
           "PeerUnavailableError", "TraceConfig", "VAttentionAdapter", "VMemAdapter", "columns", "main",
           "make_trace", "missing_reason", "rows", "run_all", "run_allocator", "run_in_subprocess", "trace_digest",
           "write_report"]

logger = logging.getLogger(__name__)

MIB2 = 2 << 20


def _int_range(text: str) -> tuple[int, int]:
    """``"A..B"`` or ``"N"`` to an inclusive ``(A, B)``; raises argparse.ArgumentTypeError."""
    try:
        lo, _, hi = text.partition("..")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or A..B (integers), got {text!r}") from None
    return lo, hi


# ---------------------------------------------------------------------------------------- runner
def _pct(xs, q: float):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else None


def _summary(us: list[float]) -> dict:
    return {"num": len(us), "p50_us": _pct(us, 50), "p99_us": _pct(us, 99),
            "max_us": max(us) if us else None, "total_ms": sum(us) / 1e3}


class _Device:
    """Device bytes in use (``mem_get_info``) less a baseline; None on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.torch = None
        if cuda:
            import torch

            self.torch = torch
            torch.cuda.synchronize()
        self.base = self.used()

    def used(self) -> int | None:
        if self.torch is None:
            return None
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def delta(self) -> int | None:
        used = self.used()
        return None if used is None else used - self.base


def _snapshot(a: AllocatorAdapter, dev: _Device) -> dict:
    c = a.counters()
    return {**asdict(c), "device_bytes": dev.delta()}


def _admissions(a: AllocatorAdapter, cfg: TraceConfig, cold: bool, first_id: int) -> tuple[list, list, bool]:
    us, new_bytes, ok = [], [], True
    for rep in range(cfg.admit_reps):
        if cold:
            a.drop()
        a.before_admit(first_id + rep, cfg.admit_len)
        before = a.counters().in_use_bytes
        t0 = time.perf_counter_ns()
        a.admit(first_id + rep, cfg.admit_len)
        us.append((time.perf_counter_ns() - t0) / 1e3)
        new_bytes.append(a.counters().in_use_bytes - before)
        if rep in (0, cfg.admit_reps - 1):
            ok = a.touch(first_id + rep, cfg.admit_len - 1) and ok
        a.free(first_id + rep)
    return us, new_bytes, ok


def run_allocator(name: str, bench: BenchConfig, cfg: TraceConfig) -> dict:
    """Run the trace, then the admissions, on allocator ``name`` in this process; returns its result."""
    steps = make_trace(cfg)
    dev = _Device(bench.device.startswith("cuda"))
    t0 = time.perf_counter_ns()
    a = ALLOCATORS[name].make(bench)
    init_ms = (time.perf_counter_ns() - t0) / 1e6
    try:
        out = {"allocator": name, "status": "ok", "label": a.name, "trace_digest": trace_digest(steps),
               "init_ms": init_ms, "memory": {"after_init": _snapshot(a, dev)}}
        a.admit(-1, 16)                 # warm-up (kvcached finishes its set-up on the first call)
        a.free(-1)
        time.sleep(bench.idle_s)
        grow_us, boundary_us, boundary_bytes, mapped_calls = [], [], [], 0
        other_us: dict[str, list[float]] = {ADMIT: [], FREE: [], "between_steps": []}
        touch_ok, peak_held, peak_dev = True, 0, 0
        prev = a.counters()
        for step in steps:
            for op, seq, n in step:
                if op == ADMIT:
                    a.before_admit(seq, n)
                t0 = time.perf_counter_ns()
                if op == GROW:
                    a.grow(seq, n)
                elif op == ADMIT:
                    a.admit(seq, n)
                else:
                    if seq == 0:
                        touch_ok = a.touch(seq, 0) and touch_ok
                        t0 = time.perf_counter_ns()
                    a.free(seq)
                dt_us = (time.perf_counter_ns() - t0) / 1e3
                c = a.counters()
                if op == GROW:
                    grow_us.append(dt_us)
                    if c.in_use_bytes > prev.in_use_bytes:
                        boundary_us.append(dt_us)
                        boundary_bytes.append(c.in_use_bytes - prev.in_use_bytes)
                        mapped_calls += c.mapped_bytes > prev.mapped_bytes
                else:
                    other_us[op].append(dt_us)
                prev = c
            t0 = time.perf_counter_ns()
            a.between_steps()
            other_us["between_steps"].append((time.perf_counter_ns() - t0) / 1e3)
            prev = a.counters()
            peak_held = max(peak_held, prev.held_bytes)
            peak_dev = max(peak_dev, dev.delta() or 0)
        mem = out["memory"]
        mem["peak"] = {"held_bytes": peak_held, "device_bytes": None if dev.torch is None else peak_dev}
        mem["after_burst"] = _snapshot(a, dev)
        time.sleep(bench.idle_s)
        a.idle()
        mem["after_idle"] = _snapshot(a, dev)
        warm_us, warm_bytes, ok_w = _admissions(a, cfg, cold=False, first_id=WARM_FIRST_ID)
        a.drop()
        mem["after_drop"] = _snapshot(a, dev)
        cold_us, cold_bytes, ok_c = _admissions(a, cfg, cold=True, first_id=COLD_FIRST_ID)
        per_2mib = [t / (b / MIB2) for t, b in zip(boundary_us, boundary_bytes)]
        out.update({
            "grow": {**_summary(grow_us), "num_boundary_calls": len(boundary_us),
                     "num_calls_that_mapped": mapped_calls, "boundary": _summary(boundary_us),
                     "per_2MiB": _summary(per_2mib)},
            "admit_in_trace": _summary(other_us[ADMIT]), "free": _summary(other_us[FREE]),
            "between_steps": _summary(other_us["between_steps"]),
            # warm: the first admission follows the idle phase, so the warm figures use the rest
            "admit_warm": {**_summary(warm_us[1:] or warm_us), "first_us": warm_us[0]},
            "admit_cold": _summary(cold_us),
            "touch_ok": touch_ok and ok_w and ok_c,
            "info": a.info(),
            "samples": {"boundary_us": [round(x, 2) for x in boundary_us], "boundary_bytes": boundary_bytes,
                        "admit_warm_us": [round(x, 2) for x in warm_us], "admit_warm_bytes": warm_bytes,
                        "admit_cold_us": [round(x, 2) for x in cold_us], "admit_cold_bytes": cold_bytes},
        })
        return out
    finally:
        try:
            a.close()
        except Exception:  # noqa: BLE001 - the results are complete; closing is best effort
            logger.exception("%s: close failed", name)


def _worker(args) -> int:
    conf = json.loads(Path(args.config).read_text())
    bench = BenchConfig(**conf["bench"])
    cfg = TraceConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in conf["trace"].items()})
    try:
        result = run_allocator(args.worker, bench, cfg)
    except PeerUnavailableError as e:
        logger.info("alloc_peers: %s skipped: %s", args.worker, e)
        result = {"allocator": args.worker, "status": "skipped", "reason": str(e)}
    report.write_json(args.result, result)
    return 0


def run_in_subprocess(name: str, config_path: Path, workdir: Path, timeout_s: float) -> dict:
    """One allocator in its own process (its ``env`` added); a crash or timeout is recorded as failed."""
    result = workdir / f"{name}.{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "vmkv.compare.alloc_peers", "--worker", name, "--config", str(config_path),
           "--result", str(result)]
    env = {**os.environ, **ALLOCATORS[name].env, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e.stdout or "")[-1500:] + str(e.stderr or "")[-1500:]
    wall_s = time.monotonic() - t0
    if result.exists():
        out = json.loads(result.read_text())
        out.update(worker_rc=rc, worker_wall_s=wall_s)
        if rc != 0:
            out["worker_output_tail"] = tail
        return out
    logger.warning("alloc_peers: %s failed (exit %s):\n%s", name, rc, tail)
    return {"allocator": name, "status": "failed", "error": f"exit {rc}", "worker_output_tail": tail,
            "worker_wall_s": wall_s}


def run_all(names: list[str], bench: BenchConfig, cfg: TraceConfig, *, in_process: bool = False,
            timeout_s: float = 300.0, deadline_s: float | None = None) -> list[dict]:
    """Every allocator of ``names`` in order (repeats allowed); skipped, failed and not-run ones recorded."""
    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    results = []
    with tempfile.TemporaryDirectory(prefix="alloc_peers_") as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps({"bench": asdict(bench), "trace": asdict(cfg)}))
        for name in names:
            reason = missing_reason(name, bench.device)
            if reason is not None:
                logger.info("alloc_peers: %s skipped: %s", name, reason)
                results.append({"allocator": name, "status": "skipped", "reason": reason})
            elif t_end is not None and time.monotonic() > t_end:
                results.append({"allocator": name, "status": "not_run", "reason": "--deadline-s passed"})
            elif in_process:
                try:
                    results.append(run_allocator(name, bench, cfg))
                except PeerUnavailableError as e:
                    logger.info("alloc_peers: %s skipped: %s", name, e)
                    results.append({"allocator": name, "status": "skipped", "reason": str(e)})
            else:
                results.append(run_in_subprocess(name, config_path, Path(tmp), timeout_s))
    return results


# ---------------------------------------------------------------------------------------- report
def columns(admit_len: int = TraceConfig.admit_len) -> list[str]:
    return ["allocator", "boundary calls", "map call p50/p99 us", "per 2 MiB p50/p99 us", "map / grow total ms",
            f"admit {admit_len} warm p50 ms", f"admit {admit_len} cold p50/max ms", "peak held",
            "after burst held / device", "after idle held / device", "after drop held / device"]


def _pair(d: dict | None, a: str, b: str, scale: float = 1.0, digits: int = 1) -> str:
    if not d or d.get(a) is None:
        return "-"
    second = d[b] / scale if d.get(b) is not None else None
    return f"{report.fmt_num(d[a] / scale, digits)} / {report.fmt_num(second, digits)}"


def _mem(m: dict) -> str:
    return f"{report.fmt_bytes(m.get('held_bytes'))} / {report.fmt_bytes(m.get('device_bytes'))}"


def rows(results: list[dict]) -> list[list[str]]:
    out = []
    for r in results:
        if r["status"] != "ok":
            out.append([r["allocator"], r["status"]] + ["-"] * 9)
            continue
        g, m = r["grow"], r["memory"]
        out.append([r["allocator"], str(g["num_boundary_calls"]), _pair(g["boundary"], "p50_us", "p99_us"),
                    _pair(g["per_2MiB"], "p50_us", "p99_us", digits=2),
                    f"{report.fmt_num(g['boundary']['total_ms'], 1)} / {report.fmt_num(g['total_ms'], 1)}"
                    f"{prefetch_note(r)}",
                    report.fmt_num(r["admit_warm"]["p50_us"] / 1e3, 3) + admit_prefetch_note(r, "warm"),
                    _pair(r["admit_cold"], "p50_us", "max_us", 1e3, 3) + admit_prefetch_note(r, "cold"),
                    report.fmt_bytes(m["peak"]["held_bytes"]),
                    _mem(m["after_burst"]), _mem(m["after_idle"]), _mem(m["after_drop"])])
    return out


def write_report(out: Path, payload: dict) -> None:
    report.write_json(out / "alloc_peers.json", payload)
    env, tr = payload["environment"], payload["trace"]
    title = (f"{payload['bench']['model']} KV ({report.fmt_bytes(payload['bytes_per_token'])}/token), "
             f"{tr['num_seqs']} seqs, prompt {tr['prompt_len'][0]}..{tr['prompt_len'][1]} -> final "
             f"{tr['final_len'][0]}..{tr['final_len'][1]} by {tr['decode_tokens']}, seed {tr['seed']}, "
             f"cap {report.fmt_bytes(payload['bench']['kv_memory_bytes'])}; trace {payload['trace_digest']}")
    md = [f"# Allocator peers: {payload['bench']['model']}", "", f"Command: `{env['command']}`", "",
          f"Commit {env.get('git_commit')}; GPUs {env.get('gpus')}; torch {env.get('torch')}; "
          f"peers: {payload.get('peer_sources') or '-'}", "", title, "",
          report.markdown_table(columns(tr["admit_len"]), rows(payload["results"])), ""]
    md += [f"- {r['allocator']}: {r['status']}: {r.get('reason') or r.get('error')}"
           for r in payload["results"] if r["status"] != "ok"]
    (out / "alloc_peers.md").write_text("\n".join(md) + "\n")


def _peer_sources(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--peer-source must be NAME=TEXT, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m vmkv.compare.alloc_peers", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for alloc_peers.json and alloc_peers.md")
    p.add_argument("--allocators", default=",".join(DEFAULT_ALLOCATORS),
                   help=f"comma-separated, in run order, repeats allowed; of {', '.join(ALLOCATORS)}")
    p.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="KV dtype (default: the shape's)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: cuda when available)")
    p.add_argument("--kv-memory", type=parse_size, default=20 << 30, help="KV memory cap of every allocator")
    p.add_argument("--num-seqs", type=int, default=TraceConfig.num_seqs)
    p.add_argument("--prompt-len", type=_int_range, default=TraceConfig.prompt_len, help="A..B tokens")
    p.add_argument("--final-len", type=_int_range, default=TraceConfig.final_len, help="A..B tokens")
    p.add_argument("--decode-tokens", type=int, default=TraceConfig.decode_tokens)
    p.add_argument("--admit-len", type=int, default=TraceConfig.admit_len)
    p.add_argument("--admit-reps", type=int, default=TraceConfig.admit_reps)
    p.add_argument("--seed", type=int, default=TraceConfig.seed)
    p.add_argument("--vmem-page-size", type=parse_size, default=None, help="vmem page size (default: driver's)")
    p.add_argument("--vmem-reserve", type=parse_size, default=None,
                   help="vmem kv_reserve_bytes (default: the option's)")
    p.add_argument("--idle-s", type=float, default=BenchConfig.idle_s, help="idle seconds after the burst")
    p.add_argument("--in-process", action="store_true", help="run every allocator in this process (tests)")
    p.add_argument("--worker-timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=None, help="start no allocator after this many seconds")
    p.add_argument("--peer-source", action="append", default=[], help="NAME=TEXT recorded in the results")
    p.add_argument("--commit", default=None, help="commit to record when the tree has no .git")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.worker:
        return _worker(args)
    if not args.out:
        p.error("--out is required")
    names = [n for n in args.allocators.split(",") if n]
    unknown = sorted(set(names) - set(ALLOCATORS))
    if unknown:
        p.error(f"unknown allocator(s) {unknown}; choose from {list(ALLOCATORS)}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        cfg = TraceConfig(num_seqs=args.num_seqs, prompt_len=args.prompt_len, final_len=args.final_len,
                          decode_tokens=args.decode_tokens, admit_len=args.admit_len, admit_reps=args.admit_reps,
                          seed=args.seed)
    except ValueError as e:
        p.error(str(e))
    bench = BenchConfig(model=args.model, dtype=args.dtype, device=device, kv_memory_bytes=args.kv_memory,
                        max_num_seqs=cfg.num_seqs + 1, max_model_len=cfg.max_len,
                        vmem_page_size_bytes=args.vmem_page_size, vmem_reserve_bytes=args.vmem_reserve,
                        idle_s=args.idle_s)
    env = report.environment(["python3", "-m", "vmkv.compare.alloc_peers",
                              *(sys.argv[1:] if argv is None else argv)], seed=args.seed)
    if args.commit:
        env["git_commit"] = args.commit
    results = run_all(names, bench, cfg, in_process=args.in_process, timeout_s=args.worker_timeout_s,
                      deadline_s=args.deadline_s)
    payload = {"kind": "alloc_peers", "environment": env, "bench": asdict(bench), "trace": asdict(cfg),
               "trace_digest": trace_digest(make_trace(cfg)), "bytes_per_token": bench.spec().bytes_per_token,
               "peer_sources": _peer_sources(args.peer_source), "results": results}
    out = Path(args.out)
    write_report(out, payload)
    console = report.console()
    console.print(report.make_table(f"allocator peers ({device})", columns(cfg.admit_len), rows(results)))
    console.print(f"wrote {out}/alloc_peers.json, alloc_peers.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
