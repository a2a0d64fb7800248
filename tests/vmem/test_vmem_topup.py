"""The vmem page reserve kept ahead of need (issue 12, allocator peers): between steps
(``release_idle``) and after ``prefetch``, pages are created until ``kv_reserve_bytes`` are idle, so
the next grows and admissions find created pages instead of calling ``cuMemCreate`` on the critical
path.  Never beyond the cap, never fighting the shrink (idle pages up to the reserve are never
released), and a creation out of memory ends the top-up quietly.

Clocks are injected (``release_idle(now=...)``), never slept on; no test is timed.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvcache_cases import SPEC, one_torch_thread
from engine_helpers import one_thread, tiny  # noqa: F401 (fixtures)
from test_vmem_elastic import KIB, MIB, PAGE, assert_filled, assert_filled_prefix, fill, make_cache
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: caches get CheckedDriver
from vmkv.vmem import elastic as vmem_elastic
from vmkv.vmem.driver import VMMError
from vmkv import KVCacheFullError, create_kv_cache


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def _count_creations(cache, monkeypatch, fail=None) -> dict:
    """Count the driver's page creations; ``fail``: an errno text every creation fails with."""
    inner = getattr(cache.driver, "inner", cache.driver)
    real = inner._create_page
    calls = {"n": 0}

    def create():
        calls["n"] += 1
        if fail is not None:
            raise VMMError(inner.calls["create_page"], fail, "injected")
        return real()
    monkeypatch.setattr(inner, "_create_page", create)
    return calls


def _state(cache) -> tuple:
    m = cache.mapper
    return m.pool.num_created, m.num_idle_pages(), m.pool.num_free, m.num_allocated_pages()


def test_release_idle_tops_the_reserve_up_and_counts_the_pages_as_created_and_idle():
    cache = make_cache(grace_s=5.0, reserve=8 * PAGE)
    try:
        free_tokens = cache.usage().free_tokens
        assert _state(cache) == (0, 0, 0, 0)
        assert cache.release_idle(now=0.0) == 0              # nothing released: nothing was idle
        assert _state(cache) == (8, 8, 8, 0)                 # 8 plain free pages, created ahead
        u = cache.usage()
        assert (u.created_bytes, u.allocated_bytes, u.mapped_bytes) == (8 * PAGE, 0, 0)
        assert u.free_tokens == free_tokens                  # created or not, they were obtainable
        stats = cache.backend_stats()
        assert stats["num_topped_up_pages"] == 8 and stats["num_idle_pages"] == 8
        cache.check_integrity()
        for t in (1.0, 6.0, 100.0):                          # at the reserve: never released
            assert cache.release_idle(now=t) == 0
            assert _state(cache) == (8, 8, 8, 0)
        assert cache.backend_stats()["num_topped_up_pages"] == 8
        cache.check_integrity()
    finally:
        cache.close()


def test_grows_and_admissions_after_a_top_up_create_no_page(monkeypatch):
    cache = make_cache(grace_s=5.0, reserve=8 * PAGE)
    try:
        cache.release_idle(now=0.0)
        calls = _count_creations(cache, monkeypatch)
        fill(cache, 1, 1024, 1.0)                            # 4 pages: taken from the reserve
        cache.extend(1, 512)                                 # 2 more
        assert calls["n"] == 0
        assert _state(cache) == (8, 2, 2, 6)
        cache.release_idle(now=1.0)                          # the next top-up refills it
        assert calls["n"] == 6 and _state(cache) == (14, 8, 8, 6)
        assert_filled_prefix(cache, 1, 1024, 1.0)
        cache.check_integrity()
    finally:
        cache.close()


