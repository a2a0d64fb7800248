import pytest
import torch

from vmkv import KVCacheFullError, KVCacheSpec, create_kv_cache


def test_bytes_per_token_llama3_8b():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert spec.bytes_per_token == 128 * 1024
    assert spec.bytes_per_token_per_layer == 4096
    assert spec.kv_bytes(10) == 10 * 128 * 1024
    assert spec.max_tokens_for_bytes(1 << 30) == 8192


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 1.5)])
def test_spec_rejects_bad_fields(field, value):
    kwargs = dict(num_layers=2, num_kv_heads=2, head_dim=8)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        KVCacheSpec(**kwargs)


def test_spec_rejects_int_dtype():
    with pytest.raises(ValueError, match="dtype"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.int32)


def test_unknown_backend():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="unknown KV backend"):
        create_kv_cache("nope", spec, max_num_seqs=1, max_model_len=8, memory_bytes=1 << 20)


def test_full_error_message():
    err = KVCacheFullError(100, 7)
    assert err.needed_tokens == 100 and err.available_tokens == 7
    assert "needed 100" in str(err) and "7 available" in str(err)
