"""VMemKVCache on the host driver (real mmap/memfd mappings), both layouts, exact page counts.

Shapes: 2 layers, 2 KV heads, head_dim 32, fp32, 4 KiB pages, max_model_len 128.
megacache: 1 KiB per token -> 4 tokens per page, 1 page per unit, 32 units per slot.
per_layer: 256 B per token per reservation -> 16 tokens per page, 4 pages per unit, 8 units per slot.
"""

import logging
import random

import pytest
import torch

from vmkv import KVCacheFullError, KVCacheSpec, StepSeq, create_kv_cache
from vmkv.kernels.reference import attention_one_seq_ref
from vmkv.kvcache.base import DuplicateSequenceError, KVCacheError, UnknownSequenceError
from vmkv.vmem import HostDriver, SlotsExhaustedError, VMemKVCache
from checked_driver import CheckedDriver
from vmkv.vmem.driver import VMMError
from vmem_helpers import checked_drivers, random_kv, random_op, write_all  # noqa: F401 - checked_drivers is an autouse fixture

PAGE = 4096
MAX_LEN = 128
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
UT = {"megacache": 4, "per_layer": 16}
PPU = {"megacache": 1, "per_layer": 4}
LAYOUTS = ["megacache", "per_layer"]


@pytest.fixture
def make(layout):
    caches = []

    def _make(num_units=16, max_num_seqs=4, **kw):
        kw.setdefault("page_size_bytes", PAGE)
        c = VMemKVCache(SPEC, max_num_seqs=max_num_seqs, max_model_len=MAX_LEN,
                        memory_bytes=num_units * PPU[layout] * PAGE, driver="host", layout=layout, **kw)
        caches.append(c)
        return c

    yield _make
    for c in caches:
        c.close()


def _kv(n, seed):
    return random_kv(SPEC, n, seed)


def _write_all(c, seq, start, n, seed):
    """Write random K/V at [start, start + n) of every layer; returns {layer: (k, v)}."""
    return write_all(c, SPEC, seq, start, n, seed)


def _maps(c):
    s = c.vmm_stats()
    return s["num_maps"], s["num_unmaps"]


def test_geometry(make, layout):
    c = make()
    assert c.unit_tokens == UT[layout] and c.layout.pages_per_unit == PPU[layout]
    assert c.page_size_bytes == PAGE and c.backend == "vmem"


def test_roundtrip(make, layout):
    c = make()
    ut = UT[layout]
    n = 2 * ut + 3
    assert c.allocate(1, n) == 0
    first = _write_all(c, 1, 0, n, seed=1)
    for layer, (k, v) in first.items():
        gk, gv = c.gather(1, layer)
        assert gk.is_contiguous() and torch.equal(gk, k) and torch.equal(gv, v)
    c.extend(1, ut)
    assert c.seq_len(1) == n + ut
    second = _write_all(c, 1, n, ut, seed=2)
    for layer in range(SPEC.num_layers):
        gk, gv = c.gather(1, layer)
        assert torch.equal(gk, torch.cat([first[layer][0], second[layer][0]]))
        assert torch.equal(gv, torch.cat([first[layer][1], second[layer][1]]))
    assert c.usage().allocated_bytes == 4 * PPU[layout] * PAGE   # ceil((3 ut + 3) / ut) units
    c.check_integrity()


def test_fork_shares_pages_and_copy_on_write_isolates(make, layout):
    c = make()
    ut, ppu = UT[layout], PPU[layout]
    n = ut + ut // 2                          # the second unit is half full
    c.allocate(1, n)
    orig = _write_all(c, 1, 0, n, seed=3)
    maps_before = _maps(c)[0]
    c.fork(1, 2)
    assert _maps(c)[0] == maps_before + 2 * ppu          # child maps the parent's 2 units
    u = c.usage()
    assert u.allocated_bytes == 2 * ppu * PAGE and u.used_tokens == 2 * n   # shared pages count once
    for layer in range(SPEC.num_layers):
        assert torch.equal(c.gather(2, layer)[0], orig[layer][0])
    c.extend(1, 1)                            # parent will write into the shared half-full unit
    assert c.usage().num_cow_copies == ppu
    c.extend(2, 1)                            # the child's copy is private now: no second copy
    assert c.usage().num_cow_copies == ppu
    new1 = _write_all(c, 1, n, 1, seed=4)
    new2 = _write_all(c, 2, n, 1, seed=5)
    for layer in range(SPEC.num_layers):
        for seq, new in ((1, new1), (2, new2)):
            gk, gv = c.gather(seq, layer)
            assert torch.equal(gk[:n], orig[layer][0]) and torch.equal(gv[:n], orig[layer][1])
            assert torch.equal(gk[n], new[layer][0][0]) and torch.equal(gv[n], new[layer][1][0])
    # a write into the fully shared first unit copies only the pages of that layer
    copies = c.usage().num_cow_copies
    k, v = _kv(1, seed=6)
    c.write(2, 0, 0, k, v)
    assert c.usage().num_cow_copies == copies + len(c.layout.reservations_for_layer(0))
    assert torch.equal(c.gather(1, 0)[0][0], orig[0][0][0])
    assert torch.equal(c.gather(2, 0)[0][0], k[0])
    assert torch.equal(c.gather(2, 1)[0][:n], orig[1][0])
    c.check_integrity()


