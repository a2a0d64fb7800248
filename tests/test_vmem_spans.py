"""Spans on the host driver (vmkv.vmem.page_pool, "Spans"): a run of fresh pages of one slot created
as one allocation and mapped with one call; hits and forks on span pages copy; spans are claimed,
unmapped and released whole; a grow maps ahead by at most an eighth of the sequence; releasing a
span gives its memory back to the OS.  The contract suite and the state machine run the span cases
too (kvcache_cases.CASES: vmem-span, vmem-span-per_layer), and the reserve fuzz with spans."""

from __future__ import annotations

import os

import pytest
import torch

from kvcache_cases import SPEC, one_torch_thread, rand_kv
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: every driver call validated
from vmkv import KVCacheFullError, create_kv_cache
from vmkv.vmem.checked_driver import CheckedDriver
from vmkv.vmem.host_driver import HostDriver
from vmkv.vmem.protocol import VMMError

PAGE = 4096           # SPEC: 256 B per token, so 16 tokens per megacache page
UT = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def _cache(span_pages=8, cap_pages=64, **kw):
    kw.setdefault("kv_shrink_grace_s", 0)
    kw.setdefault("kv_reserve_bytes", 0)
    return create_kv_cache("vmem", SPEC, max_num_seqs=4, max_model_len=32 * UT, memory_bytes=cap_pages * PAGE,
                           driver="host", page_size_bytes=PAGE, max_span_bytes=span_pages * PAGE, **kw)


def _write(c, seq, start, n, gen):
    out = []
    for layer in range(SPEC.num_layers):
        k, v = rand_kv(gen, n)
        c.write(seq, layer, start, k, v)
        out.append((k, v))
    return out


def _holds(c, seq, data, upto):
    for layer, (k, v) in enumerate(data):
        gk, gv = c.gather(seq, layer)
        assert torch.equal(gk[:upto], k[:upto]) and torch.equal(gv[:upto], v[:upto])


def test_host_span_is_one_mapping_and_its_memory_goes_back():
    d = CheckedDriver(HostDriver("cpu", PAGE))
    try:
        va = d.reserve(8 * PAGE)
        span = d.create_page(num_pages=4)
        assert d.num_pages == 4
        with pytest.raises(VMMError, match="span"):
            d.map(va, span)                            # a part of a span is never mapped
        d.map(va, span, num_pages=4)
        t = d.as_tensor(va, 4 * PAGE)
        t.fill_(7)                                     # touch every page: resident in the memfd
        fd = d.inner._fd
        assert os.fstat(fd).st_blocks * 512 >= 4 * PAGE
        with pytest.raises(VMMError, match="span"):
            d.unmap(va + PAGE)                         # not from its first page
        with pytest.raises(VMMError, match="mapped"):
            d.release(span, num_pages=4)
        d.unmap(va, num_pages=4)
        with pytest.raises(VMMError, match="span of 4"):
            d.release(span)                            # released whole or not at all
        d.release(span, num_pages=4)
        assert os.fstat(fd).st_blocks == 0             # fallocate(PUNCH_HOLE): the memory is back
        assert d.num_pages == 0
        single = d.create_page()                       # released offsets are reused one by one
        assert single in (span, span + PAGE, span + 2 * PAGE, span + 3 * PAGE)
        d.release(single)
        d.free_reservation(va, 8 * PAGE)
    finally:
        d.close()


def test_admission_is_one_span_one_access_call():
    c = _cache(span_pages=8)
    try:
        c.allocate(1, 11 * UT + 3)                     # 12 pages: a span of 8 and one of 4
        s = c.vmm_stats()
        assert (s["num_spans_created"], s["num_span_pages"], s["num_map_batches"]) == (2, 12, 1)
        assert s["num_set_access_calls"] == 1          # the two spans are adjacent: one run
        c.check_integrity()
    finally:
        c.close()


def test_spans_need_room_under_the_cap():
    c = _cache(span_pages=8, cap_pages=12)
    try:
        c.allocate(1, 6 * UT)                          # one span of 6
        c.free(1)
        c.allocate(2, 2 * UT)                          # into its slot: claiming the span whole would
        assert c.seqs.get(2).units.claimed == 2        # add more than an eighth: it goes, 2 fresh pages
        c.allocate(3, 10 * UT)                         # 10 left under the cap
        c.check_integrity()
        assert c.pool.num_created == 12
        c.free(3)
        released = c.vmm_stats()["num_released_span_pages"]
        c.allocate(5, 9 * UT)                          # its kept span of 2 reaches past 9 units, and
        assert c.seqs.get(5).units.claimed == 9        # the pool is at the cap: that span goes
        assert c.vmm_stats()["num_released_span_pages"] == released + 2
        with pytest.raises(KVCacheFullError):
            c.allocate(4, 8 * UT)
        c.check_integrity()
    finally:
        c.close()


