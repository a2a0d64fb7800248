"""Decode step time, eager vs CUDA graphs, both backends: B sequences at context L (llama3-8b random, bf16)."""
import json, sys, time, torch
from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams, RequestOutputKind

def run(backend, eager, B, L, steps=20):
    cfg = EngineConfig.from_args(None, backend, "cuda", "bfloat16", random_weights="llama3-8b",
                                 max_num_seqs=max(B, 1), max_model_len=L + 256, max_num_batched_tokens=16384,
                                 memory_bytes=40 << 30, enforce_eager=eager, seed=0)
    e = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    for i in range(B):
        e.add_request(f"r{i}", None, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY),
                      prompt_token_ids=torch.randint(0, 32000, (L,), generator=g).tolist())
    while e.get_stats().num_generation_tokens_total < B:
        e.step()
    for _ in range(3): e.step()
    torch.cuda.synchronize(); t = []
    for _ in range(steps):
        t0 = time.perf_counter(); e.step(); torch.cuda.synchronize(); t.append(time.perf_counter() - t0)
    t.sort(); st = e.get_stats()
    gpu_ms = None
    cg = e.runner.cuda_graphs
    if cg is not None:
        size = cg.size_for([type("S", (), {"num_new_tokens": 1})()] * B)
        graph = cg._graphs[size].graph
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20): graph.replay()
        b.record(); torch.cuda.synchronize(); gpu_ms = a.elapsed_time(b) / 20
    r = dict(backend=backend, eager=eager, B=B, L=L, step_ms_median=1e3 * t[len(t)//2], step_ms_min=1e3*t[0],
             graph_steps=st.num_cuda_graph_steps_total, capture_s=st.cuda_graph_capture_s,
             graph_mem_gib=st.cuda_graph_memory_bytes / 2**30, gpu_replay_ms=gpu_ms)
    print(json.dumps(r), flush=True)
    e.close(); del e; torch.cuda.empty_cache()
    return r

out = []
EAGER = [False] if len(sys.argv) > 2 else [True, False]
for B, L in [(1, 1024), (64, 2048), (256, 1024)]:
    for backend in ("paged", "vmem"):
        for eager in EAGER:
            try:
                out.append(run(backend, eager, B, L))
            except Exception as exc:
                print("FAILED", backend, eager, B, L, repr(exc), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
