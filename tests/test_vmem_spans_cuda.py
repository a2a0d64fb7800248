"""Spans on the CUDA driver (vmkv.vmem.page_pool, "Spans"): a run of pages created as one
cuMemCreate, mapped with one cuMemMap and one cuMemSetAccess, unmapped and released whole.

Every test touches only mapped pages (reading an unmapped part of a reservation is an illegal
address, a sticky error that would end the whole process).
"""

import pytest
import torch

from vmkv import KVCacheSpec, StepSeq
from vmkv.kernels.reference import attention_one_seq_ref

pytestmark = pytest.mark.gpu

cuda_bindings = pytest.importorskip("cuda.bindings")

from vmkv.vmem import CudaDriver, VMemKVCache, VMMError  # noqa: E402
from vmkv.vmem.checked_driver import CheckedDriver  # noqa: E402
from vmem_helpers import checked_drivers, write_all  # noqa: E402, F401 - checked_drivers: autouse fixture

MIB = 1024 * 1024
# 4 layers x 8 KV heads x 128 dims, bf16: 16 KiB per token -> 128 tokens per 2 MiB megacache page
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
UT = 128


@pytest.fixture
def driver():
    d = CheckedDriver(CudaDriver("cuda"))
    yield d
    torch.cuda.synchronize()
    d.close()


@pytest.fixture
def make():
    caches = []

    def _make(num_pages=64, max_num_seqs=4, max_model_len=32 * UT, span_pages=16, **kw):
        c = VMemKVCache(SPEC, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        memory_bytes=num_pages * 2 * MIB, max_span_bytes=span_pages * 2 * MIB,
                        kv_shrink_grace_s=0, kv_reserve_bytes=0, **kw)
        caches.append(c)
        return c

    yield _make
    torch.cuda.synchronize()
    for c in caches:
        c.close()


def test_cuda_span_maps_whole_and_only_whole(driver):
    page = driver.page_size_bytes
    va = driver.reserve(8 * page)
    span = driver.create_page(num_pages=4)
    assert driver.num_pages == 4
    with pytest.raises(VMMError, match="span"):
        driver.map(va, span)                         # part of a span: refused by the checked driver
    with pytest.raises(VMMError):
        driver.inner.map(va, span)                   # ... and by CUDA itself (a 2 MiB prefix of 8 MiB)
    driver.map(va + page, span, set_access=False, num_pages=4)
    driver.set_access(va + page, 4 * page)           # one call for the whole allocation
    whole = driver.as_tensor(va + page, 4 * page, torch.float32)
    ref = torch.randn(whole.numel(), device="cuda")
    whole.copy_(ref)
    assert torch.equal(whole, ref)
    with pytest.raises(VMMError, match="span"):
        driver.unmap(va + 2 * page)                  # not from its first page
    torch.cuda.synchronize()
    driver.unmap(va + page, num_pages=4)
    driver.release(span, num_pages=4)
    driver.free_reservation(va, 8 * page)
    assert (driver.num_pages, driver.num_mappings, driver.num_reservations) == (0, 0, 0)


def test_cuda_admission_maps_one_span_and_data_roundtrips(make):
    c = make()
    n = 12 * UT + 5                                  # 13 pages: one span of 13
    c.allocate(1, n)
    s = c.vmm_stats()
    assert (s["num_spans_created"], s["num_span_pages"], s["num_set_access_calls"]) == (1, 13, 1)
    data = write_all(c, SPEC, 1, 0, n, seed=1)
    for layer, (k, v) in data.items():
        gk, gv = c.gather(1, layer)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    c.check_integrity()


def test_cuda_span_hit_and_fork_copy_and_step_matches_reference(make):
    c = make()
    n = 6 * UT + 7
    prompt = list(range(n))
    c.allocate(1, n, token_ids=prompt)
    meta = c.prepare([StepSeq(1, 0, n)])
    data = {}
    g = torch.Generator(device="cuda").manual_seed(3)
    for layer in range(SPEC.num_layers):
        k = torch.randn(n, SPEC.num_kv_heads, SPEC.head_dim, device="cuda", generator=g).to(SPEC.dtype)
        v = torch.randn(n, SPEC.num_kv_heads, SPEC.head_dim, device="cuda", generator=g).to(SPEC.dtype)
        c.write_kv(layer, k, v, meta)
        data[layer] = (k, v)
    hit = c.allocate(2, n, token_ids=prompt)         # the hit pages are a span's: copied
    assert hit == 6 * UT and c.vmm_stats()["num_span_copies"] == 6
    c.fork(1, 3)                                     # the parent's span pages: copied too
    assert c.vmm_stats()["num_span_copies"] == 6 + 7
    torch.cuda.synchronize()
    for seq, upto in ((2, hit), (3, n)):
        for layer, (k, v) in data.items():
            gk, gv = c.gather(seq, layer)
            assert torch.equal(gk[:upto], k[:upto]) and torch.equal(gv[:upto], v[:upto])
    # decode one token in the fork and check attention against the reference over the copies
    c.extend(3, 1)
    meta = c.prepare([StepSeq(3, n, 1)])
    q = torch.randn(1, 4 * SPEC.num_kv_heads, SPEC.head_dim, device="cuda", dtype=SPEC.dtype)
    k1 = torch.randn(1, SPEC.num_kv_heads, SPEC.head_dim, device="cuda", dtype=SPEC.dtype)
    c.write_kv(0, k1, k1, meta)
    out = c.attention(0, q, meta)
    keys = torch.cat([data[0][0], k1])
    values = torch.cat([data[0][1], k1])
    ref = attention_one_seq_ref(q.double(), keys.double(), values.double(), n, SPEC.head_dim ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    c.check_integrity()


def test_cuda_spans_release_to_the_device(make):
    c = make(num_pages=256)
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    for i in range(3):
        c.allocate(i, 40 * UT if c.max_model_len >= 40 * UT else c.max_model_len)
    torch.cuda.synchronize()
    held, _ = torch.cuda.mem_get_info()
    assert free0 - held >= 3 * 32 * 2 * MIB          # at least the three prompts' pages
    for i in range(3):
        c.free(i)
    torch.cuda.synchronize()
    c.release_idle(now=1e9)                          # grace 0, no reserve: everything idle goes
    s = c.vmm_stats()
    assert s["num_span_pages"] == 0 and c.pool.num_created == 0
    torch.cuda.synchronize()
    after, _ = torch.cuda.mem_get_info()
    assert after >= free0 - 64 * MIB                 # back to where it was, within allocator noise
    c.check_integrity()