def test_hit_and_fork_on_a_span_copy_the_bytes():
    gen = torch.Generator().manual_seed(0)
    c = _cache(span_pages=8)
    try:
        n = 5 * UT + 4
        prompt = list(range(n))
        c.allocate(1, n, token_ids=prompt)
        a = _write(c, 1, 0, n, gen)
        hit = c.allocate(2, n, token_ids=prompt)
        assert hit == 5 * UT and c.vmm_stats()["num_span_copies"] == 5
        _holds(c, 2, a, hit)
        mine = _write(c, 2, hit, n - hit, gen)
        c.fork(1, 3)
        assert c.vmm_stats()["num_span_copies"] == 5 + 6
        _holds(c, 3, a, n)
        _write(c, 3, 0, 1, gen)                        # the copy is private: no copy-on-write
        _holds(c, 1, a, n)
        for layer, (k, v) in enumerate(mine):
            gk, _ = c.gather(2, layer)
            assert torch.equal(gk[hit:n], k)
        c.check_integrity()
    finally:
        c.close()


def test_fork_that_cannot_copy_is_refused_unchanged():
    gen = torch.Generator().manual_seed(1)
    c = _cache(span_pages=8, cap_pages=10)
    try:
        c.allocate(1, 6 * UT)
        _write(c, 1, 0, 6 * UT, gen)
        before = c.usage()
        with pytest.raises(KVCacheFullError, match="fork copies 6 pages"):
            c.fork(1, 2)
        assert c.usage() == before and not c.has_seq(2)
        c.check_integrity()
    finally:
        c.close()


def test_grow_takes_a_ready_span_of_eight_units():
    """A sequence of at least GROW_SPAN_PAGES units grows by that many at once, taking a span the
    reserve top-up created ahead of need (no creation on the grow); a shorter one page by page."""
    from vmkv.vmem.backing import GROW_SPAN_PAGES as G
    c = _cache(span_pages=16, cap_pages=256, kv_reserve_bytes=2 * G * PAGE)
    try:
        assert c.pool.ready_span_pages == G and c.mapper.reserve_split(2 * G) == (G, 1)
        c.allocate(1, 24 * UT)
        c.allocate(2, 4 * UT)
        c.release_idle(now=0.0)                        # the top-up: G plain free pages, one ready span
        assert (c.pool.num_free, c.pool.num_ready_spans) == (G, 1)
        created = c.pool.num_created
        c.extend(1, 1)                                 # crosses into unit 24: claims G units at once
        assert c.seqs.get(1).units.claimed == 24 + G
        assert c.pool.num_ready_spans == 0 and c.pool.num_created == created   # taken, not created
        s = c.vmm_stats()
        for _ in range(G * UT - 1):
            c.extend(1, 1)                             # inside the claimed units: no map call
        assert c.vmm_stats()["num_maps"] == s["num_maps"]
        c.extend(2, 1)                                 # 4 < G units: one plain free page
        assert c.seqs.get(2).units.claimed == 5 and c.pool.num_free == G - 1
        c.release_idle(now=1.0)                        # the top-up makes the ready span again
        assert c.pool.num_ready_spans == 1
        c.check_integrity()
    finally:
        c.close()


def test_ready_spans_make_room_at_the_cap():
    """Single pages at the cap come from releasing a ready span, before reclaiming anything."""
    from vmkv.vmem.backing import GROW_SPAN_PAGES as G
    c = _cache(span_pages=16, cap_pages=4 * G, kv_reserve_bytes=2 * G * PAGE)
    try:
        c.allocate(1, 2 * G * UT)
        c.release_idle(now=0.0)
        assert c.pool.num_ready_spans == 1 and c.pool.num_created == 4 * G   # 2G + G + one span of G
        c.allocate(2, 2 * G * UT)                      # needs the ready span's memory too
        assert c.pool.num_ready_spans == 0
        c.check_integrity()
    finally:
        c.close()


def test_idle_spans_are_released_and_the_reserve_comes_back():
    c = _cache(span_pages=8, cap_pages=64, kv_reserve_bytes=2 * PAGE)
    try:
        for i in range(3):
            c.allocate(i, 7 * UT)
        for i in range(3):
            c.free(i)
        c.release_idle(now=1.0)
        m = c.mapper
        assert m.num_idle_pages() == 2 and c.vmm_stats()["num_span_pages"] <= 2
        c.check_integrity()
    finally:
        c.close()
