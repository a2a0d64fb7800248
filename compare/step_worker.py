"""One backend of ``vmkv compare step`` in a fresh process: ``python -m vmkv.compare.step_worker CFG.json OUT.json``.

:mod:`vmkv.compare.step_bench` starts one worker per backend, so each measures from an empty device.  The
worker first measures the device's read bandwidth (a ``sum`` over a large buffer, best of several, freed
before the engine is built), then builds one :class:`~vmkv.engine.LLMEngine` with random weights and, for
every grid point ``(B, L)``:

1. adds ``B`` requests of ``L`` seeded random prompt ids (``ignore_eos``, ``max_tokens`` large enough that
   nobody finishes during the measurement);
2. steps the engine until every request has its first token (every prefill has finished);
3. runs ``warmup_steps`` decode steps, then ``steps + 1`` back-to-back calls of ``engine.step()`` as a
   serving loop makes them (the device synchronised once, before the first): a step's time is the interval
   between two consecutive returns of ``engine.step()``, so with ``--async-scheduling`` the overlap of one
   step's host work with the next step's forward counts, as it does in serving (a synchronisation after
   every step would drain the step launched ahead); the first call's interval, from the synchronised start,
   is not a period and is dropped.  Every step is checked to be decode-only: each of the ``B`` requests
   produced exactly one token, and over the window the engine's counters grew by exactly ``B`` generated
   tokens per step and no prompt token (a step that is not is an error of the point);
4. on CUDA, runs ``profile_steps`` more decode steps under ``torch.profiler`` (CUDA activity only) and
   reports the GPU-busy share: the union of the kernel, memcpy and memset intervals / the wall time of
   those steps;
5. aborts the requests and drains the engine.

The floor of a step is ``(weight bytes + KV bytes read) / read bandwidth``, KV bytes read being every
position each sequence attends to (``L + tokens generated so far``) times ``KVCacheSpec.bytes_per_token``;
weight bytes count every parameter once (the embedding table too, as issue 11's 16.1 GB does).
Progress goes to stdout as JSON lines, logs to stderr, the result to ``OUT.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time

import numpy as np

from vmkv.compare.worker_proc import worker_main

logger = logging.getLogger(__name__)

__all__ = ["run_worker", "read_bandwidth", "busy_us", "max_tokens_for", "main"]


def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def max_tokens_for(batch: int, context: int, max_num_batched_tokens: int, num_decode_steps: int) -> int:
    """``max_tokens`` of a point's requests: the prefill phase's steps (a request whose prefill ended early
    decodes once per step while the others prefill: at most ``ceil(B * L / (budget - B)) + 2`` steps) plus
    every decode step the point runs, plus a margin, so no request finishes while it is measured."""
    prefill_steps = math.ceil(batch * context / max(1, max_num_batched_tokens - batch)) + 2
    return prefill_steps + num_decode_steps + 2


def read_bandwidth(device, *, buffer_bytes: int | None = None, repeats: int = 10) -> dict:
    """Read bandwidth of ``device`` from ``x.sum()`` over a float32 buffer far larger than L2 (4 GiB on
    CUDA, 64 MiB on CPU), best of ``repeats`` after two warm-ups (CUDA events; wall clock on CPU).
    Bytes counted: the buffer, read once."""
    import torch

    cuda = device.type == "cuda"
    nbytes = buffer_bytes or ((4 << 30) if cuda else (64 << 20))
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_(-1, 1)
    samples_ms = []
    for i in range(repeats + 2):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            x.sum()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            x.sum()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 2:
            samples_ms.append(ms)
    del x
    if cuda:
        torch.cuda.empty_cache()
    best = min(samples_ms)
    return {"method": "sum over a float32 buffer, best of %d (%s)" % (repeats, "CUDA events" if cuda else
                                                                      "wall clock"),
            "buffer_bytes": nbytes, "best_ms": best, "samples_ms": samples_ms,
            "bytes_per_s": nbytes / (best * 1e-3)}


def busy_us(trace_events: list[dict]) -> float:
    """Microseconds during which at least one device kernel, memcpy or memset ran: the union of the
    intervals of a chrome trace's ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` events (overlapping
    kernels on several streams count once)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in trace_events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e)
    total, end = 0.0, -math.inf
    for s, e in spans:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