def test_deferred_reclamation_reuses_best_fitting_slot(make, layout):
    c = make()
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(10, ut)
    c.allocate(11, 5 * ut)
    s10, s11 = c.slot_of(10), c.slot_of(11)
    c.free(10)
    c.free(11)
    maps = _maps(c)
    assert maps == (6 * ppu, 0)
    u = c.usage()
    assert u.allocated_bytes == 0 and u.mapped_bytes == 6 * ppu * PAGE
    c.allocate(12, 4 * ut)                    # closest kept mapping >= 4 units: the 5-unit slot
    assert c.slot_of(12) == s11 and _maps(c) == maps
    c.allocate(13, ut)
    assert c.slot_of(13) == s10 and _maps(c) == maps
    u = c.usage()
    assert u.allocated_bytes == 5 * ppu * PAGE and u.mapped_bytes == 6 * ppu * PAGE
    c.extend(12, ut)                          # grows into its own kept unit: still no map call
    assert _maps(c) == maps
    c.check_integrity()


def test_reclaims_kept_pages_only_when_pool_runs_short(make, layout):
    c = make(num_units=8)
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(1, 6 * ut)
    c.free(1)
    c.allocate(2, 4 * ut)                     # reuses the kept slot; 2 kept units beyond seq_len
    u = c.usage()
    assert u.mapped_bytes == 6 * ppu * PAGE and u.allocated_bytes == 4 * ppu * PAGE
    assert u.free_tokens == 4 * ut            # 2 pool units + 2 reclaimable kept units
    assert c.can_allocate(4 * ut) and not c.can_allocate(4 * ut + 1)
    assert _maps(c)[1] == 0
    c.allocate(3, 4 * ut)
    stats = c.vmm_stats()
    assert stats["num_reclaimed_pages"] == 2 * ppu and stats["num_unmaps"] == 2 * ppu
    assert stats["num_pages_created"] == 8 * ppu
    u = c.usage()
    assert u.mapped_bytes == u.allocated_bytes == u.capacity_bytes == 8 * ppu * PAGE
    assert u.free_tokens == 0 and not c.can_allocate(1)
    d2 = _write_all(c, 2, 0, 4 * ut, seed=7)
    d3 = _write_all(c, 3, 0, 4 * ut, seed=8)
    assert torch.equal(c.gather(2, 1)[1], d2[1][1]) and torch.equal(c.gather(3, 1)[1], d3[1][1])
    c.check_integrity()


def test_full_cache_raises_and_leaves_state_unchanged(make, layout):
    c = make(num_units=4, max_num_seqs=3)
    ut = UT[layout]
    c.allocate(1, 3 * ut)
    data = _write_all(c, 1, 0, 3 * ut, seed=9)
    before = (c.usage(), _maps(c))
    with pytest.raises(KVCacheFullError) as e:
        c.allocate(2, 2 * ut)
    assert e.value.needed_tokens == 2 * ut and e.value.available_tokens == ut
    with pytest.raises(KVCacheFullError) as e:
        c.extend(1, ut + 1)
    assert e.value.available_tokens == ut
    assert (c.usage(), _maps(c)) == before and not c.has_seq(2) and c.seq_len(1) == 3 * ut
    # copy-on-write with no page left
    c.allocate(2, ut)
    c.fork(1, 3)
    before = (c.usage(), _maps(c))
    k, v = _kv(1, seed=10)
    with pytest.raises(KVCacheFullError, match="copy-on-write"):
        c.write(3, 0, 0, k, v)
    with pytest.raises(KVCacheFullError, match="copy-on-write"):
        c.prepare([StepSeq(3, 0, 1)])
    assert (c.usage(), _maps(c)) == before
    for seq in (1, 3):
        assert torch.equal(c.gather(seq, 0)[0], data[0][0])
    c.check_integrity()