def test_kept_pages_of_freed_slots_do_not_hold_the_top_up_back(monkeypatch):
    """Regression (issue 12, allocator peers run 4: the top-up covered 1,579 of 4,506 grows): pages
    kept by freed slots are idle but serve only a warm admission into their own slot, so the reserve
    is counted in plain free pages; grows of the other sequences right after frees create nothing."""
    cache = make_cache(grace_s=5.0, reserve=4 * PAGE)
    try:
        for s in range(4):
            fill(cache, s, 1024, float(s))                   # 4 pages each
        cache.release_idle(now=0.0)
        cache.free(0)
        cache.free(1)                                        # 8 kept pages: idle > the reserve
        cache.release_idle(now=1.0)
        assert cache.mapper.pool.num_free == 4 and cache.mapper.num_idle_pages() == 12
        calls = _count_creations(cache, monkeypatch)
        cache.extend(2, 512)                                 # 2 page boundaries each
        cache.extend(3, 512)
        assert calls["n"] == 0
        for s in (2, 3):
            assert_filled_prefix(cache, s, 1024, float(s))
        # after the grace the high-water mark is the 12 pages seqs 2 and 3 claim: the kept pages go
        # down to ceil(12 * (1 + band / 2)) + the reserve, and the plain free reserve stays
        assert cache.release_idle(now=7.0) == (24 - 14 - 4) * PAGE
        assert cache.mapper.pool.num_free == 4 and cache.mapper.pool.num_created == 14 + 4
        assert cache.mapper.num_idle_pages() == 6 and calls["n"] == 4
        cache.check_integrity()
    finally:
        cache.close()


def test_with_no_sequence_live_the_reserve_stays_mapped_for_the_next_admission(monkeypatch):
    """Once a burst is over, the reserve is kept as mapped pages of a freed slot (the shrink releases
    plain free pages first then), so the next admission adopts them without a driver call; as soon
    as it is live, the reserve for grows is created again as plain free pages."""
    cache = make_cache(grace_s=5.0, reserve=4 * PAGE)
    try:
        for s in range(2):
            fill(cache, s, 2048, float(s))                   # 8 pages each
        cache.release_idle(now=0.0)                          # live: 4 plain free pages created
        assert cache.mapper.pool.num_free == 4
        cache.free(0)
        cache.free(1)
        cache.release_idle(now=1.0)
        assert cache.release_idle(now=7.0) == (16 + 4 - 4) * PAGE   # plain free first, then kept
        m = cache.mapper
        assert m.num_idle_pages() == 4 and m.pool.num_free == 0 and m.pool.num_created == 4
        inner = getattr(cache.driver, "inner", cache.driver)
        maps = {"n": 0}
        real_map = inner._map

        def counting_map(*a):
            maps["n"] += 1
            return real_map(*a)
        monkeypatch.setattr(inner, "_map", counting_map)
        calls = _count_creations(cache, monkeypatch)
        fill(cache, 5, 1024, 5.0)                            # 4 pages: the kept reserve, adopted
        assert maps["n"] == 0 and calls["n"] == 0
        assert_filled_prefix(cache, 5, 1024, 5.0)
        cache.release_idle(now=8.0)                          # live again: 4 plain free pages
        assert m.pool.num_free == 4 and calls["n"] == 4
        fill(cache, 6, 256, 6.0)                             # a plain free page is mapped: the spy
        assert maps["n"] == 1                                # sees map calls (maps == 0 above is real)
        cache.check_integrity()
    finally:
        cache.close()


def test_top_up_never_exceeds_the_cap():
    cache = make_cache(grace_s=5.0, reserve=16 * PAGE, memory_bytes=6 * PAGE)
    try:
        cache.release_idle(now=0.0)
        assert _state(cache) == (6, 6, 6, 0)                 # capped at 6 pages, not the reserve's 16
        fill(cache, 1, 1024, 1.0)                            # 4 claimed
        cache.release_idle(now=1.0)
        assert _state(cache) == (6, 2, 2, 4)
        cache.prefetch([1], 10_000)
        assert cache.mapper.pool.num_created == 6 == cache.mapper.pool.max_pages
        assert cache.backend_stats()["created_bytes"] == 6 * PAGE
        cache.check_integrity()
    finally:
        cache.close()


