"""``resolve_config`` and ``ResolvedConfig.fit_to_capacity``: the engine's limits decided once, by pure
functions (no model, no KV cache, no tensors).  Spec: 2 layers x 2 (K,V) x 2 heads x 16 x 4 bytes = 512
bytes per token; the model's context is 1024 tokens unless a test says otherwise."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from vmkv.engine.config import DEFAULT_CPU_KV_MEMORY_BYTES, EngineConfig
from vmkv.engine.resolved_config import ResolvedConfig, resolve_config
from vmkv.kvcache import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
BPT = 512
MODEL = types.SimpleNamespace(max_position_embeddings=1024)


def resolve(model=MODEL, *, device_type: str = "cpu", free_memory_bytes: int | None = None, **knobs):
    return resolve_config(EngineConfig.from_args(None, "paged", **knobs), model, SPEC,
                          device_type=device_type, free_memory_bytes=free_memory_bytes)


def test_spec_bytes_per_token_is_what_the_tests_assume():
    assert SPEC.bytes_per_token == BPT


def test_default_max_model_len_is_the_model_context_capped_at_4096():
    r = resolve(memory_bytes=1 << 30)
    assert (r.max_model_len, r.max_model_len_is_default) == (1024, True)
    r = resolve(types.SimpleNamespace(max_position_embeddings=32768), memory_bytes=1 << 30)
    assert r.max_model_len == 4096


def test_explicit_max_model_len_is_kept():
    r = resolve(max_model_len=300, memory_bytes=1 << 30)
    assert (r.max_model_len, r.max_model_len_is_default) == (300, False)


def test_default_max_model_len_is_lowered_to_the_kv_budget():
    r = resolve(memory_bytes=300 * BPT + 100)
    assert r.max_model_len == 300 and r.kv_capacity_tokens == 300
    assert r.kv_memory_bytes == 300 * BPT + 100


def test_the_lowering_is_logged_naming_the_flag_that_chooses_the_length(caplog):
    """``vmkv serve --kv-memory 8MiB`` logged "(give memory_bytes or max_model_len to choose)" although the
    user had given the memory, and named no flag (issue 25, item 6)."""
    with caplog.at_level("WARNING", logger="vmkv.engine.resolved_config"):
        resolve(memory_bytes=300 * BPT + 100)
        resolve(memory_bytes=1 << 30).fit_to_capacity(200)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("lowering max_model_len" in m and "--max-model-len" in m for m in lines), lines
    assert "give memory_bytes or max_model_len" not in " ".join(lines)


@pytest.mark.parametrize("value, words", [(1025, "exceeds the model's context of 1024 tokens"),
                                          (1, "leaves no room for an output token")])
def test_max_model_len_outside_the_model_context_raises_naming_field_value_and_range(value, words):
    with pytest.raises(ValueError) as e:
        resolve(max_model_len=value, memory_bytes=1 << 30)
    assert f"max_model_len={value}" in str(e.value) and words in str(e.value) and "[2, 1024]" in str(e.value)


def test_explicit_max_model_len_above_the_budget_raises_saying_what_fits():
    with pytest.raises(ValueError) as e:
        resolve(max_model_len=256, memory_bytes=64 * BPT)
    msg = str(e.value)
    assert "max_model_len=256" in msg and "64 tokens" in msg and "at most 64" in msg and "memory_bytes" in msg


def test_a_budget_below_two_tokens_raises():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        resolve(memory_bytes=BPT + 1)


def test_chunked_prefill_off_lowers_the_default_to_the_step_budget():
    r = resolve(memory_bytes=1 << 30, enable_chunked_prefill=False, max_num_batched_tokens=512)
    assert r.max_model_len == 512 and not r.enable_chunked_prefill
    # an explicit value above the step budget is refused (by SchedulerConfig, and by ResolvedConfig)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        resolve(memory_bytes=1 << 30, enable_chunked_prefill=False, max_num_batched_tokens=512,
                max_model_len=1024)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) must be >= max_model_len \(1024\)"):
        ResolvedConfig(max_model_len=1024, kv_memory_bytes=1 << 30, kv_bytes_per_token=BPT, max_num_seqs=4,
                       max_num_batched_tokens=512, enable_chunked_prefill=False)


def test_kv_budget_from_free_device_memory_is_capped_at_what_max_num_seqs_sequences_use():
    most_useful = 8 * 1024 * BPT
    r = resolve(device_type="cuda", free_memory_bytes=10 << 30, max_num_seqs=8)
    assert r.kv_memory_bytes == most_useful
    r = resolve(device_type="cuda", free_memory_bytes=1 << 20, max_num_seqs=8, gpu_memory_utilization=0.5)
    assert r.kv_memory_bytes == 1 << 19 and r.max_model_len == 1024
    r = resolve(free_memory_bytes=None, max_num_seqs=8)           # CPU: a fixed budget
    assert r.kv_memory_bytes == min(DEFAULT_CPU_KV_MEMORY_BYTES, most_useful)


def test_prefetch_tokens_default_depends_on_the_device():
    assert resolve(device_type="cuda", free_memory_bytes=1 << 30).prefetch_tokens == 16
    assert resolve(memory_bytes=1 << 20).prefetch_tokens == 0
    assert resolve(memory_bytes=1 << 20, prefetch_tokens=5).prefetch_tokens == 5


def test_resolution_is_pure_and_frozen():
    config = EngineConfig.from_args(None, "paged", memory_bytes=300 * BPT)
    before = dataclasses.asdict(config)
    a = resolve_config(config, MODEL, SPEC)
    b = resolve_config(config, MODEL, SPEC)
    assert a == b and dataclasses.asdict(config) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_model_len = 10  # type: ignore[misc]


def test_fit_to_capacity_lowers_only_a_default_and_returns_a_new_object():
    r = resolve(memory_bytes=300 * BPT)                            # default lowered to 300 by bytes
    assert r.fit_to_capacity(300) is r and r.fit_to_capacity(1000) is r
    fitted = r.fit_to_capacity(288)                                # e.g. 18 blocks of 16 tokens
    assert fitted.max_model_len == 288 and r.max_model_len == 300
    assert dataclasses.replace(fitted, max_model_len=300) == r
    explicit = resolve(max_model_len=300, memory_bytes=300 * BPT)
    with pytest.raises(ValueError) as e:
        explicit.fit_to_capacity(288, capacity_bytes=300 * BPT)
    assert "max_model_len=300" in str(e.value) and "288 tokens" in str(e.value) and "at most 288" in str(e.value)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        r.fit_to_capacity(1)


@pytest.mark.parametrize("field, value", [("max_model_len", 1), ("kv_memory_bytes", 0), ("max_num_seqs", True),
                                          ("prefetch_tokens", -1), ("kv_bytes_per_token", 1.5)])
def test_resolved_config_validates_its_fields(field, value):
    ok = dict(max_model_len=16, kv_memory_bytes=1 << 20, kv_bytes_per_token=BPT, max_num_seqs=4,
              max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=rf"ResolvedConfig\.{field} must be an int >= \d+, got {value!r}"):
        ResolvedConfig(**{**ok, field: value})