def test_slots_exhausted(make):
    c = make(max_num_seqs=2)
    c.allocate(1, 1)
    c.allocate(2, 1)
    # free memory remains (free_tokens is pool-wide), but no slot: nothing can be admitted
    assert not c.can_allocate(1) and c.usage().free_tokens > 0
    with pytest.raises(SlotsExhaustedError, match="max_num_seqs") as e:
        c.allocate(3, 1)
    assert isinstance(e.value, KVCacheFullError) and isinstance(e.value, ValueError)
    with pytest.raises(KVCacheFullError):
        c.fork(1, 3)
    c.check_integrity()


def _prefill(c, seq, n, seed, start=0):
    """One prefill step through prepare/write_kv (marks the tokens written)."""
    meta = c.prepare([StepSeq(seq, start, n - start)])
    for layer in range(SPEC.num_layers):
        k, v = _kv(n - start, seed * 10 + layer)
        c.write_kv(layer, k, v, meta)


def test_prefix_hits_exact_counts(make, layout):
    c = make()
    ut = UT[layout]
    n = 2 * ut + ut // 2
    prompt = list(range(100, 100 + n))
    assert c.allocate(1, n, prompt) == 0
    assert c.allocate(2, n, prompt) == 0      # registered only once written
    c.free(2)
    _prefill(c, 1, n, seed=11)
    assert c.allocate(3, n, prompt) == 2 * ut
    for layer in range(SPEC.num_layers):
        for a, b in zip(c.gather(3, layer), c.gather(1, layer)):
            assert torch.equal(a[:2 * ut], b[:2 * ut])
    assert c.allocate(4, 2 * ut, prompt[:2 * ut]) == ut      # the last token is always computed
    assert c.allocate(5, n, [7] + prompt[1:]) == 0            # chained hash: first unit differs
    u = c.usage()
    assert u.prefix_query_tokens == 4 * n + 2 * ut and u.prefix_hit_tokens == 3 * ut
    assert u.unit_tokens == ut
    # seq 3 and 4 map seq 1's first units: those pages count once
    ppu = PPU[layout]
    assert u.allocated_bytes == (3 + 1 + 1 + 3) * ppu * PAGE
    c.check_integrity()


def test_prefix_pages_survive_free_and_are_reclaimed_last(make, layout):
    c = make(num_units=7, max_num_seqs=3)
    ut, ppu = UT[layout], PPU[layout]
    n = 2 * ut + 1
    prompt = list(range(n))
    c.allocate(1, n, prompt)
    _prefill(c, 1, n, seed=12)
    slot1 = c.slot_of(1)
    c.free(1)                                  # 3 kept units, 2 of them cached
    maps = _maps(c)
    assert c.allocate(2, n, prompt) == 2 * ut  # found after free, in place: no map call
    assert c.slot_of(2) == slot1 and _maps(c) == maps
    c.free(2)
    c.allocate(3, 5 * ut)                      # avoids the cached slot; reclaims its uncached unit
    assert c.slot_of(3) != slot1
    assert c.vmm_stats()["num_reclaimed_pages"] == ppu
    c.free(3)
    assert c.allocate(4, n, prompt) == 2 * ut
    assert c.slot_of(4) == slot1
    c.free(4)
    c.allocate(5, 7 * ut)                      # needs every page: the cached ones go too
    assert c.vmm_stats()["num_prefix_entries"] == 0
    c.free(5)
    assert c.allocate(6, n, prompt) == 0
    c.check_integrity()