def test_top_up_creates_at_most_a_bounded_number_of_pages_per_call_while_sequences_are_live(monkeypatch):
    monkeypatch.setattr(vmem_elastic, "TOP_UP_PAGES_PER_CALL", 3)
    cache = make_cache(grace_s=5.0, reserve=10 * PAGE)
    try:
        fill(cache, 1, 256, 1.0)                             # one page claimed, the seq is live
        cache.release_idle(now=0.0)
        assert _state(cache)[:2] == (4, 3)
        cache.release_idle(now=1.0)
        cache.release_idle(now=2.0)
        assert _state(cache)[:2] == (10, 9)
        cache.release_idle(now=3.0)
        assert _state(cache)[:2] == (11, 10)
        cache.free(1)
        cache.release_idle(now=4.0)                          # idle 11 > reserve: nothing created
        assert _state(cache)[:2] == (11, 11)
        cache.check_integrity()
    finally:
        cache.close()


def test_shrink_still_releases_down_to_the_reserve_and_the_top_up_does_not_undo_it():
    cache = make_cache(grace_s=5.0, reserve=4 * PAGE)
    try:
        cache.release_idle(now=0.0)
        for s in range(8):                                   # a burst: 8 x 4 pages
            fill(cache, s, 1024, float(s))
            cache.release_idle(now=0.1 * s)
        created = cache.mapper.pool.num_created
        assert created == 32 + 4                             # the reserve stays ahead of the burst
        assert cache.release_idle(now=10.0) == 0             # still live: 32 claimed at 10 s
        for s in range(8):
            cache.free(s)
        assert cache.release_idle(now=10.0) == 0             # the burst just ended
        assert cache.release_idle(now=15.0) == 0             # 10 s is still in the window [10, 15]
        assert cache.release_idle(now=15.5) == 32 * PAGE     # all but the reserve
        assert _state(cache)[:2] == (4, 4)
        topped = cache.backend_stats()["num_topped_up_pages"]
        for t in (16.0, 30.0, 60.0):
            assert cache.release_idle(now=t) == 0
        assert _state(cache)[:2] == (4, 4)
        assert cache.backend_stats()["num_topped_up_pages"] == topped
        cache.check_integrity()
    finally:
        cache.close()


def test_out_of_memory_in_the_top_up_is_not_an_error(monkeypatch):
    cache = make_cache(grace_s=5.0, reserve=8 * PAGE)
    try:
        fill(cache, 1, 512, 1.0)
        calls = _count_creations(cache, monkeypatch, fail="ENOMEM (Cannot allocate memory)")
        before = (cache.usage(), _state(cache))
        assert cache.release_idle(now=0.0) == 0              # ENOMEM: the top-up just stops
        cache.prefetch([1], 256)                             # the same from prefetch
        cache.prefetch_admission([512])
        assert calls["n"] >= 2
        assert (cache.usage(), _state(cache)) == before
        cache.check_integrity()
        monkeypatch.undo()
        cache.release_idle(now=1.0)                          # memory is back: the reserve returns
        assert _state(cache)[1] == 8
        assert_filled(cache, 1, 512, 1.0)
        cache.check_integrity()
    finally:
        cache.close()


def test_another_driver_failure_in_the_top_up_propagates(monkeypatch):
    cache = make_cache(grace_s=5.0, reserve=8 * PAGE)
    try:
        _count_creations(cache, monkeypatch, fail="EBADF (Bad file descriptor)")
        with pytest.raises(VMMError, match="EBADF"):
            cache.release_idle(now=0.0)
        monkeypatch.undo()
        cache.check_integrity()
    finally:
        cache.close()


