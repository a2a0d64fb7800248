"""Where a decode step's host time goes, on CUDA: ``python profile_step.py OUT_DIR [backend ...]``.

For each backend, builds the engine ``vmkv compare step`` builds (random-weight Llama-3-8B shape, bf16,
async scheduling, CUDA graphs), brings B sequences of L prompt tokens to decode, then profiles 6 decode
steps with torch.profiler (CPU and CUDA activity) and writes, per (backend, B, L): the CUDA runtime calls
that can block the host (count and total ms), the top host ops by self CPU time, and the step times.
A measurement script for issue 11's closing note, not part of the product.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
            "cudaMemcpyAsync", "cudaHostAlloc", "cudaGraphLaunch", "cudaLaunchKernel")


def run(backend: str, points, out_dir: str) -> list:
    engine = LLMEngine.from_args(model=None, kv_backend=backend, device="cuda", dtype="bfloat16",
                                 random_weights="llama3-8b", max_num_seqs=256, max_num_batched_tokens=16384,
                                 max_model_len=2128, seed=0, async_scheduling=True)
    rows = []
    for batch, ctx in points:
        for i in range(batch):
            ids = torch.randint(10, 500, (ctx,), generator=torch.Generator().manual_seed(i)).tolist()
            engine.add_request(f"{batch}-{ctx}-{i}", None,
                               SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True),
                               prompt_token_ids=ids)
        for _ in range(12 + batch * ctx // 8000):       # prefill (chunked) and a few decode steps
            engine.step()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                engine.step()
            torch.cuda.synchronize()
        name = f"{backend}_B{batch}_L{ctx}"
        prof.export_chrome_trace(os.path.join(out_dir, name + ".trace.json"))
        avgs = prof.key_averages()
        runtime = {e.key: {"count": e.count, "total_ms": e.cpu_time_total / 1e3}
                   for e in avgs if any(e.key.startswith(b) for b in BLOCKING)}
        top = sorted(avgs, key=lambda e: -e.self_cpu_time_total)[:30]
        row = {"backend": backend, "batch": batch, "context": ctx, "step_ms_unprofiled": times,
               "runtime_calls_6_steps": runtime,
               "top_self_cpu_ms_6_steps": [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in top]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("backend", "batch", "context", "runtime_calls_6_steps")}), flush=True)
        print("  step ms", [round(t, 2) for t in times], flush=True)
        for i in range(batch):
            engine.abort_request(f"{batch}-{ctx}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
    engine.close()
    return rows


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    result = []
    for b in sys.argv[2:] or ["paged", "vmem"]:
        result += run(b, [(1, 1024), (256, 1024)], out)
    with open(os.path.join(out, "profile_step.json"), "w") as f:
        json.dump(result, f, indent=1)