def test_cached_prefix_outlives_its_slot_while_pages_are_free(make, layout):
    """Issue 9: with 2 slots, both taken by other prompts after the prompt was freed, its cached
    pages survive unmapped (cached free in the pool) while free pages exist; re-asking it hits
    every full page, as the paged backend does, and maps them back."""
    c = make(num_units=16, max_num_seqs=2)
    ut = UT[layout]
    n = 3 * ut + 1
    prompt = list(range(n))
    c.allocate(1, n, prompt)
    data = _write_all(c, 1, 0, n, seed=20)
    c.free(1)
    for seq, base in ((2, 1000), (3, 2000)):   # the second one must take the prompt's slot
        c.allocate(seq, n, [base + t for t in range(n)])
        _write_all(c, seq, 0, n, seed=seq)
    assert c.usage().free_tokens > 0
    assert c.vmm_stats()["num_cached_free_pages"] == 3 * PPU[layout]
    c.free(2)
    c.free(3)
    assert c.allocate(4, n, prompt) == 3 * ut
    for layer, (k, v) in data.items():
        gk, gv = c.gather(4, layer)
        assert torch.equal(gk[:3 * ut], k[:3 * ut]) and torch.equal(gv[:3 * ut], v[:3 * ut])
    assert c.vmm_stats()["num_prefix_evictions"] == 0
    c.check_integrity()


def test_cached_pages_evicted_lru_tail_first_only_when_nothing_else_is_free(make, layout):
    c = make(num_units=8, max_num_seqs=3)
    ut, ppu = UT[layout], PPU[layout]
    n = 3 * ut + 1
    prompt = list(range(n))
    c.allocate(1, n, prompt)
    data = _write_all(c, 1, 0, n, seed=21)
    c.free(1)                                  # 4 kept units, 3 of them cached; 4 pool units
    c.allocate(2, 5 * ut)                      # 4 pool units + the uncached kept unit: no eviction
    stats = c.vmm_stats()
    assert stats["num_reclaimed_pages"] == ppu and stats["num_prefix_evictions"] == 0
    c.free(2)
    c.allocate(3, 6 * ut)                      # one more unit: the cached chain loses its tail
    assert c.vmm_stats()["num_prefix_evictions"] == 1
    c.free(3)
    assert c.allocate(4, n, prompt) == 2 * ut
    for layer, (k, v) in data.items():
        gk, gv = c.gather(4, layer)
        assert torch.equal(gk[:2 * ut], k[:2 * ut]) and torch.equal(gv[:2 * ut], v[:2 * ut])
    c.check_integrity()


def test_usage_arithmetic(make, layout):
    c = make(num_units=16)
    ut, ppu = UT[layout], PPU[layout]
    bpt = SPEC.bytes_per_token
    c.allocate(1, ut + 1)
    u = c.usage()
    assert u.num_seqs == 1 and u.used_tokens == ut + 1
    assert u.allocated_bytes == 2 * ppu * PAGE
    assert u.waste_bytes == 2 * ppu * PAGE - (ut + 1) * bpt
    assert u.waste_pct == pytest.approx(100 * u.waste_bytes / u.allocated_bytes)
    assert u.capacity_bytes == 16 * ppu * PAGE
    # each reservation: the guard page every kernel launch points into, then 4 slot rows
    assert u.reserved_bytes == c.layout.num_reservations * (PAGE + 4 * c.layout.slot_stride_bytes)
    assert u.free_tokens == 14 * ut                      # pool-wide, not capped at max_model_len
    assert c.can_allocate(min(MAX_LEN, u.free_tokens))
    c.fork(1, 2)
    u = c.usage()
    assert u.used_tokens == 2 * (ut + 1) and u.allocated_bytes == 2 * ppu * PAGE
    assert u.waste_bytes == 2 * ppu * PAGE - (ut + 1) * bpt
    c.free(1)
    c.free(2)
    u = c.usage()
    assert (u.num_seqs, u.allocated_bytes, u.waste_bytes) == (0, 0, 0)
    assert u.mapped_bytes == 2 * ppu * PAGE
    c.check_integrity()


