"""CUDA-graph decode (vmkv.engine.cuda_graphs): capture sizes and the eager fallback on CPU; on CUDA,
greedy outputs of graph replay equal eager on both backends across bucket boundaries, and on vmem the
graph captured at start-up stays valid while pages are mapped underneath it (vAttention, section 6)."""

from __future__ import annotations

import pytest
import torch

from vmkv.engine.config import EngineConfig
from vmkv.engine.cuda_graphs import CUDAGraphRunner, build_cuda_graphs, default_capture_sizes
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams
from vmkv.kvcache import KVCacheSpec, create_kv_cache


def test_default_capture_sizes_are_vllms():
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(5) == (1, 2, 4, 5)
    sizes = default_capture_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 3 + 32
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)


def test_cpu_engine_runs_eagerly_and_reports_no_graphs():
    engine = LLMEngine(EngineConfig.from_args(None, "vmem", "cpu", "float32", random_weights="tiny",
                                              max_num_seqs=4, max_model_len=64))
    assert engine.runner.cuda_graphs is None
    engine.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       prompt_token_ids=[1, 2, 3])
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert (stats.num_cuda_graph_steps_total, stats.cuda_graph_capture_s, stats.cuda_graph_memory_bytes) == (0, 0, 0)
    engine.close()


@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_graphs_refused_off_cuda(backend):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    cache = create_kv_cache(backend, spec, max_num_seqs=2, max_model_len=32, memory_bytes=1 << 20)
    assert not cache.supports_cuda_graphs
    assert build_cuda_graphs(None, cache, torch.device("cpu"), enforce_eager=False, sizes=None,
                             max_num_seqs=2) is None
    with pytest.raises(ValueError, match="CUDA graphs"):
        CUDAGraphRunner(None, cache, torch.device("cpu"), [1])
    with pytest.raises(NotImplementedError):
        cache.capture_metadata(2, torch.zeros(64, dtype=torch.uint8))
    cache.close()


# ----------------------------------------------------------------------------------------- CUDA
BACKENDS = {
    "paged": ("paged", {"memory_bytes": 128 << 20}),
    "vmem-megacache": ("vmem", {"driver": "cuda", "layout": "megacache", "memory_bytes": 64 << 20}),
    "vmem-per_layer": ("vmem", {"driver": "cuda", "layout": "per_layer", "memory_bytes": 256 << 20}),
}


def _generate(backend: str, opts: dict, enforce_eager: bool, watch=None, async_scheduling: bool = False,
              after_start=None, max_model_len: int = 256):
    """Greedy outputs of 7 requests whose lengths make the decode batch shrink 7 -> 1 (buckets 8, 4,
    2, 1) on a float32 smollm2-135m-shaped random model (vmem megacache: ~45 tokens per 2 MiB page,
    so every sequence crosses pages while decode replays)."""
    cfg = EngineConfig.from_args(None, backend, "cuda", "float32", random_weights="smollm2-135m",
                                 max_num_seqs=8, max_model_len=max_model_len, max_num_batched_tokens=512,
                                 enforce_eager=enforce_eager, seed=5, async_scheduling=async_scheduling,
                                 **opts)
    engine = LLMEngine(cfg)
    if after_start is not None:
        after_start(engine)
    gen = torch.Generator().manual_seed(11)
    vocab = engine.model_config.vocab_size
    for i in range(7):
        prompt = torch.randint(0, vocab, (20 + 13 * i,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=16 + 12 * i, ignore_eos=True)
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        if watch is not None:
            watch(engine)
    stats = engine.get_stats()
    engine.close()
    return final, stats, engine


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BACKENDS))
def test_graph_replay_matches_eager(name):
    backend, opts = BACKENDS[name]
    eager, eager_stats, _ = _generate(backend, opts, enforce_eager=True)
    mapped = []
    graphs, stats, engine = _generate(
        backend, opts, enforce_eager=False,
        watch=lambda e: mapped.append((e.runner.num_graph_steps, e.kv_cache.usage().mapped_bytes)))
    assert eager_stats.num_cuda_graph_steps_total == 0
    assert stats.num_cuda_graph_steps_total > 0 and stats.cuda_graph_capture_s > 0
    assert engine.runner.cuda_graphs.sizes == (1, 2, 4, 8)
    assert engine.runner.cuda_graphs.num_captures == 4          # captured once, never again
    assert graphs == eager
    if name == "vmem-megacache":
        # the vAttention property: pages were mapped under the captured graphs while they replayed
        during = [m for steps, m in mapped if steps > 0]
        assert max(during) > during[0], mapped


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["paged", "vmem-megacache"])
def test_replays_touch_only_memory_the_graphs_hold(name):
    """Every tensor a captured graph writes stays allocated as long as the graph: the decode kernel's
    split-K workspace, made by the eager forwards before each capture, was held only by a metadata
    object dropped after the capture, so its memory went back to the caching allocator; replays then
    wrote into whatever lived there next (seen on the H200: another graph's input ids, then an illegal
    memory access).  Releasing every free cached segment after start-up (``empty_cache``) turns such a
    write into a fault; outputs must still equal eager."""
    backend, opts = BACKENDS[name]
    # a context of 1024 positions: the graphs of small batches split the context (a workspace exists)
    eager, _, _ = _generate(backend, opts, enforce_eager=True, max_model_len=1024)

    def release_free_memory(engine):
        graphs = engine.runner.cuda_graphs._graphs.values()
        assert all(g.meta is not None for g in graphs)          # the metadata lives with its graph
        assert any(g.meta.workspace for g in graphs), "no graph uses a workspace: the test tests nothing"
        torch.cuda.empty_cache()
    graphs, stats, _ = _generate(backend, opts, enforce_eager=False, after_start=release_free_memory,
                                 max_model_len=1024)
    torch.cuda.synchronize()
    assert stats.num_cuda_graph_steps_total > 0 and graphs == eager