class _Point:
    """One ``(B, L)`` point on a built engine: its requests, the decode-only checks and the timings."""

    def __init__(self, engine, batch: int, context: int, cfg: dict) -> None:
        self.engine, self.batch, self.context, self.cfg = engine, batch, context, cfg
        self.cuda = engine.device.type == "cuda"
        self.generated: dict[str, int] = {}

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.engine.device)

    def add_requests(self) -> None:
        from vmkv.engine.sampling_params import SamplingParams

        rng = np.random.default_rng([int(self.cfg["seed"]), self.batch, self.context])
        vocab = self.engine.model_config.vocab_size
        prompts = rng.integers(0, vocab, size=(self.batch, self.context))
        max_tokens = max_tokens_for(self.batch, self.context, self.cfg["max_num_batched_tokens"],
                                    self.cfg["warmup_steps"] + self.cfg["steps"] + self.cfg["profile_steps"] + 3)
        params = SamplingParams(temperature=float(self.cfg["temperature"]), max_tokens=max_tokens, ignore_eos=True)
        for i, ids in enumerate(prompts):
            rid = f"b{self.batch}-l{self.context}-{i}"
            self.engine.add_request(rid, None, params, prompt_token_ids=ids.tolist())
            self.generated[rid] = 0
        self.max_tokens = max_tokens

    def _collect(self, outputs) -> dict[str, int]:
        new = {}
        for out in outputs:
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            n = len(out.outputs[0].delta_token_ids)
            new[out.request_id] = n
            self.generated[out.request_id] += n
        return new

    def prefill(self) -> tuple[int, float]:
        """Step until every request has its first token; returns ``(steps, seconds)``."""
        limit = max_tokens_for(self.batch, self.context, self.cfg["max_num_batched_tokens"], 0) + 16
        t0 = time.perf_counter()
        steps = 0
        while min(self.generated.values()) == 0:
            self._collect(self.engine.step())
            steps += 1
            if steps > limit:
                raise RuntimeError(f"prefill of {self.batch} x {self.context} tokens not done after {steps} steps")
        self.sync()
        return steps, time.perf_counter() - t0

    def decode_steps(self, n: int) -> dict:
        """``n`` checked decode-only steps timed back to back (module docstring, step 3): ``{"steps": [per
        step: step_s, kv_tokens_read, new tokens], "num_calls": n + 1, "alloc_s", "prefetch_s",
        "release_s": totals over those n + 1 calls}``."""
        eng = self.engine
        self.sync()
        st0, rel0 = eng.get_stats(), getattr(eng.runner, "release_time_s_total", 0.0)
        rows, t_prev = [], time.perf_counter()
        for i in range(n + 1):
            kv_tokens = sum(self.context + g for g in self.generated.values())
            outputs = eng.step()
            t = time.perf_counter()
            new = self._collect(outputs)
            if len(new) != self.batch or any(k != 1 for k in new.values()):
                raise RuntimeError(f"step is not decode-only with {self.batch} sequences: {len(new)} requests "
                                   f"produced {sorted(set(new.values()))} tokens")
            if i:           # the first interval starts at the synchronised start: not a period
                rows.append({"step_s": t - t_prev, "kv_tokens_read": kv_tokens,
                             "num_seqs_with_one_new_token": len(new)})
            t_prev = t
        st1, rel1 = eng.get_stats(), getattr(eng.runner, "release_time_s_total", 0.0)
        decode = st1.num_generation_tokens_total - st0.num_generation_tokens_total
        prompt = st1.num_prompt_tokens_total - st0.num_prompt_tokens_total
        if decode != self.batch * (n + 1) or prompt != 0:
            raise RuntimeError(f"{n + 1} steps of {self.batch} sequences computed {decode} decode and {prompt} "
                               "prompt tokens: not decode-only")
        return {"steps": rows, "num_calls": n + 1, "alloc_s": st1.alloc_time_s_total - st0.alloc_time_s_total,
                "prefetch_s": st1.prefetch_time_s_total - st0.prefetch_time_s_total, "release_s": rel1 - rel0,
                "num_running_seqs": st1.num_running_seqs}

    def profile(self, n: int) -> dict:
        """GPU-busy share over ``n`` decode steps (torch.profiler, CUDA activity only)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.sync()
            t0 = time.perf_counter()
            rows = self.decode_steps(n)["steps"]
            self.sync()
            wall_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f).get("traceEvents", [])
        busy_s = busy_us(events) * 1e-6
        return {"method": "torch.profiler (CUDA activity): union of kernel/memcpy/memset intervals / wall time "
                          f"of {n + 1} further decode steps", "num_steps": n + 1, "wall_s": wall_s, "busy_s": busy_s,
                "busy_pct": 100.0 * busy_s / wall_s if wall_s > 0 else None,
                "kernel_ms_per_step": busy_s / (n + 1) * 1e3, "steps": rows}

    def finish(self) -> None:
        for rid in list(self.generated):
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _summary(window: dict, batch: int, weight_bytes: int, bytes_per_token: int, bw: float) -> dict:
    steps = window["steps"]
    ms = np.asarray([s["step_s"] for s in steps]) * 1e3
    kv_bytes = float(np.mean([s["kv_tokens_read"] for s in steps])) * bytes_per_token
    floor_ms = (weight_bytes + kv_bytes) / bw * 1e3
    median = float(np.median(ms))
    # the window's KV time totals cover every call, the first (untimed) one included
    kv_ms = {k: window[k + "_s"] / window["num_calls"] * 1e3 for k in ("alloc", "prefetch", "release")}
    return {"step_ms": median, "step_ms_p10": float(np.percentile(ms, 10)), "step_ms_p90": float(np.percentile(ms, 90)),
            "step_ms_mean": float(ms.mean()), "step_ms_max": float(ms.max()),
            **{f"{k}_ms_per_step": v for k, v in kv_ms.items()}, "kv_bytes_read": kv_bytes, "floor_ms": floor_ms,
            "floor_over_step": floor_ms / median,
            "output_tok_s": batch / (median * 1e-3)}      # at the median step, as the table's step ms


def run_point(engine, batch: int, context: int, cfg: dict, weight_bytes: int, bytes_per_token: int,
              bw: float) -> dict:
    """Measure one ``(B, L)`` point (module docstring, steps 1-5)."""
    p = _Point(engine, batch, context, cfg)
    p.add_requests()
    try:
        prefill_steps, prefill_s = p.prefill()
        warm = p.decode_steps(cfg["warmup_steps"])["steps"] if cfg["warmup_steps"] else []
        window = p.decode_steps(cfg["steps"])
        steps = window["steps"]
        busy = p.profile(cfg["profile_steps"]) if p.cuda and cfg["profile_steps"] > 0 else None
    finally:
        p.finish()
    out = {"batch": batch, "context": context, "max_tokens": p.max_tokens, "prefill_steps": prefill_steps,
           "prefill_s": prefill_s, "warmup_steps": len(warm), "num_steps": len(steps), "decode_only": True,
           "num_running_seqs": window["num_running_seqs"],
           "window_kv_s": {k: window[k] for k in ("num_calls", "alloc_s", "prefetch_s", "release_s")},
           "weight_bytes": weight_bytes, "kv_bytes_per_token": bytes_per_token, "read_bytes_per_s": bw,
           **_summary(window, batch, weight_bytes, bytes_per_token, bw),
           "gpu_busy_pct": busy["busy_pct"] if busy else None,
           "gpu_kernel_ms_per_step": busy["kernel_ms_per_step"] if busy else None,
           "gpu_busy": busy, "steps": steps}
    return out


def run_worker(cfg: dict, progress=_emit) -> dict:
    """Run every grid point of ``cfg`` on one backend; returns the result dict."""
    import torch

    from vmkv.engine.llm_engine import LLMEngine

    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg["torch_threads"]))
    device = torch.device(cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    bw = read_bandwidth(device, buffer_bytes=cfg.get("bandwidth_buffer_bytes"))
    progress({"event": "bandwidth", "bytes_per_s": bw["bytes_per_s"]})
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(model=None, kv_backend=cfg["backend"], device=cfg.get("device"),
                                 dtype=cfg.get("dtype"), **cfg["knobs"])
    load_s = time.perf_counter() - t0
    spec = engine.model_config.kv_spec(engine.device, engine.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    progress({"event": "loaded", "load_s": load_s})
    result = {"backend": cfg["backend"], "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
              "device_name": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
              "load_s": load_s, "read_bandwidth": bw, "weight_bytes": weight_bytes,
              "kv_bytes_per_token": spec.bytes_per_token, "resolved": str(engine.resolved),
              "enforce_eager": engine.config.enforce_eager, "cuda_graph_sizes": engine.config.cuda_graph_sizes,
              "points": []}
    for batch, context in cfg["points"]:
        try:
            row = run_point(engine, batch, context, cfg, weight_bytes, spec.bytes_per_token, bw["bytes_per_s"])
        except Exception as exc:  # one failing point must not end the run
            logger.exception("point B=%d L=%d failed", batch, context)
            row = {"batch": batch, "context": context, "error": f"{type(exc).__name__}: {exc}"[:800]}
            engine_ok = _drain(engine)
            result["points"].append(row)
            if not engine_ok:
                break
            continue
        result["points"].append(row)
        progress({"event": "point", "batch": batch, "context": context, "step_ms": row["step_ms"]})
    if engine.device.type == "cuda":
        result["torch_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(engine.device))
    engine.close()
    return result


def _drain(engine) -> bool:
    """Abort everything after a failed point; False when the engine cannot be drained."""
    try:
        for rid in list(engine.requests.groups):
            engine.abort_request(rid)
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                return True
            engine.step()
    except Exception:  # noqa: BLE001 - reported by the caller's row
        logger.exception("engine could not be drained")
    return False


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "vmkv.compare.step_worker", run_worker)


if __name__ == "__main__":
    sys.exit(main())
