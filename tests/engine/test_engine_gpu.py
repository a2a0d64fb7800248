"""The engine on CUDA: both backends (paged blocks; vmem on the CUDA VMM driver, 2 MiB pages) with the
Triton kernels behind ``write_kv``/``attention``, against transformers' greedy ``generate``."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import hf_greedy, make_tiny_llama, random_prompts
from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

BACKENDS = {
    "paged": ("paged", {}),
    "vmem-megacache": ("vmem", {"driver": "cuda", "layout": "megacache"}),
    "vmem-per_layer": ("vmem", {"driver": "cuda", "layout": "per_layer"}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-gpu")
    hf_model, _ = make_tiny_llama(path)
    return {"path": str(path), "hf": hf_model}


def _run(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


@pytest.mark.parametrize("name", list(BACKENDS))
def test_greedy_on_cuda_matches_transformers(tiny, name):
    backend, opts = BACKENDS[name]
    # small budget and token budget: chunked prefill and preemption both happen on the GPU path too
    cfg = EngineConfig.from_args(tiny["path"], backend, "cuda", "float32", max_model_len=160,
                                 max_num_batched_tokens=48, max_num_seqs=8, **opts,
                                 memory_bytes=(8 << 20) if backend == "vmem" else 160 * 512)
    engine = LLMEngine(cfg)
    prompts = random_prompts(engine.model_config.vocab_size, [5, 37, 64, 90, 17, 120], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=p)
    final = _run(engine)
    for i, p in enumerate(prompts):
        assert final[f"r{i}"].outputs[0].token_ids == hf_greedy(tiny["hf"], p, 24), f"request r{i}"
    assert engine.kv_cache.usage().used_tokens == 0
    engine.close()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_bf16_engine_runs_on_cuda(tiny, name):
    backend, opts = BACKENDS[name]
    cfg = EngineConfig.from_args(tiny["path"], backend, "cuda", "bf16", max_model_len=512,
                                 memory_bytes=64 << 20, **opts)
    engine = LLMEngine(cfg)
    prompts = random_prompts(engine.model_config.vocab_size, [100, 300, 7], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", None, params, prompt_token_ids=p)
    final = _run(engine)
    assert all(len(c.token_ids) == 40 for o in final.values() for c in o.outputs)
    assert engine.kv_cache.usage().used_tokens == 0
    engine.close()