@pytest.mark.gpu
def test_graph_replay_bf16_runs_and_frees():
    cfg = EngineConfig.from_args(None, "vmem", "cuda", "bfloat16", random_weights="smollm2-135m",
                                 max_num_seqs=4, max_model_len=128, cuda_graph_sizes=[2, 4])
    engine = LLMEngine(cfg)
    assert engine.runner.cuda_graphs.sizes == (2, 4)
    for i in range(5):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0.8, max_tokens=9, seed=i),
                           prompt_token_ids=list(range(3 + i, 40 + i)))
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {f"r{i}" for i in range(5)}
    assert engine.get_stats().num_cuda_graph_steps_total > 0
    assert engine.kv_cache.usage().used_tokens == 0
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["paged", "vmem-megacache"])
def test_async_scheduling_with_graphs_matches_eager(name):
    """Steps launched ahead replay the graphs with the previous step's tokens fed on the device."""
    backend, opts = BACKENDS[name]
    eager, _, _ = _generate(backend, opts, enforce_eager=True)
    got, stats, _ = _generate(backend, opts, enforce_eager=False, async_scheduling=True)
    assert stats.num_ahead_steps_total > 0 and stats.num_cuda_graph_steps_total > 0
    assert got == eager


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["paged", "vmem-megacache"])
def test_a_step_launch_never_waits_for_the_device(name):
    """A step's launch (prepare, replay or forward, sampling, the copy of the tokens) performs no
    synchronising CUDA operation (``torch.cuda.set_sync_debug_mode("error")`` raises on one), with
    greedy, temperature, top-k/top-p, seeded and unseeded rows in one batch: a blocking copy there
    would make the host wait for the step running ahead and undo async scheduling's overlap."""
    backend, opts = BACKENDS[name]
    cfg = EngineConfig.from_args(None, backend, "cuda", "float32", random_weights="smollm2-135m",
                                 max_num_seqs=8, max_model_len=256, max_num_batched_tokens=512,
                                 seed=5, async_scheduling=True, **opts)
    engine = LLMEngine(cfg)
    runner, launches = engine.runner, []
    plain_launch = runner.launch

    def launch(sched, input_ids=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launches.append(len(sched.scheduled))
            return plain_launch(sched, input_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = launch
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=27, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=21, ignore_eos=True)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", None, p, prompt_token_ids=list(range(5 + i, 40 + 3 * i)))
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    stats = engine.get_stats()
    engine.close()
    assert done == {f"r{i}" for i in range(4)}
    assert stats.num_ahead_steps_total > 0 and stats.num_cuda_graph_steps_total > 0 and len(launches) > 20
