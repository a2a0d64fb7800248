"""CUDA VMM driver and the vmem cache on a GPU (cuMemCreate/cuMemMap pages, 2 MiB granularity).

Every test touches only mapped pages: reading an unmapped part of a reservation is an illegal
address, a sticky error that would end the whole process.
"""

import pytest
import torch

from vmkv import KVCacheSpec, StepSeq
from vmkv.kernels.reference import attention_one_seq_ref

pytestmark = pytest.mark.gpu

cuda_bindings = pytest.importorskip("cuda.bindings")

from vmkv.vmem import CudaDriver, VMemKVCache, VMMError  # noqa: E402
from checked_driver import CheckedDriver  # noqa: E402
from vmem_helpers import checked_drivers, random_kv, write_all  # noqa: E402, F401 - checked_drivers: autouse fixture

MIB = 1024 * 1024
MAX_LEN = 4096
# 4 layers x 8 KV heads x 128 dims, bf16: 16 KiB per token -> 128 tokens per 2 MiB megacache page;
# 2 KiB per token per reservation -> 1024 tokens per page in per_layer (8 pages per unit)
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
UT = {"megacache": 128, "per_layer": 1024}
PPU = {"megacache": 1, "per_layer": 8}


@pytest.fixture
def driver():
    d = CheckedDriver(CudaDriver("cuda"))
    yield d
    torch.cuda.synchronize()
    d.close()


@pytest.fixture
def make(layout):
    caches = []

    def _make(num_units=16, max_num_seqs=4, max_model_len=MAX_LEN, **kw):
        c = VMemKVCache(SPEC, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        memory_bytes=num_units * PPU[layout] * 2 * MIB, layout=layout, **kw)
        caches.append(c)
        return c

    yield _make
    torch.cuda.synchronize()
    for c in caches:
        c.close()


def _kv(n, seed):
    return random_kv(SPEC, n, seed)


def _write_all(c, seq, start, n, seed):
    return write_all(c, SPEC, seq, start, n, seed)


