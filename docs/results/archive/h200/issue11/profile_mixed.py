"""Where a prefill/mixed step's time goes, on CUDA: ``python profile_mixed.py OUT_DIR [backend ...]``.

The offline workload of issue 11 (256 requests, prompts 512..2048 tokens, 256 output tokens,
``max_num_batched_tokens`` 8192, random-weight Llama-3-8B shape, bf16) spends two thirds of its time in
~42 steps that carry prompt chunks.  For each backend this builds that engine (synchronous scheduling,
CUDA graphs for the decode steps), adds the requests, and for every step until the last prompt is
admitted records the step's wall time (synchronised) with its prompt tokens and decode rows; three of
those steps run under torch.profiler, whose CUDA kernels are summed by kind (GEMM, prefill attention,
decode attention, write_kv, fused small ops, sampling, other).  Then it times ``F.linear`` at
M = 8192 on the model's four projection shapes (the GEMM ceiling of a step).  A measurement script
for issue 11's notes, not part of the product.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams

KINDS = (("prefill_attn", ("_prefill_kernel",)), ("decode_attn", ("_decode_split", "_decode_reduce")),
         ("write_kv", ("write_kv", "_write_kv")), ("gemm", ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas")),
         ("fused_ops", ("rms", "rope", "rotary", "silu")), ("sampling", ("sort", "softmax", "multinomial",
                                                                          "argmax", "topk", "cumsum")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def gemm_ceiling() -> list:
    rows = []
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            F.linear(x, w)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            F.linear(x, w)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        rows.append({"m": 8192, "n": n, "k": k, "ms": ms, "tflops": 2 * 8192 * n * k / ms / 1e9})
    return rows


#: a smoke run on a CPU: PROFILE_SMOKE=1 (tiny model, few requests)
SMOKE = os.environ.get("PROFILE_SMOKE") == "1"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(backend: str, out_dir: str) -> dict:
    engine = LLMEngine.from_args(model=None, kv_backend=backend, device="cpu" if SMOKE else "cuda",
                                 dtype="float32" if SMOKE else "bfloat16",
                                 random_weights="tiny" if SMOKE else "llama3-8b", max_num_seqs=256,
                                 max_num_batched_tokens=8192, max_model_len=2048 if SMOKE else 2304, seed=0,
                                 memory_bytes=(256 << 20) if SMOKE else 64 << 30)
    rng = random.Random(0)
    lens = [rng.randint(512, 1700 if SMOKE else 2048) for _ in range(12 if SMOKE else 256)]
    # warm-up: one short request compiles the prefill and decode kernels
    engine.add_request("warm", None, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
                       prompt_token_ids=[rng.randint(10, 300) for _ in range(700)])
    while engine.has_unfinished_requests():
        engine.step()
    for i, n in enumerate(lens):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True),
                           prompt_token_ids=[rng.randint(10, 300) for _ in range(n)])
    steps, profiled = [], []
    prompt_left = sum(lens)
    sched_seen = []
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        sched_seen.append(out)
        return out
    engine.scheduler.schedule = spy
    i = 0
    while prompt_left > 0 and i < 400:
        sync()
        prof = None
        if i in ((1, 2) if SMOKE else (10, 20, 30)):
            prof = profile(activities=[ProfilerActivity.CPU if SMOKE else ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        engine.step()
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        sched = sched_seen[-1]
        pre = sum(s.num_new_tokens for s in sched.scheduled if s.is_prefill)
        dec = sum(1 for s in sched.scheduled if not s.is_prefill)
        prompt_left -= pre
        row = {"step": i, "ms": ms, "prompt_tokens": pre, "decode_rows": dec}
        if prof is not None:
            prof.__exit__(None, None, None)
            by_kind: dict = {}
            top: dict = {}
            for e in prof.events():
                if e.device_type.name != ("CPU" if SMOKE else "CUDA"):
                    continue
                us = e.device_time if hasattr(e, "device_time") else e.cuda_time
                k = kind_of(e.name)
                by_kind[k] = by_kind.get(k, 0.0) + us / 1e3
                top[e.name[:80]] = top.get(e.name[:80], 0.0) + us / 1e3
            row["gpu_ms_by_kind"] = by_kind
            row["gpu_ms"] = sum(by_kind.values())
            row["top_kernels_ms"] = sorted(top.items(), key=lambda kv: -kv[1])[:15]
            profiled.append(row)
            print(json.dumps(row), flush=True)
        steps.append(row)
        i += 1
    engine.scheduler.schedule = orig
    for r in range(len(lens)):
        engine.abort_request(f"r{r}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    mixed = [s for s in steps if s["prompt_tokens"]]
    summary = {"backend": backend, "num_prompt_steps": len(mixed),
               "prompt_steps_ms_total": sum(s["ms"] for s in mixed),
               "prompt_tokens": sum(s["prompt_tokens"] for s in mixed),
               "steps": steps, "profiled": profiled}
    print(json.dumps({k: summary[k] for k in ("backend", "num_prompt_steps", "prompt_steps_ms_total",
                                               "prompt_tokens")}), flush=True)
    return summary


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    result = {"gemm_m8192": [] if SMOKE else gemm_ceiling()}
    print(json.dumps(result["gemm_m8192"]), flush=True)
    result["runs"] = [run(b, out) for b in sys.argv[2:] or ["paged", "vmem"]]
    with open(os.path.join(out, "profile_mixed.json"), "w") as f:
        json.dump(result, f, indent=1)