def test_prefetch_tops_the_reserve_up_after_mapping_ahead():
    cache = make_cache(grace_s=5.0, reserve=6 * PAGE)
    try:
        fill(cache, 1, 200, 1.0)                             # 1 page (256 tokens of SPEC)
        m = cache.mapper
        cache.prefetch([1], 1000)                            # maps units 1..4 of seq 1, unclaimed:
        assert m.num_prefetched_pages == 4                   # idle, but not plain free: the reserve
        assert _state(cache) == (11, 10, 6, 1)               # is then made of 6 plain free pages
        fill(cache, 2, 200, 2.0)                             # takes a plain free page
        assert _state(cache) == (11, 9, 5, 2)
        cache.prefetch([2], 16)                              # nothing to map ahead; tops up to 6
        assert _state(cache) == (12, 10, 6, 2)
        cache.extend(1, 1000)                                # claims the 4 prefetched pages
        assert _state(cache) == (12, 6, 6, 6)
        cache.prefetch_admission([300])                      # 2 plain free pages mapped for the next
        assert _state(cache) == (14, 8, 6, 6)                # admission, then 2 created
        cache.check_integrity()
        assert cache.usage().allocated_bytes == 6 * PAGE
    finally:
        cache.close()


def test_preallocated_pool_has_nothing_to_top_up():
    cache = make_cache(grace_s=5.0, reserve=8 * PAGE, memory_bytes=2 * MIB, preallocate=True)
    try:
        cache.release_idle(now=0.0)
        assert cache.backend_stats()["num_topped_up_pages"] == 0
        assert cache.mapper.pool.num_created == 32
    finally:
        cache.close()


def test_contents_stay_correct_through_grow_shrink_and_top_up_cycles():
    """Seeded random grows, admissions, frees, prefetches and releases with a small cap, a reserve
    and grace 0: every live sequence reads back what was written, the pool never passes the cap,
    and after every release the reserve is kept (or the cap stops it): as idle pages when no sequence
    is live (nothing else stays), as plain free pages while some are, beyond which no more than the
    hysteresis band over the claimed pages stays created."""
    rng = random.Random(5)
    reserve = 3
    cache = make_cache(grace_s=0.0, reserve=reserve * PAGE, memory_bytes=24 * PAGE, max_model_len=2048,
                       max_num_seqs=6)
    live: dict[int, list[torch.Tensor]] = {}      # seq -> k per layer, [n, H, D]
    next_id = 0

    def write(seq: int, start: int, n: int) -> None:
        for layer in range(SPEC.num_layers):
            k = torch.randn(n, SPEC.num_kv_heads, SPEC.head_dim, generator=gen)
            cache.write(seq, layer, start, k, -k)
            live[seq][layer] = torch.cat([live[seq][layer][:start], k])

    gen = torch.Generator().manual_seed(5)
    t = 0.0
    try:
        for _ in range(300):
            op = rng.choice(["alloc", "grow", "grow", "free", "prefetch", "release"])
            if op == "alloc" and len(live) < 6:
                n = rng.randint(1, 700)
                if cache.can_allocate(n):
                    cache.allocate(next_id, n)
                    live[next_id] = [torch.zeros(0, SPEC.num_kv_heads, SPEC.head_dim)] * SPEC.num_layers
                    write(next_id, 0, n)
                    next_id += 1
            elif op == "grow" and live:
                seq = rng.choice(sorted(live))
                n = rng.randint(1, 300)
                old = cache.seq_len(seq)
                if old + n <= 2048 and cache.usage().free_tokens >= n + 256:
                    cache.extend(seq, n)
                    write(seq, old, n)
            elif op == "free" and live:
                seq = rng.choice(sorted(live))
                cache.free(seq)
                del live[seq]
            elif op == "prefetch" and live:
                cache.prefetch(sorted(live), rng.randint(1, 600))
            else:
                t += 1.0
                cache.release_idle(now=t)
                m = cache.mapper
                capped = m.pool.num_created == m.pool.max_pages
                if live:            # grace 0: the high-water mark is what is claimed now
                    hwm, band = m.num_allocated_pages(), vmem_elastic.SHRINK_BAND
                    assert m.pool.num_free >= reserve or capped, _state(cache)
                    # learned: what the load released while live and created again stays on top
                    assert m.pool.num_created <= max(hwm * (1 + band), math.ceil(hwm * (1 + band / 2))) \
                        + reserve + cache.elastic.learned_pages, _state(cache)
                else:
                    assert m.num_idle_pages() == reserve or capped, _state(cache)
            assert cache.mapper.pool.num_created <= cache.mapper.pool.max_pages
            cache.check_integrity()
            for seq, ks in live.items():
                for layer in (0, SPEC.num_layers - 1):
                    k, v = cache.gather(seq, layer)
                    assert torch.equal(k, ks[layer]) and torch.equal(v, -ks[layer]), (seq, layer)
        assert cache.backend_stats()["num_topped_up_pages"] > 0
        assert cache.backend_stats()["num_released_pages"] > 0
    finally:
        cache.close()