def test_step_path_matches_reference(make, layout):
    c = make()
    num_heads = 4
    scale = SPEC.head_dim ** -0.5
    oracle = {}                                       # (seq, layer) -> (K, V) written so far
    c.allocate("a", 9)
    c.allocate("b", 5)
    steps = [[StepSeq("a", 0, 5), StepSeq("b", 0, 5)],              # chunked prefill of a
             [StepSeq("a", 5, 4), StepSeq("b", 5, 1)],              # rest of a + decode of b
             [StepSeq("a", 9, 1), StepSeq("b", 6, 1)]]              # decode both
    for step, batch in enumerate(steps):
        for e in batch:
            grow = e.num_computed_tokens + e.num_new_tokens - c.seq_len(e.seq_id)
            if grow > 0:
                c.extend(e.seq_id, grow)
        meta = c.prepare(batch)
        slots = [c.slot_of(e.seq_id) for e in batch]
        assert meta.slot_indices.tolist() == slots
        expect = [s * MAX_LEN + p for s, e in zip(slots, batch)
                  for p in range(e.num_computed_tokens, e.num_computed_tokens + e.num_new_tokens)]
        assert meta.slot_mapping.tolist() == expect
        for layer in range(SPEC.num_layers):
            k, v = _kv(meta.num_tokens, seed=100 + 10 * step + layer)
            q = torch.randn(meta.num_tokens, num_heads, SPEC.head_dim)
            c.write_kv(layer, k, v, meta)
            out = c.attention(layer, q, meta)
            assert out.shape == q.shape and out.dtype == q.dtype
            start = 0
            for e in batch:
                n = e.num_new_tokens
                ok, ov = oracle.get((e.seq_id, layer), (k[:0], v[:0]))
                ok, ov = torch.cat([ok, k[start:start + n]]), torch.cat([ov, v[start:start + n]])
                oracle[(e.seq_id, layer)] = (ok, ov)
                ref = attention_one_seq_ref(q[start:start + n], ok, ov, e.num_computed_tokens, scale)
                torch.testing.assert_close(out[start:start + n], ref)
                start += n
    for (seq, layer), (ok, ov) in oracle.items():
        gk, gv = c.gather(seq, layer)
        assert torch.equal(gk, ok) and torch.equal(gv, ov)
    c.check_integrity()


@pytest.mark.parametrize("impl", ["torch", "sdpa"])
def test_attention_impls_agree(make, impl):
    if impl == "sdpa":
        pytest.importorskip("vmkv.kernels.sdpa")
    c = make(attention_impl=impl)
    c.allocate(1, 7)
    c.allocate(2, 3)
    meta = c.prepare([StepSeq(1, 0, 7), StepSeq(2, 0, 3)])
    k, v = _kv(10, seed=14)
    q = torch.randn(10, 4, SPEC.head_dim)
    c.write_kv(0, k, v, meta)
    out = c.attention(0, q, meta, scale=0.3)
    torch.testing.assert_close(out[:7], attention_one_seq_ref(q[:7], k[:7], v[:7], 0, 0.3))
    torch.testing.assert_close(out[7:], attention_one_seq_ref(q[7:], k[7:], v[7:], 0, 0.3))
    with pytest.raises(ValueError, match="attention_impl"):
        make(attention_impl="flash")


def test_fractional_tokens_per_page_disables_prefix_caching(caplog):
    spec = KVCacheSpec(num_layers=1, num_kv_heads=3, head_dim=4, dtype=torch.float32)  # 96 B per token
    with caplog.at_level(logging.INFO, logger="vmkv.vmem.cache"):
        c = VMemKVCache(spec, max_num_seqs=2, max_model_len=100, memory_bytes=4 * PAGE, driver="host",
                        page_size_bytes=PAGE)
    assert "prefix caching disabled" in caplog.text and not c.enable_prefix_caching
    try:
        assert c.allocate(1, 50, list(range(50))) == 0
        u = c.usage()
        assert u.unit_tokens == 0 and u.prefix_query_tokens == 0
        assert u.allocated_bytes == 2 * PAGE and u.waste_bytes == 2 * PAGE - 50 * 96
        k = torch.randn(50, 3, 4)
        v = torch.randn(50, 3, 4)
        c.write(1, 0, 0, k, v)               # token 42 straddles the two pages
        gk, gv = c.gather(1, 0)
        assert torch.equal(gk, k) and torch.equal(gv, v)
        assert c.usage().free_tokens == 85 and c.can_allocate(85) and not c.can_allocate(86)
        c.check_integrity()
    finally:
        c.close()


