"""No Triton compilation in the middle of a run: once a workload's kinds of step have run (prefill,
chunked prefill, mixed prefill + decode, graph-replayed decode), a second workload of other sizes and
another arrival pattern compiles no new variant of any kernel.

The failure this guards against (seen on the H200 as 2-second steps): Triton specializes a kernel on
the 16-byte alignment of each pointer argument and on integer arguments equal to 1 or divisible by 16,
so a step metadata field whose alignment followed the step's sizes, or a tensor sliced at a
step-dependent offset, compiled new variants while requests were being served.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import make_tiny_llama, random_prompts
from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("needs CUDA (torch.cuda.is_available() is False)", allow_module_level=True)

from vmkv.kernels import decode_attention, fused_ops, prefill_attention, write_kv  # noqa: E402

KERNELS = {
    "prefill": prefill_attention._prefill_kernel,
    "decode_split": decode_attention._decode_split_kernel,
    "decode_reduce": decode_attention._decode_reduce_kernel,
    "write_kv": write_kv._write_kv_kernel,
    "rms_norm": fused_ops._rms_norm_kernel,
    "rotary": fused_ops._rotary_kernel,
    "silu_and_mul": fused_ops._silu_and_mul_kernel,
}


def _variants() -> dict[str, int]:
    """Compiled variants of each kernel (Triton's per-device kernel caches)."""
    counts = {}
    for name, fn in KERNELS.items():
        caches = getattr(fn, "device_caches", None)
        assert caches is not None, f"{name}: this Triton keeps no device_caches; update the test"
        counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


def _wave(engine: LLMEngine, seed: int, num: int, lens: tuple[int, int], tag: str) -> None:
    """Requests arriving a few per step (so steps mix prompt chunks with decodes), run to the end."""
    rng = random.Random(seed)
    prompts = random_prompts(engine.model_config.vocab_size, [rng.randint(*lens) for _ in range(num)],
                             seed=seed)
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(min(len(pending), rng.randint(0, 3))):
            i, p = pending.pop(0)
            engine.add_request(f"{tag}{i}", None, SamplingParams(temperature=1.0, seed=i,
                                                                 max_tokens=rng.randint(2, 30),
                                                                 ignore_eos=True),
                               prompt_token_ids=p)
        engine.step()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-variants")
    make_tiny_llama(path)
    return str(path)


@pytest.mark.parametrize("backend, opts", [("paged", {}), ("vmem", {"driver": "cuda"})], ids=["paged", "vmem"])
def test_a_second_workload_compiles_no_new_kernel_variant(tiny, backend, opts):
    cfg = EngineConfig.from_args(tiny, backend, "cuda", "bf16", max_model_len=512, max_num_batched_tokens=96,
                                 max_num_seqs=16, memory_bytes=256 << 20, **opts)
    engine = LLMEngine(cfg)
    _wave(engine, 1, 40, (1, 300), "a")          # every kind of step, many sizes
    _wave(engine, 2, 20, (1, 300), "b")
    before = _variants()
    assert before["prefill"] >= 1 and before["decode_split"] >= 1
    _wave(engine, 3, 40, (1, 400), "c")          # other sizes, another arrival pattern
    after = _variants()
    engine.close()
    assert after == before, f"kernels compiled mid-run: before {before}, after {after}"