def test_engine_idle_steps_keep_the_reserve_created(tiny):
    """The engine's between-steps call creates the reserve ahead of the first request, and a request
    that fits in it creates no page on its own path."""
    from engine_helpers import greedy, make_engine, run_all

    engine = make_engine(tiny, "vmem", kv_shrink_grace_s=5.0, kv_reserve_bytes=16 * KIB)
    try:
        kv = engine.kv_cache
        engine.idle()                                        # nothing to run: release_idle
        page = kv.page_size_bytes
        assert kv.mapper.num_idle_pages() == 16 * KIB // page
        engine.add_request("r", None, greedy(4), prompt_token_ids=[1, 2, 3, 4, 5])
        run_all(engine)
        assert kv.mapper.pool.num_created * page >= 16 * KIB
        kv.check_integrity()
    finally:
        engine.close()


@pytest.mark.parametrize("via", ["write", "extend"])
def test_copy_on_write_out_of_memory_refuses_with_nothing_changed(monkeypatch, via):
    """Regression (found by test_vmem_reserve_fuzz.py): a copy-on-write over several reservations
    (per_layer: K and V of a layer) whose page creations fail for want of memory, with one idle page
    to reuse, replaced the first shared page, then failed on the second: the transient
    KVCacheFullError said nothing changed, but the first copy was never made (the child's K was
    lost) and the usage counters were off.  The copies' pages are now all acquired first."""
    page = 16 * KIB
    cache = create_kv_cache("vmem", SPEC, max_num_seqs=4, max_model_len=1024, memory_bytes=64 * page,
                            driver="host", page_size_bytes=page, layout="per_layer", kv_reserve_bytes=0,
                            kv_shrink_grace_s=-1.0)
    try:
        m = cache.mapper
        assert m.num_res == 2 * SPEC.num_layers
        fill(cache, 0, 100, 3.0)
        cache.fork(0, 1)                                 # unit 0 shared by both
        cache.allocate(2, 1)
        cache.free(2)                                    # 4 kept pages ...
        assert m.reclaimer.release(3) == 3               # ... of which 1 stays idle
        _count_creations(cache, monkeypatch, fail="ENOMEM (Cannot allocate memory)")
        k = torch.zeros(1, SPEC.num_kv_heads, SPEC.head_dim)
        with pytest.raises(KVCacheFullError):
            if via == "write":                           # layer 0's K and V pages: 2 copies, 1 page
                cache.write(1, 0, 99, k, k)
            else:                                        # a grow into the shared unit: 4 copies
                cache.extend(1, 10)
        cache.check_integrity()
        for s in (0, 1):
            assert_filled(cache, s, 100, 3.0)
        assert cache.seq_len(1) == 100
    finally:
        cache.close()


def test_look_ahead_out_of_memory_leaves_the_admission_done(monkeypatch):
    """Regression (found by test_vmem_reserve_fuzz.py): the look-ahead map after an admission (or a
    grow, a fork) is best effort, but a page creation out of memory there escaped as a VMMError
    after the mapper had occupied the slot, so the cache never recorded the sequence."""
    cache = make_cache(grace_s=-1.0, reserve=1 * PAGE, lookahead_tokens=256)
    try:
        cache.release_idle(now=0.0)                          # 1 plain free page
        _count_creations(cache, monkeypatch, fail="ENOMEM (Cannot allocate memory)")
        fill(cache, 0, 10, 1.0)                              # takes it; the look-ahead cannot create
        assert cache.has_seq(0) and cache.seq_len(0) == 10
        assert_filled(cache, 0, 10, 1.0)
        cache.check_integrity()
    finally:
        cache.close()