def test_lookahead_maps_ahead_of_seq_len(make, layout):
    ut, ppu = UT[layout], PPU[layout]
    c = make(num_units=5, lookahead_tokens=2 * ut)
    c.allocate(1, 1)
    assert _maps(c)[0] == 3 * ppu               # units for 1 + 2 ut positions
    u = c.usage()
    assert u.allocated_bytes == 3 * ppu * PAGE  # over-mapped pages are allocated (and waste)
    assert u.waste_bytes == 3 * ppu * PAGE - SPEC.bytes_per_token
    c.extend(1, ut)                             # needs 2 units (mapped); look-ahead adds a 4th
    assert _maps(c)[0] == 4 * ppu
    c.extend(1, 2 * ut)                         # needs 4 units; look-ahead wants 6, the pool has 5
    assert _maps(c)[0] == 5 * ppu and c.usage().allocated_bytes == 5 * ppu * PAGE
    assert not c.can_allocate(1)                # look-ahead pages are not reclaimable
    c.check_integrity()


def test_argument_errors_leave_state_unchanged(make, layout):
    c = make()
    c.allocate(1, 5)
    before = c.usage()
    with pytest.raises(DuplicateSequenceError):
        c.allocate(1, 5)
    for bad in (0, MAX_LEN + 1, 2.5):
        with pytest.raises(ValueError, match=r"\[1, 128\]"):
            c.allocate(2, bad)
    with pytest.raises(ValueError, match="token_ids"):
        c.allocate(2, 3, [1, 2])
    with pytest.raises(UnknownSequenceError, match="unknown sequence 9"):
        c.extend(9, 1)
    with pytest.raises(ValueError, match="max_model_len"):
        c.extend(1, MAX_LEN)
    k, v = _kv(6, seed=13)
    with pytest.raises(ValueError, match="seq_len 5"):
        c.write(1, 0, 0, k, v)
    with pytest.raises(ValueError, match="layer"):
        c.write(1, 2, 0, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"\[num_tokens, 2, 32\]"):
        c.write(1, 0, 0, torch.zeros(1, 3, 32), torch.zeros(1, 3, 32))
    with pytest.raises(ValueError, match="extend"):
        c.prepare([StepSeq(1, 4, 2)])
    with pytest.raises(ValueError, match="twice"):
        c.prepare([StepSeq(1, 0, 1), StepSeq(1, 1, 1)])
    with pytest.raises(UnknownSequenceError):
        c.free(2)
    with pytest.raises(DuplicateSequenceError):
        c.fork(1, 1)
    assert c.usage() == before
    c.check_integrity()


def test_constructor_validation():
    kw = dict(max_num_seqs=2, max_model_len=16, driver="host")
    with pytest.raises(ValueError, match="unknown vmem layout"):
        VMemKVCache(SPEC, memory_bytes=1 << 20, layout="paged", **kw)
    with pytest.raises(ValueError, match="lookahead_tokens"):
        VMemKVCache(SPEC, memory_bytes=1 << 20, lookahead_tokens=-1, **kw)
    with pytest.raises(ValueError, match="memory_bytes"):
        VMemKVCache(SPEC, memory_bytes=3 * PAGE, layout="per_layer", page_size_bytes=PAGE, **kw)
    with pytest.raises(ValueError, match="OS page size"):
        VMemKVCache(SPEC, memory_bytes=1 << 20, page_size_bytes=1000, **kw)
    with pytest.raises(ValueError, match="unknown vmem driver"):
        VMemKVCache(SPEC, memory_bytes=1 << 20, max_num_seqs=2, max_model_len=16, driver="gpu")


def test_close_releases_everything():
    drv = CheckedDriver(HostDriver("cpu", PAGE))
    c = VMemKVCache(SPEC, max_num_seqs=3, max_model_len=MAX_LEN, memory_bytes=64 * PAGE, driver=drv,
                    layout="per_layer")
    c.allocate(1, 40)
    c.fork(1, 2)
    c.extend(2, 1)
    c.allocate(3, 20)
    c.free(3)
    assert drv.num_mappings > 0 and drv.num_reservations == 4
    c.close()
    assert (drv.num_mappings, drv.num_pages, drv.num_reservations) == (0, 0, 0)
    c.close()                                  # idempotent
    with pytest.raises(KVCacheError, match="closed"):
        c.allocate(4, 1)
    assert not c.can_allocate(1)
    drv.close()
    owned = VMemKVCache(SPEC, max_num_seqs=1, max_model_len=16, memory_bytes=16 * PAGE, driver="host")
    owned.allocate(1, 16)
    owned.close()
    assert owned.driver.num_reservations == 0 and owned.driver._closed


