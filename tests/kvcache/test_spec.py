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


def test_spec_accepts_dtype_names_and_rejects_bad_devices():
    assert KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="int8")
    for device in ("tpu", "nonsense:0"):
        with pytest.raises(ValueError, match="device"):
            KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, device=device)


@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_factory_rejects_bad_arguments(backend):
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8)
    base = dict(max_num_seqs=2, max_model_len=64, memory_bytes=1 << 20)
    if backend == "vmem":
        base["driver"] = "host"
    with pytest.raises(ValueError, match="unknown option"):
        create_kv_cache(backend, spec, **base, no_such_option=1)
    with pytest.raises(ValueError, match="memory_bytes"):
        create_kv_cache(backend, spec, **{**base, "memory_bytes": 1e6})
    with pytest.raises(ValueError, match="max_num_seqs"):
        create_kv_cache(backend, spec, **{**base, "max_num_seqs": 0})


@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_write_rejects_non_float_and_non_tensor(backend):
    import numpy as np

    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8)
    opts = {"driver": "host"} if backend == "vmem" else {}
    with create_kv_cache(backend, spec, max_num_seqs=2, max_model_len=64, memory_bytes=1 << 20,
                         **opts) as cache:
        cache.allocate(0, 4)
        good = torch.randn(4, 2, 8)
        with pytest.raises(ValueError, match="floating-point"):
            cache.write(0, 0, 0, good.to(torch.int32), good)
        with pytest.raises(TypeError, match="torch.Tensor"):
            cache.write(0, 0, 0, np.ones((4, 2, 8), dtype=np.float32), good)
        cache.write(0, 0, 0, good, good)
        torch.testing.assert_close(cache.gather(0, 0)[0], good)