def test_cuda_driver_pages_share_unmap_remap(driver):
    page = driver.page_size_bytes
    assert page == driver.granularity_bytes == 2 * MIB
    va = driver.reserve(4 * page)
    assert va % page == 0
    h = driver.create_page()
    driver.map(va, h)
    driver.map(va + 2 * page, h)                      # one physical page, two addresses
    whole = driver.as_tensor(va, 4 * page)
    assert whole.device.type == "cuda" and whole.data_ptr() == va and whole.numel() == 4 * page
    x = driver.as_tensor(va, page, torch.float16)
    y = driver.as_tensor(va + 2 * page, page, torch.float16)
    assert y.data_ptr() == va + 2 * page and x.numel() == page // 2
    ref = torch.randn(page // 2, device="cuda", dtype=torch.float16)
    x.copy_(ref)
    assert torch.equal(y, ref)
    driver.unmap(va + 2 * page)                       # range stays reserved
    h2 = driver.create_page()
    driver.map(va + 2 * page, h2)
    y.fill_(1.0)
    assert torch.equal(x, ref)                        # a different page now
    driver.copy_page(va + 2 * page, va)
    assert torch.equal(y, ref)
    assert (driver.num_pages, driver.num_mappings, driver.num_reservations) == (2, 2, 1)
    torch.cuda.synchronize()
    driver.unmap(va)
    driver.unmap(va + 2 * page)
    driver.release(h)
    driver.release(h2)
    driver.free_reservation(va, 4 * page)
    assert (driver.num_pages, driver.num_mappings, driver.num_reservations) == (0, 0, 0)


def test_cuda_driver_errors_name_the_call(driver):
    with pytest.raises(VMMError) as e:
        driver.reserve(1 << 62)                       # more virtual address space than exists
    assert e.value.call == "cuMemAddressReserve" and e.value.code.startswith("CUDA_ERROR_")
    assert str(e.value).startswith("cuMemAddressReserve failed: CUDA_ERROR_")
    va = driver.reserve(driver.page_size_bytes)
    h = driver.create_page()
    with pytest.raises(VMMError, match="^cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        driver.map(va + driver.page_size_bytes, h)    # outside the reservation
    driver.map(va, h)
    with pytest.raises(VMMError, match="^cuMemRelease failed: .*still mapped"):
        driver.release(h)
    driver.unmap(va)
    driver.release(h)
    driver.free_reservation(va, driver.page_size_bytes)
    with pytest.raises(ValueError, match="granularity"):
        CudaDriver("cuda", page_size_bytes=3 * MIB)


def test_cuda_cache_roundtrip_fork_copy_on_write(make, layout):
    c = make()
    assert isinstance(c.driver.inner, CudaDriver) and c.unit_tokens == UT[layout]
    ut, ppu = UT[layout], PPU[layout]
    n = ut + ut // 2
    c.allocate(1, n)
    orig = _write_all(c, 1, 0, n, seed=1)
    for layer, (k, v) in orig.items():
        gk, gv = c.gather(1, layer)
        assert gk.device.type == "cuda" and torch.equal(gk, k) and torch.equal(gv, v)
    c.fork(1, 2)
    assert c.usage().allocated_bytes == 2 * ppu * 2 * MIB
    c.extend(1, 1)
    c.extend(2, 1)
    assert c.usage().num_cow_copies == ppu
    new1 = _write_all(c, 1, n, 1, seed=2)
    new2 = _write_all(c, 2, n, 1, seed=3)
    for layer in range(SPEC.num_layers):
        for seq, new in ((1, new1), (2, new2)):
            gk, gv = c.gather(seq, layer)
            assert torch.equal(gk[:n], orig[layer][0]) and torch.equal(gv[:n], orig[layer][1])
            assert torch.equal(gk[n], new[layer][0][0]) and torch.equal(gv[n], new[layer][1][0])
    c.check_integrity()


@pytest.mark.parametrize("impl", ["auto", "torch", "sdpa"])
def test_cuda_step_path_matches_reference(make, layout, impl):
    if impl == "sdpa":
        pytest.importorskip("vmkv.kernels.sdpa")
    spec = SPEC
    c = make(attention_impl=impl)
    scale = spec.head_dim ** -0.5
    num_heads = 2 * spec.num_kv_heads
    oracle = {}
    c.allocate("a", 300)
    c.allocate("b", 130)
    steps = [[StepSeq("a", 0, 200), StepSeq("b", 0, 130)],     # chunked prefill of a
             [StepSeq("a", 200, 100), StepSeq("b", 130, 1)],   # rest of a + decode of b
             [StepSeq("a", 300, 1), StepSeq("b", 131, 1)]]     # decode both
    for step, batch in enumerate(steps):
        for e in batch:
            grow = e.num_computed_tokens + e.num_new_tokens - c.seq_len(e.seq_id)
            if grow > 0:
                c.extend(e.seq_id, grow)
        meta = c.prepare(batch)
        assert meta.slot_mapping.device.type == "cuda"
        for layer in range(spec.num_layers):
            k, v = _kv(meta.num_tokens, seed=10 * step + layer)
            q = torch.randn(meta.num_tokens, num_heads, spec.head_dim, device="cuda").to(spec.dtype)
            c.write_kv(layer, k, v, meta)
            out = c.attention(layer, q, meta)
            start = 0
            for e in batch:
                n = e.num_new_tokens
                ok, ov = oracle.get((e.seq_id, layer), (k[:0], v[:0]))
                ok, ov = torch.cat([ok, k[start:start + n]]), torch.cat([ov, v[start:start + n]])
                oracle[(e.seq_id, layer)] = (ok, ov)
                ref = attention_one_seq_ref(q[start:start + n], ok, ov, e.num_computed_tokens, scale)
                torch.testing.assert_close(out[start:start + n], ref, atol=2e-2, rtol=2e-2)
                start += n
    for (seq, layer), (ok, ov) in oracle.items():
        gk, gv = c.gather(seq, layer)
        assert torch.equal(gk, ok) and torch.equal(gv, ov)
    c.check_integrity()


def test_cuda_deferred_reclamation_waits_for_the_free_fence(make, layout):
    """A freed slot's pages are unmapped for another request only after the kernels queued before
    free() (here: a long GPU sleep, then a read of the slot) have completed."""
    # megacache and per_layer alike; the second request needs 5 units (5120 tokens in per_layer)
    c = make(num_units=6, max_model_len=8 * UT[layout])
    ut = c.unit_tokens
    n = 3 * ut + ut // 2                           # 3 cached units + 1 uncached unit
    prompt = list(range(n))
    c.allocate(1, n, prompt)
    meta = c.prepare([StepSeq(1, 0, n)])
    for layer in range(SPEC.num_layers):
        k, v = _kv(n, seed=20 + layer)
        c.write_kv(layer, k, v, meta)
    expected = c.gather(1, 0)[0]
    slot = c.slot_of(1)
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(200_000_000)                         # about 0.1 s of GPU time, queued
    snap = c.key_view(0)[slot, :n].clone()        # reads the slot after the sleep
    c.free(1)                                      # fence recorded after that read
    c.allocate(2, 5 * ut)                          # avoids the cached slot; reclaims 3 of its units
    stats = c.vmm_stats()
    assert c.slot_of(2) != slot
    assert stats["num_reclaimed_pages"] == 3 * c.layout.pages_per_unit
    if sleep is not None:
        assert stats["num_fence_waits"] >= 1
    torch.cuda.synchronize()
    assert torch.equal(snap, expected)            # the read saw the data: nothing unmapped early
    _write_all(c, 2, 0, 5 * ut, seed=30)
    c.check_integrity()


def test_cuda_reuse_of_a_freed_slot_maps_nothing(make):
    c = make()
    ut = c.unit_tokens
    c.allocate(1, 3 * ut)
    _write_all(c, 1, 0, 3 * ut, seed=40)
    c.free(1)
    before = c.vmm_stats()
    c.allocate(2, 2 * ut + 1)
    after = c.vmm_stats()
    assert (after["num_maps"], after["num_unmaps"]) == (before["num_maps"], before["num_unmaps"])
    assert after["map_us_p50"] > 0 and after["num_pages_created"] == 3 * c.layout.pages_per_unit
    c.check_integrity()


def test_cuda_close_releases_everything(driver):
    c = VMemKVCache(SPEC, max_num_seqs=3, max_model_len=MAX_LEN, memory_bytes=64 * MIB, driver=driver,
                    layout="per_layer")
    c.allocate(1, 1500)
    _write_all(c, 1, 0, 1500, seed=50)
    c.fork(1, 2)
    c.extend(2, 10)
    c.free(1)
    assert driver.num_mappings > 0 and driver.num_reservations == 2 * SPEC.num_layers
    c.close()
    assert (driver.num_mappings, driver.num_pages, driver.num_reservations) == (0, 0, 0)
    torch.cuda.synchronize()                       # no sticky error was left behind


def test_cuda_set_access_once_over_a_multi_page_range(driver):
    """Pages mapped without access, then one cuMemSetAccess over the run: a kernel spanning all of
    them reads and writes correctly.  Nothing touches the pages before access is set."""
    page = driver.page_size_bytes
    va = driver.reserve(8 * page)
    handles = [driver.create_page() for _ in range(6)]
    for i, h in enumerate(handles):
        driver.map(va + i * page, h, set_access=False)
    assert driver.num_pending_access == 6 and not driver.has_access(va)
    with pytest.raises(VMMError, match=r"^cuMemSetAccess failed: CUDA_ERROR_INVALID_VALUE .*not mapped"):
        driver.set_access(va, 7 * page)              # the 7th page is not mapped: refused up front
    with pytest.raises(VMMError, match="^copy_page failed: .*without access"):
        driver.copy_page(va + page, va)
    driver.set_access(va, 6 * page)                  # one call for the whole run
    assert driver.num_pending_access == 0 and all(driver.has_access(va + i * page) for i in range(6))
    whole = driver.as_tensor(va, 6 * page, torch.float32)
    ref = torch.randn(whole.numel(), device="cuda")
    whole.copy_(ref)                                 # one kernel across all six pages
    assert torch.equal(whole, ref)
    driver.copy_page(va + 5 * page, va)
    assert torch.equal(driver.as_tensor(va + 5 * page, page, torch.float32),
                       driver.as_tensor(va, page, torch.float32))
    torch.cuda.synchronize()
    for i, h in enumerate(handles):
        driver.unmap(va + i * page)
        driver.release(h)
    driver.free_reservation(va, 8 * page)
    assert (driver.num_pages, driver.num_mappings, driver.num_reservations) == (0, 0, 0)


def test_cuda_batched_maps_and_prefetch(make, layout):
    """allocate maps its units in one batch (one cuMemSetAccess per reservation); prefetch, called
    while GPU work is queued, maps the next unit so extend makes no driver call; data round-trips."""
    c = make(num_units=8, max_model_len=8 * UT[layout])   # room past 4 units in per_layer too
    ut, ppu, nres = c.unit_tokens, c.layout.pages_per_unit, c.layout.num_reservations
    c.allocate(1, 4 * ut)
    s = c.vmm_stats()
    assert (s["num_maps"], s["num_map_batches"], s["num_set_access_calls"]) == (4 * ppu, 1, nres)
    data = _write_all(c, 1, 0, 4 * ut, seed=60)
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(50_000_000)                            # queued GPU work the prefetch overlaps
    c.prefetch([1], ut)
    s = c.vmm_stats()
    assert s["num_prefetched_pages"] == ppu and s["num_maps"] == 5 * ppu
    assert s["num_set_access_calls"] == 2 * nres
    u = c.usage()
    assert u.allocated_bytes == 4 * ppu * 2 * MIB and u.mapped_bytes == 5 * ppu * 2 * MIB
    c.extend(1, ut)
    assert c.vmm_stats()["num_maps"] == 5 * ppu      # the prefetched unit: no map on extend
    more = _write_all(c, 1, 4 * ut, ut, seed=61)
    for layer in range(SPEC.num_layers):
        gk, gv = c.gather(1, layer)
        assert torch.equal(gk[:4 * ut], data[layer][0]) and torch.equal(gv[4 * ut:], more[layer][1])
    c.allocate(2, 3 * ut)                            # the pool is now full
    c.prefetch([1, 2], 4 * ut)                       # nothing left: no error, nothing mapped
    assert c.vmm_stats()["num_maps"] == 8 * ppu and c.usage().free_tokens == 0
    c.check_integrity()