def test_registry_builds_vmem():
    c = create_kv_cache("vmem", SPEC, max_num_seqs=2, max_model_len=32, memory_bytes=32 * PAGE,
                        driver="host", layout="per_layer", page_size_bytes=PAGE, lookahead_tokens=4)
    try:
        assert isinstance(c, VMemKVCache) and c.layout.name == "per_layer" and c.lookahead_tokens == 4
    finally:
        c.close()


def _content(tokens, layer, kind):
    """K/V of a position: a function of the whole prefix, so prefix-cache hits are checkable."""
    value = (hash(tuple(tokens)) % 1000) / 10.0 + layer + 0.25
    return torch.full((SPEC.num_kv_heads, SPEC.head_dim), value if kind == 0 else -value)


def test_random_operations_against_an_oracle(make, layout):
    """Seeded random allocate/extend/fork/free/write under memory pressure: every live sequence
    always reads back exactly the K/V of its own token history, and the counts stay consistent."""
    rng = random.Random(1234 + len(layout))
    c = make(num_units=12, max_num_seqs=5)
    ut = UT[layout]
    prefixes = [[rng.randrange(50) for _ in range(3 * ut)] for _ in range(2)]
    tokens = {}                                     # seq -> token ids (positions 0..seq_len-1)
    next_id = 0

    def write_range(seq, start, end):
        for layer in range(SPEC.num_layers):
            k = torch.stack([_content(tokens[seq][:p + 1], layer, 0) for p in range(start, end)])
            v = torch.stack([_content(tokens[seq][:p + 1], layer, 1) for p in range(start, end)])
            c.write(seq, layer, start, k, v)

    for _ in range(150):
        before = c.usage()
        try:
            done = random_op(c, rng, tokens, next_id, prefixes, MAX_LEN, write_range,
                             new_token=lambda: rng.randrange(50))
            if done is None:
                continue
            next_id = done
        except KVCacheFullError:
            assert c.usage() == before
        c.check_integrity()
        for seq, ids in tokens.items():
            assert c.seq_len(seq) == len(ids)
            layer = rng.randrange(SPEC.num_layers)
            gk, gv = c.gather(seq, layer)
            p = rng.randrange(len(ids))
            assert torch.equal(gk[p], _content(ids[:p + 1], layer, 0)), (seq, p)
            assert torch.equal(gv[p], _content(ids[:p + 1], layer, 1)), (seq, p)
    u = c.usage()
    assert u.used_tokens == sum(len(t) for t in tokens.values())
    assert u.allocated_bytes <= u.mapped_bytes <= u.capacity_bytes
    assert u.prefix_hit_tokens > 0 and u.num_cow_copies > 0


def test_page_creation_out_of_memory_is_a_full_cache(make, layout, monkeypatch):
    """A cuMemCreate / page-file growth that runs out of memory is KVCacheFullError (the engine
    preempts), changes nothing, and the cache works once memory is back."""
    c = make()
    c.allocate(1, 5)
    c.check_integrity()
    before = (c.usage(), c.driver.num_pages, c.driver.num_mappings)
    drv = c.driver

    def no_memory():
        raise VMMError(drv.calls["create_page"], "ENOMEM (Cannot allocate memory)", "injected")
    monkeypatch.setattr(drv.inner, "_create_page", no_memory)     # the OS call under CheckedDriver
    with pytest.raises(KVCacheFullError, match="could not create a page") as err:
        c.allocate(2, 3 * UT[layout])
    assert isinstance(err.value.__cause__, VMMError) and err.value.__cause__.out_of_memory
    with pytest.raises(KVCacheFullError):
        c.extend(1, 3 * UT[layout])
    assert not c.has_seq(2) and c.seq_len(1) == 5
    assert (c.usage(), c.driver.num_pages, c.driver.num_mappings) == before
    c.check_integrity()
    monkeypatch.undo()
    assert c.allocate(2, 3 * UT[layout]) == 0
    c.extend(1, 3 * UT[layout])
    c.check_integrity()


def test_other_driver_errors_are_not_a_full_cache(make, layout, monkeypatch):
    c = make()
    drv = c.driver

    def broken():
        raise VMMError(drv.calls["create_page"], "EBADF (Bad file descriptor)", "injected")
    monkeypatch.setattr(drv.inner, "_create_page", broken)
    with pytest.raises(VMMError, match="EBADF"):
        c.allocate(2, 3)
    c.check_integrity()
