"""One engine run in a fresh process: ``python -m vmkv.compare.engine_worker CONFIG.json OUT.json``.

:mod:`vmkv.compare.engine_bench` starts one worker per (backend, scenario), so every run begins with
an empty device and its memory is measured cleanly.  The worker builds the engine, regenerates the
seeded workload (identical on every backend: the result carries its fingerprint), warms up, then
drives the engine:

- offline: every request arrives at t=0 (``ignore_eos``, so output lengths are exact);
- online: requests are added when the wall clock reaches their (Poisson/gamma) arrival time, with
  that arrival time, so TTFT includes queueing.

After every step it samples the KV cache's :class:`~vmkv.kvcache.CacheUsage`, the engine's stats and the
physical KV memory held (:mod:`vmkv.engine.kv_memory`: created / mapped / in use / idle bytes) next to
the device memory in use, with the seconds since the start, so the report plots memory following the load.
Progress goes to stdout as JSON lines (``{"event": "progress", "done": k, "total": n}``); logs go to
stderr; the result (summary plus every raw sample) is written to ``OUT.json``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter, deque

import numpy as np

from vmkv.compare.metrics import SLO, RequestRecord, compute_serving_metrics, summarize
from vmkv.compare.worker_proc import worker_main
from vmkv.compare.workloads import Request, WorkloadSpec, fingerprint, generate

from vmkv.engine.kv_memory import created_bytes, device_memory_used_bytes, kv_breakdown

logger = logging.getLogger(__name__)

#: columns sampled after every step (``steps`` in the raw output).  ``t_s``: seconds since the run's
#: start; ``created_bytes`` / ``mapped_bytes`` / ``in_use_bytes`` / ``idle_bytes``: physical KV memory
#: that exists / is mapped / is claimed by live sequences (= ``allocated_bytes``) / exists but backs no
#: live sequence; ``device_used_bytes``: device memory in use (CUDA: total - free; CPU: process RSS).
#: The memory breakdown (the paper's Fig. 2, :func:`vmkv.engine.kv_memory.kv_breakdown`): ``token_bytes``
#: + ``reserved_unused_bytes`` + ``waste_bytes`` (block or page tails) + ``idle_bytes`` = ``created_bytes``
#: (``reserved_unused_bytes`` and ``waste_bytes`` as the breakdown clamps them).  ``num_running_seqs``:
#: sequences in the running batch (the batch size, Fig. 13).
STEP_COLUMNS = ("t_s", "step_s", "alloc_s", "num_running", "num_waiting", "num_seqs", "used_tokens",
                "allocated_bytes", "mapped_bytes", "waste_bytes", "free_tokens", "created_bytes", "in_use_bytes",
                "idle_bytes", "device_used_bytes", "reserved_unused_bytes", "token_bytes", "num_running_seqs")

#: the parts of the memory breakdown among :data:`STEP_COLUMNS`, bottom of the stack first
BREAKDOWN_COLUMNS = ("token_bytes", "reserved_unused_bytes", "waste_bytes", "idle_bytes")

#: columns sampled while the engine waits for the next arrival (online runs; ``idle_memory`` in the raw
#: output, at most every ``STATS_INTERVAL_S``): the memory a backend gives back between bursts shows there
IDLE_COLUMNS = ("t_s", "created_bytes", "mapped_bytes", "in_use_bytes", "idle_bytes", "device_used_bytes")

#: idle gaps are sampled at most this often (seconds)
STATS_INTERVAL_S = 0.05


def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class _Sampler:
    """Per-step samples of the cache and engine (columnar lists)."""

    def __init__(self, engine, start: float, alloc_s0: float, cuda_device) -> None:
        self.engine, self.start, self.prev_alloc_s, self.cuda_device = engine, start, alloc_s0, cuda_device
        self.cols = {c: [] for c in STEP_COLUMNS}
        self.overhead_s = 0.0
        self.max_running = 0
        self.idle_cols = {c: [] for c in IDLE_COLUMNS}

    def sample_idle(self) -> None:
        """Append one ``idle_memory`` row (no step ran): at most every ``STATS_INTERVAL_S``."""
        t0 = time.perf_counter()
        ts = self.idle_cols["t_s"]
        if ts and t0 - self.start - ts[-1] < STATS_INTERVAL_S:
            return
        u = self.engine.kv_cache.usage()
        created = created_bytes(u)          # O(1): reading it never perturbs the run
        row = (t0 - self.start, created, u.mapped_bytes, u.allocated_bytes, max(0, created - u.allocated_bytes),
               device_memory_used_bytes(self.cuda_device))
        for c, v in zip(IDLE_COLUMNS, row):
            self.idle_cols[c].append(v)
        self.overhead_s += time.perf_counter() - t0

    def sample(self, final: bool = False) -> None:
        """Append one row (``final``: the run's last)."""
        t0 = time.perf_counter()
        st = self.engine.get_stats()
        u = st.kv_usage
        created = created_bytes(u)
        critical = st.alloc_time_s_total - st.alloc_ahead_time_s_total      # not overlapped with the GPU
        b = kv_breakdown(u.allocated_bytes, u.waste_bytes, st.reserved_unused_bytes, created)
        row = (t0 - self.start, st.last_step_time_s, critical - self.prev_alloc_s, st.num_running,
               st.num_waiting, u.num_seqs, u.used_tokens, u.allocated_bytes, u.mapped_bytes, b.tail_bytes,
               u.free_tokens, created, u.allocated_bytes, b.idle_bytes,
               device_memory_used_bytes(self.cuda_device), b.reserved_unused_bytes, b.token_bytes,
               st.num_running_seqs or st.num_running)
        self.prev_alloc_s = critical
        self.max_running = max(self.max_running, st.num_running)
        for c, v in zip(STEP_COLUMNS, row):
            self.cols[c].append(v)
        self.overhead_s += time.perf_counter() - t0


def breakdown_summary(cols: dict) -> dict:
    """The memory breakdown of a run's steps (``cols``: :data:`STEP_COLUMNS` lists): for each part of
    :data:`BREAKDOWN_COLUMNS` and ``created_bytes``, its mean and peak bytes over the steps
    (``<part>_mean`` / ``<part>_peak``); ``<part>_pct``: the part's share of the created bytes summed
    over the steps (the four add up to 100); ``in_use_<part>_pct`` for the three parts of the in-use
    memory (token, reserved unused, tail): their share of the in-use bytes (the paper's Fig. 2 view:
    what the memory requests hold is spent on).  Zeros for a run without steps."""
    out: dict = {}
    n = len(cols.get("t_s", ()))
    total = {k: float(sum(cols.get(k, ()) or ())) for k in BREAKDOWN_COLUMNS + ("created_bytes",)}
    for k in BREAKDOWN_COLUMNS + ("created_bytes",):
        name = "tail_bytes" if k == "waste_bytes" else k
        vals = cols.get(k) or []
        out[name.removesuffix("_bytes") + "_bytes_mean"] = total[k] / n if n else 0.0
        out[name.removesuffix("_bytes") + "_bytes_peak"] = int(max(vals, default=0))
    in_use = sum(total[k] for k in BREAKDOWN_COLUMNS[:3])
    for k in BREAKDOWN_COLUMNS:
        name = ("tail_bytes" if k == "waste_bytes" else k).removesuffix("_bytes")
        out[f"{name}_pct"] = 100 * total[k] / total["created_bytes"] if total["created_bytes"] else 0.0
        if k != "idle_bytes":
            out[f"in_use_{name}_pct"] = 100 * total[k] / in_use if in_use else 0.0
    return out


def _params(req: Request, temperature: float):
    from vmkv.engine.sampling_params import RequestOutputKind, SamplingParams

    # the worker reads finished outputs only (token times come from the request's metrics)
    return SamplingParams(n=req.n, temperature=temperature, top_p=1.0, max_tokens=req.output_len,
                          ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def _record(out, req: Request) -> RequestRecord:
    m = out.metrics
    lens = [len(o.token_ids) for o in out.outputs]
    reasons = [o.finish_reason for o in out.outputs]
    ok = all(r in ("length", "stop") for r in reasons)
    return RequestRecord(
        request_id=out.request_id, prompt_len=len(out.prompt_token_ids), output_len=max(lens, default=0),
        arrival_time=m.arrival_time, first_token_time=m.first_token_time,
        finish_time=m.last_token_time if m.last_token_time is not None else m.finished_time,
        token_times=list(m.token_times), num_output_tokens=sum(lens), success=ok,
        error="" if ok else f"finish reasons {reasons}")


def _drive(engine, requests: list[Request], temperature: float, online: bool, sampler: _Sampler | None,
           on_finish=None) -> tuple[dict, float, float]:
    """Run ``requests`` to completion.  Returns ``({request_id: RequestOutput}, start, end)``."""
    by_id = {r.request_id: r for r in requests}
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    finished: dict = {}
    start = time.perf_counter()
    if sampler is not None:
        sampler.start = start
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and (not online or pending[0].arrival_s <= now - start):
            r = pending.popleft()
            engine.add_request(r.request_id, None, _params(r, temperature), prompt_token_ids=r.prompt_token_ids,
                               arrival_time=start + r.arrival_s if online else start)
        if not engine.has_unfinished_requests():
            engine.idle()                   # as the server does between requests (vmem may shrink)
            if sampler is not None:
                sampler.sample_idle()
            time.sleep(max(0.0, min(0.05, pending[0].arrival_s - (time.perf_counter() - start))))
            continue
        for out in engine.step():
            if out.finished and out.request_id in by_id:
                finished[out.request_id] = out
                if on_finish:
                    on_finish(len(finished))
        if sampler is not None:
            sampler.sample(final=not pending and not engine.has_unfinished_requests())
    return finished, start, time.perf_counter()


def _warm_mixed(engine, requests: list[Request], temperature: float) -> None:
    """Run ``requests[0]`` until it decodes, then add the rest (prompts beside a decode), to the end."""
    first, rest = requests[0], requests[1:]
    engine.add_request(first.request_id, None, _params(first, temperature), prompt_token_ids=first.prompt_token_ids)
    for _ in range(2):
        engine.step()
    for r in rest:
        engine.add_request(r.request_id, None, _params(r, temperature), prompt_token_ids=r.prompt_token_ids)
    while engine.has_unfinished_requests():
        engine.step()


def _backend_snapshot(kv_cache) -> tuple[dict, dict[str, list[float]]]:
    """``(kv_cache.backend_stats(), kv_cache.backend_samples())``: the backend's counters and its raw
    per-event samples (vmem: ``map_us``/``unmap_us``; ``{}`` for a backend that keeps none)."""
    return dict(kv_cache.backend_stats()), {k: list(v) for k, v in kv_cache.backend_samples().items()}


def _counter_deltas(before: dict, after: dict) -> dict:
    """``after`` with ``<counter>_run`` = after - before for every int ``num_*`` counter: the measured
    run's share, warm-up excluded."""
    out = dict(after)
    for k, v in after.items():
        if k.startswith("num_") and isinstance(v, int) and not isinstance(v, bool):
            out[k + "_run"] = v - int(before.get(k, 0))
    return out


def _vmm_delta(before: dict, after: dict, samples: dict[str, list[float]]) -> tuple[dict | None, dict]:
    """Map/unmap counts and latency summaries of the measured run (warm-up excluded) and the raw
    samples apart (``samples``: :meth:`KVCache.backend_samples` after the run); ``(None, {})`` for a
    backend that maps no pages (no ``num_maps`` counter)."""
    if "num_maps" not in after:
        return None, {}
    out = _counter_deltas(before, after)
    raw = {}
    for key, count in (("map_us", "num_maps"), ("unmap_us", "num_unmaps")):
        new = out[count + "_run"]
        run = samples.get(key, [])
        run = run[len(run) - min(new, len(run)):] if new > 0 else []
        raw[key] = [round(x, 3) for x in run]
        out[key] = summarize(run)
    return out, raw


def warmup_sets(cfg: dict, spec: WorkloadSpec, requests: list[Request], max_model_len: int,
                vocab_size: int) -> list[tuple[str, list[Request]]]:
    """The warm-up run before the measured one, as ``[(kind, requests), ...]`` in order (``kind``:
    ``"offline"``, all at once to the end, or ``"mixed"``, the first request decoding when the others
    arrive); ``[]`` for ``warmup_requests: 0``.  Random tokens other than the run's (seeds past
    ``spec.seed``), ids ``warmup-...``.  ``vmkv compare serve`` sends the same sets to its servers.

    - prompts up to the longest measured one (or, ``warmup_fill_budget``, as many of the longest as fill
      one step's token budget, as vLLM's start-up profile run does): activation memory and GEMM
      configurations at that size are paid here;
    - short prompts (4..12 tokens): the prefill kernel's configuration for short query lengths (the tails
      of chunked prompts in mixed steps) compiles here;
    - a prompt admitted while another request decodes: a mixed step (decode rows through the decode
      kernel, the prompt through the prefill kernel).
    """
    num_warm = int(cfg.get("warmup_requests", 2))
    if not num_warm:
        return []
    knobs = cfg.get("knobs", {})
    budget = int(knobs.get("max_num_batched_tokens", 2048))
    max_prompt = min(max(r.prompt_len for r in requests), max_model_len - 9, budget)
    if cfg.get("warmup_fill_budget"):
        fill = min(max(num_warm, -(-budget // max(1, max_prompt))), int(knobs.get("max_num_seqs", num_warm)))
        warm = WorkloadSpec(num_requests=fill, input_len=f"{max(1, max_prompt)}", output_len="8",
                            seed=spec.seed + 7919)
    else:
        warm = WorkloadSpec(num_requests=num_warm, input_len=f"{max(1, max_prompt // 2)}..{max(1, max_prompt)}",
                            output_len="8", seed=spec.seed + 7919)
    wreqs = generate(warm, vocab_size)
    short = generate(WorkloadSpec(num_requests=num_warm, input_len="4..12", output_len="4",
                                  seed=spec.seed + 7920), vocab_size)
    for i, r in enumerate(wreqs + short):
        r.request_id = f"warmup-{i}-{r.request_id}"
    mixed = generate(WorkloadSpec(num_requests=2, input_len=f"{max(1, max_prompt // 4)}..{max(1, max_prompt // 2)}",
                                  output_len="6", seed=spec.seed + 7921), vocab_size)
    for i, r in enumerate(mixed):
        r.request_id = f"warmup-mixed-{i}-{r.request_id}"
    return [("offline", wreqs), ("offline", short), ("mixed", mixed)]


def run_worker(cfg: dict, progress=_emit) -> dict:
    """Run one (backend, scenario) as described in the module docstring; returns the result dict."""
    import torch

    from vmkv.engine.llm_engine import LLMEngine

    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg["torch_threads"]))
    t_load = time.perf_counter()
    engine = LLMEngine.from_args(model=cfg.get("model"), kv_backend=cfg.get("kv_backend", cfg["backend"]), device=cfg.get("device"),
                                 dtype=cfg.get("dtype"), **cfg.get("knobs", {}))
    load_s = time.perf_counter() - t_load
    device = engine.device
    cuda_device = device if device.type == "cuda" else None
    spec = WorkloadSpec.from_dict(cfg["workload"])
    requests = generate(spec, engine.model_config.vocab_size)
    temperature = float(cfg.get("temperature", 1.0))
    progress({"event": "loaded", "load_s": load_s, "total": len(requests)})

    # warm-up (JIT compilation, allocator first touches) on different random tokens
    t_warm = time.perf_counter()
    for kind, reqs in warmup_sets(cfg, spec, requests, engine.max_model_len, engine.model_config.vocab_size):
        if kind == "mixed":
            _warm_mixed(engine, reqs, temperature)
        else:
            _drive(engine, reqs, temperature, online=False, sampler=None)
    warmup_s = time.perf_counter() - t_warm
    if cuda_device is not None:
        torch.cuda.synchronize(cuda_device)
        torch.cuda.reset_peak_memory_stats(cuda_device)

    st0 = engine.get_stats()
    stats0, _ = _backend_snapshot(engine.kv_cache)
    fwd0 = getattr(engine.runner, "forward_time_s_total", 0.0)
    pre0 = getattr(st0, "prefetch_time_s_total", 0.0)
    sampler = _Sampler(engine, time.perf_counter(), st0.alloc_time_s_total - st0.alloc_ahead_time_s_total,
                       cuda_device)
    last = [0.0]

    def on_finish(done: int) -> None:
        now = time.perf_counter()
        if done == len(requests) or now - last[0] > 0.2:
            last[0] = now
            progress({"event": "progress", "done": done, "total": len(requests)})

    cpu0 = time.process_time()
    outputs, start, end = _drive(engine, requests, temperature, online=not spec.is_offline, sampler=sampler,
                                 on_finish=on_finish)
    cpu_s = time.process_time() - cpu0     # every thread of this process (TP workers are processes apart)
    st1 = engine.get_stats()
    stats1, samples1 = _backend_snapshot(engine.kv_cache)
    by_id = {r.request_id: r for r in requests}
    records = [_record(outputs[r.request_id], r) for r in requests]
    mismatches = sum(1 for rec in records if rec.output_len != by_id[rec.request_id].output_len)
    reasons = Counter(o.finish_reason for out in outputs.values() for o in out.outputs)
    serving = compute_serving_metrics(records, end - start, SLO.parse(cfg.get("slo")))

    cols = sampler.cols
    alloc = np.asarray(cols["allocated_bytes"], dtype=np.float64)
    waste = np.asarray(cols["waste_bytes"], dtype=np.float64)
    used = np.asarray(cols["used_tokens"], dtype=np.float64)
    i_peak = int(alloc.argmax()) if alloc.size else 0
    u1 = st1.kv_usage
    u0 = st0.kv_usage
    q = u1.prefix_query_tokens - u0.prefix_query_tokens
    step_s = st1.step_time_s_total - st0.step_time_s_total
    alloc_s = st1.alloc_time_s_total - st0.alloc_time_s_total
    # allocation made while scheduling a step ahead (async scheduling): the device ran the previous step
    ahead_s = st1.alloc_ahead_time_s_total - st0.alloc_ahead_time_s_total
    prefetch_s = getattr(st1, "prefetch_time_s_total", 0.0) - pre0
    num_steps = st1.num_steps - st0.num_steps
    memory = {
        "capacity_bytes": u1.capacity_bytes,
        "reserved_bytes": u1.reserved_bytes,
        "peak_allocated_bytes": int(alloc.max()) if alloc.size else 0,
        "peak_mapped_bytes": int(max(cols["mapped_bytes"], default=0)),
        "mapped_bytes_after_warmup": u0.mapped_bytes,
        "peak_used_tokens": int(used.max()) if used.size else 0,
        "waste_pct_mean": float(100 * waste.sum() / alloc.sum()) if alloc.sum() else 0.0,
        "waste_pct_at_peak": float(100 * waste[i_peak] / alloc[i_peak]) if alloc.size and alloc[i_peak] else 0.0,
        "bytes_per_used_token_at_peak": float(alloc[i_peak] / used[i_peak]) if used.size and used[i_peak] else 0.0,
        "max_concurrent_seqs": int(max(cols["num_seqs"], default=0)),
        "max_running_requests": sampler.max_running,
        "preemptions": st1.num_preempted_total - st0.num_preempted_total,
        "prefix_hit_rate": (u1.prefix_hit_tokens - u0.prefix_hit_tokens) / q if q else 0.0,
        "cow_copies": u1.num_cow_copies - u0.num_cow_copies,
        "unit_tokens": u1.unit_tokens,
        "device_used_bytes_peak": int(max(cols["device_used_bytes"], default=0)),
        "device_used_bytes_final": int(cols["device_used_bytes"][-1]) if cols["device_used_bytes"] else 0,
        "device_memory_kind": "cuda mem_get_info total - free" if cuda_device else "process RSS",
        # physical KV memory held (vmem's shrink makes the final figure fall below the peak)
        "peak_created_bytes": int(max(cols["created_bytes"] + sampler.idle_cols["created_bytes"], default=0)),
        "final_created_bytes": int(cols["created_bytes"][-1]) if cols["created_bytes"] else 0,
        "final_in_use_bytes": int(cols["in_use_bytes"][-1]) if cols["in_use_bytes"] else 0,
        "peak_idle_bytes": int(max(cols["idle_bytes"], default=0)),
        # backed positions no step has written yet: a static reservation's reserved-but-unused KV
        "peak_reserved_unused_bytes": int(max(cols["reserved_unused_bytes"], default=0)),
        "reserved_unused_pct_mean": (float(100 * sum(cols["reserved_unused_bytes"]) / alloc.sum())
                                     if alloc.sum() else 0.0),
        "reservation_overruns": st1.num_reservation_overruns - st0.num_reservation_overruns,
        "breakdown": breakdown_summary(cols),
        "torch_max_allocated_bytes": int(torch.cuda.max_memory_allocated(cuda_device)) if cuda_device else 0,
    }
    vmm, vmm_raw = _vmm_delta(stats0, stats1, samples1)
    alloc_steps = np.asarray(cols["alloc_s"], dtype=np.float64) * 1e6
    allocation = {
        "alloc_time_s": alloc_s,
        "alloc_ahead_time_s": ahead_s,
        "step_time_s": step_s,
        # on the critical path: allocation not overlapped with the device's forward
        "alloc_share_pct": 100 * (alloc_s - ahead_s) / step_s if step_s else 0.0,
        "alloc_ahead_share_pct": 100 * ahead_s / step_s if step_s else 0.0,
        "alloc_us_per_step": summarize(alloc_steps),
        # KVCache.prefetch: host work overlapping the GPU's forward, not on the critical path
        "prefetch_time_s": prefetch_s,
        "prefetch_share_pct": 100 * prefetch_s / step_s if step_s else 0.0,
        "prefetch_tokens": getattr(engine.runner, "prefetch_tokens", 0),
        "forward_time_s": getattr(engine.runner, "forward_time_s_total", 0.0) - fwd0,
        "vmm": vmm,
        # KVCache.backend_stats() after the run, with the run's share of every num_* counter
        "backend_stats": _counter_deltas(stats0, stats1),
    }
    timing = {"load_s": load_s, "warmup_s": warmup_s, "run_s": end - start, "num_steps": num_steps,
              "cpu_s": cpu_s, "cores": cpu_s / (end - start) if end > start else None,
              "step_ms": summarize(cols["step_s"], 1e3), "sample_overhead_s": sampler.overhead_s,
              # CUDA graphs (capture at start-up, decode steps replayed in the run) and async scheduling
              "cuda_graph_capture_s": st1.cuda_graph_capture_s,
              "cuda_graph_memory_bytes": st1.cuda_graph_memory_bytes,
              "cuda_graph_steps": st1.num_cuda_graph_steps_total - st0.num_cuda_graph_steps_total,
              "ahead_steps": st1.num_ahead_steps_total - st0.num_ahead_steps_total}
    mc = engine.model_config
    result = {
        "backend": cfg["backend"],
        "kv_backend": cfg.get("kv_backend", cfg["backend"]),
        "kv_reservation": cfg.get("kv_reservation", "none"),
        "scenario": cfg["scenario"],
        "model": {"name": engine.model_name, "kind": "random-weights" if cfg.get("knobs", {}).get("random_weights")
                  else ("checkpoint" if cfg.get("model") else "default"), "source": cfg.get("model") or
                  cfg.get("knobs", {}).get("random_weights"), "num_layers": mc.num_layers,
                  "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "vocab_size": mc.vocab_size},
        "device": str(device),
        "device_name": torch.cuda.get_device_name(cuda_device) if cuda_device else "cpu",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_bytes_per_token": engine.kv_cache.spec.bytes_per_token,
        "max_model_len": engine.max_model_len,
        "config": cfg,
        "workload_fingerprint": fingerprint(requests),
        "serving": serving,
        "memory": memory,
        "allocation": allocation,
        "timing": timing,
        "output_len_mismatches": mismatches,
        "finish_reasons": dict(reasons),
        "raw": {"requests": [_raw_record(rec, start, by_id[rec.request_id]) for rec in records], "steps": cols,
                "idle_memory": sampler.idle_cols, "vmm_samples_us": vmm_raw},
    }
    engine.close()
    return result


def _raw_record(rec: RequestRecord, start: float, req: Request) -> dict:
    """A record with times relative to the run start, rounded to 1 us."""
    rel = (lambda t: None if t is None else round(t - start, 6))
    return {"id": rec.request_id, "prompt_len": rec.prompt_len, "output_len": rec.output_len,
            "target_output_len": req.output_len, "num_output_tokens": rec.num_output_tokens,
            "arrival_s": rel(rec.arrival_time), "first_token_s": rel(rec.first_token_time),
            "finish_s": rel(rec.finish_time), "token_times_s": [rel(t) for t in rec.token_times],
            "success": rec.success, "error": rec.error}


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "vmkv.compare.engine_worker", run_worker, indent=None)


if __name__ == "__main__":
    sys.exit(main())
