"""The vmem shrink never fights the load (issue 24, item 1; ``vmkv/vmem/elastic.py``): memory goes
back only beyond the high-water mark of the pages live sequences claimed over the grace window, with a
hysteresis band, never while requests wait, and still falls back to the reserve once a burst is over.

``ShrinkWindow`` unit tests (with a brute-force model on random sequences), then the cache on the
host driver and the engine with a tiny model.  Clocks are fake (``release_idle(now=...)`` or a patched
``time`` in ``vmkv.vmem.cache``); nothing is timed.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import make_engine, one_thread, tiny  # noqa: F401 (fixtures)
from test_vmem_elastic import KIB, MIB, PAGE, clock, fill, make_cache, memfd_bytes  # noqa: F401 (clock)
from vmem_helpers import ShrinkModel, checked_drivers  # noqa: F401 - autouse: caches get CheckedDriver
from vmkv.vmem.elastic import SHRINK_BAND, ShrinkWindow

INF = float("inf")


# ------------------------------------------------------------------ ShrinkWindow
def test_the_high_water_mark_slides_over_the_grace_window():
    """A claimed count leaves the window ``grace_s`` seconds after it was observed (the window is
    ``[now - grace_s, now]``); band 0: what lies beyond the high-water mark goes."""
    w = ShrinkWindow(reserve_pages=0, grace_s=5.0, band=0.0)
    assert w.high_water() == 0                       # before any observation
    assert w.observe(0.0, 100, 80) == 0 and w.high_water() == 80     # grace not over
    assert w.observe(2.0, 100, 50) == 0 and w.high_water() == 80
    assert w.observe(5.0, 100, 30) == 100 - 80 and w.high_water() == 80    # 0 s still in [0, 5]
    assert w.observe(5.5, 80, 30) == 80 - 50 and w.high_water() == 50      # 0 s left, 2 s is in
    assert w.observe(7.0, 50, 30) == 0 and w.high_water() == 50            # 2 s still in [2, 7]
    assert w.observe(7.1, 50, 30) == 50 - 30 and w.high_water() == 30      # and out of [2.1, 7.1]
    assert w.observe(8.0, 30, 45) == 0 and w.high_water() == 45            # a rise counts at once


def test_a_value_leaves_the_window_just_after_grace_s():
    w = ShrinkWindow(reserve_pages=0, grace_s=5.0, band=0.0)
    w.observe(0.0, 100, 50)
    assert w.observe(5.0, 100, 30) == 50             # 0 s is in [0, 5]
    assert w.observe(5.0001, 100, 30) == 70          # and not in [0.0001, 5.0001]


def test_fluctuation_within_the_band_releases_nothing():
    """Hysteresis: nothing goes while the created pages are at most ``hwm * (1 + band) + reserve``;
    beyond it, down to ``ceil(hwm * (1 + band / 2)) + reserve``."""
    assert SHRINK_BAND == 0.25
    w = ShrinkWindow(reserve_pages=4, grace_s=0.0)
    t = 0.0
    for claimed in list(range(100, 79, -1)) + list(range(80, 101)):      # 104 <= 80 * 1.25 + 4
        t += 1.0
        assert w.observe(t, 104, claimed) == 0, claimed
    assert w.observe(t + 1.0, 104, 79) == 104 - math.ceil(79 * 1.125) - 4     # just past the band
    # the same with a window: the dips are under the high-water mark of the last grace period
    w = ShrinkWindow(reserve_pages=4, grace_s=10.0)
    for i in range(200):                           # 20 grace periods of a load between 40 and 100
        assert w.observe(i * 0.5, 104, 40 + (i * 37) % 61) == 0, i
    # and the band itself: release nothing at exactly hwm * (1 + band) + reserve, one page over: some
    w = ShrinkWindow(reserve_pages=0, grace_s=0.0)
    assert w.observe(0.0, 125, 100) == 0
    assert w.observe(1.0, 126, 100) == 126 - 113


def test_nothing_goes_while_requests_wait_and_the_grace_period_restarts_after():
    w = ShrinkWindow(reserve_pages=2, grace_s=5.0)
    assert w.observe(0.0, 50, 0) == 0
    for t in (5.0, 10.0, 100.0, 1e6):               # idle for ages, but requests wait
        assert w.observe(t, 50, 0, num_waiting=3) == 0
    assert w.high_water() == 0
    assert w.observe(1e6 + 1.0, 50, 0) == 0         # the queue is empty: the grace period starts now
    assert w.observe(1e6 + 5.9, 50, 0) == 0
    assert w.observe(1e6 + 6.0, 50, 0) == 48        # all but the reserve, a grace period later
    # one waiting request in the middle of a grace period starts it again
    w = ShrinkWindow(reserve_pages=0, grace_s=5.0)
    assert w.observe(0.0, 10, 0) == 0
    assert w.observe(4.0, 10, 0, num_waiting=1) == 0
    assert w.observe(5.0, 10, 0) == 0 and w.observe(9.9, 10, 0) == 0 and w.observe(10.0, 10, 0) == 10


def test_zero_grace_releases_at_once():
    w = ShrinkWindow(reserve_pages=3, grace_s=0.0)
    assert w.observe(0.0, 10, 0) == 7               # nothing claimed: all but the reserve
    assert w.observe(1.0, 10, 4) == 10 - 5 - 3      # beyond ceil(4 * 1.125) + 3
    assert w.observe(2.0, 20, 16) == 0
    # the window is [now, now]: observations at the same instant are in it together
    assert w.observe(2.0, 20, 0) == 0
    assert w.observe(2.001, 20, 0) == 17
    assert w.observe(3.0, 20, 0, num_waiting=1) == 0     # never while requests wait, grace 0 too
    assert w.observe(3.0, 20, 0) == 17


@pytest.mark.parametrize("grace_s", [-1.0, -1e-9, INF])
def test_negative_or_infinite_grace_never_releases(grace_s):
    w = ShrinkWindow(reserve_pages=0, grace_s=grace_s)
    assert not w.enabled
    for t in (0.0, 1.0, 1e9):
        assert w.observe(t, 10_000, 0) == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="reserve_pages"):
        ShrinkWindow(-1, 5.0)
    for band in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="band"):
            ShrinkWindow(0, 5.0, band=band)


_STEP = st.tuples(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 2.5, 3.0, 5.0, 7.0]),   # dt
                  st.integers(0, 200), st.integers(0, 160),                          # created, claimed
                  st.sampled_from([0, 0, 0, 0, 0, 1, 4]))                            # waiting


@settings(max_examples=300, deadline=None)
@given(reserve=st.integers(0, 8), grace=st.sampled_from([0.0, 0.5, 1.0, 2.5, 5.0, -1.0, INF]),
       band=st.sampled_from([0.0, 0.25, 0.5, 1.0]), steps=st.lists(_STEP, min_size=1, max_size=60))
def test_shrink_window_matches_a_brute_force_model(reserve, grace, band, steps):
    w, model = ShrinkWindow(reserve, grace, band), ShrinkModel(reserve, grace, band)
    t = 0.0
    for dt, created, claimed, waiting in steps:
        t += dt
        got = w.observe(t, created, claimed, waiting)
        assert got == model.allowed(t, created, claimed, waiting), (t, created, claimed, waiting)
        assert 0 <= got <= max(0, created - reserve)
        if w.enabled and not waiting:
            assert w.high_water() == model.hwm(t)


# ------------------------------------------------------------------ the cache, host driver
CYCLE = 40                    # steps of the steady load's cycle; 0.05 s a step: 2 s < the 5 s grace


def _steady_load(cache, lanes, num_cycles: int, t0: float = 0.0, dt: float = 0.05) -> list[tuple]:
    """Sequences admitted and freed in a cycle: each lane ``(prompt, start step, lifetime in steps)``
    admits a sequence at its start step of every cycle, which decodes 16 positions a step until its
    lifetime ends; ``release_idle`` after every step.  Returns ``(time, released pages, created
    pages, claimed pages)`` per step."""
    live: dict[int, int] = {}
    history, next_id, t = [], 0, t0
    for step in range(num_cycles * CYCLE):
        t += dt
        for s in [s for s, end in live.items() if end == step]:
            cache.free(s)
            del live[s]
        for n, start, lifetime in lanes:
            if step % CYCLE == start:
                cache.allocate(next_id, n)
                live[next_id] = step + lifetime
                next_id += 1
        for s in live:
            cache.extend(s, 16)
        cache.release_idle(now=t)
        history.append((t, cache.backend_stats()["num_released_pages"], cache.pool.num_created,
                        cache.mapper.num_allocated_pages()))
    for s in live:
        cache.free(s)
    return history


def test_a_steady_load_releases_nothing_over_many_grace_periods():
    """Regression (issue 24: vmem's elastic release cost 6-11% online): under a steady load whose
    claimed pages go up and down within every grace period, no page is released and none is created
    once the load's memory is made: no create/release churn on the step's path."""
    cache = make_cache(grace_s=5.0, reserve=2 * PAGE, max_num_seqs=16, memory_bytes=64 * MIB)
    try:
        lanes = [(700, 5 * i, 12 + 3 * i) for i in range(8)]         # staggered starts and ends
        history = _steady_load(cache, lanes, num_cycles=40)           # 80 s: 16 grace periods
        claimed = [c for *_, c in history[CYCLE:]]
        assert max(claimed) >= 2 * min(claimed)                       # the load does fluctuate
        assert history[-1][1] == 0 == cache.backend_stats()["num_released_pages"]
        created = [c for _, _, c, _ in history[3 * CYCLE:]]
        assert len(set(created)) == 1               # nothing created after the first cycles (warm-up)
        cache.check_integrity()
    finally:
        cache.close()


def test_a_steady_load_with_mixed_lengths_stops_releasing_once_it_has_seen_its_memory_come_back():
    """With mixed prompt lengths the steady load keeps more created than its claimed high-water mark
    (kept pages of freed slots: a long prompt admitted into a slot that kept few pages creates fresh ones
    while another freed slot's kept pages sit idle), beyond the band, so a shrink by the high-water mark
    alone releases a few pages every cycle and creates them again.  The policy learns: what was released
    while the load ran and then created again on an operation's path stays, so after the first releases
    nothing is released or created any more."""
    cache = make_cache(grace_s=5.0, reserve=2 * PAGE, max_num_seqs=16, memory_bytes=64 * MIB)
    try:
        lanes = [(300 + 137 * i, 5 * i, 12 + 3 * i) for i in range(8)]
        history = _steady_load(cache, lanes, num_cycles=40)
        half = len(history) // 2
        assert history[-1][1] == history[half][1]                   # nothing released in the second half
        assert len({c for _, _, c, _ in history[half:]}) == 1       # nor created
        assert cache.elastic.learned_pages > 0
        assert history[-1][1] <= 2 * cache.elastic.learned_pages     # a cycle or two of churn, then none
        cache.check_integrity()
    finally:
        cache.close()


def test_nothing_is_released_while_requests_wait_even_after_a_long_idle():
    cache = make_cache(grace_s=5.0, reserve=2 * PAGE)
    try:
        for s in range(16):                                   # a burst: 16 x 16 pages
            fill(cache, s, 4096, float(s))
        for s in range(16):
            cache.free(s)
        created, held = cache.pool.num_created, memfd_bytes(cache)
        assert held >= 16 * 16 * PAGE
        for t in (0.0, 5.0, 60.0, 3600.0):                    # requests wait (memory held elsewhere)
            assert cache.release_idle(now=t, num_waiting=2) == 0
        assert cache.pool.num_created == created and memfd_bytes(cache) == held
        assert cache.backend_stats()["num_released_pages"] == 0
        assert cache.release_idle(now=3601.0) == 0            # the queue is empty: grace starts again
        assert cache.release_idle(now=3605.9) == 0
        released = cache.release_idle(now=3606.0)
        assert released == (created - 2) * PAGE               # all but the reserve
        assert memfd_bytes(cache) <= 2 * PAGE                 # the memfd's blocks are punched out
        cache.check_integrity()
    finally:
        cache.close()


def test_after_a_burst_on_top_of_a_steady_load_memory_falls_back_to_the_reserve():
    """Co-location: a steady load, then a burst, then nothing: once the grace period is over, the
    cache holds the reserve and the host memfd's blocks fall with it."""
    cache = make_cache(grace_s=5.0, reserve=2 * PAGE, max_num_seqs=32, memory_bytes=64 * MIB)
    try:
        lanes = [(700, 5 * i, 12 + 3 * i) for i in range(8)]
        history = _steady_load(cache, lanes, num_cycles=5)
        assert history[-1][1] == 0                            # the steady part released nothing
        t = history[-1][0]
        for s in range(1000, 1016):                           # the burst: 16 x 16 pages
            fill(cache, s, 4096, float(s))
        assert cache.release_idle(now=t) == 0
        peak = memfd_bytes(cache)
        assert peak >= 16 * 16 * PAGE
        for s in range(1000, 1016):
            cache.free(s)
        assert cache.release_idle(now=t + 1.0) == 0           # the burst's peak is in the window
        assert cache.release_idle(now=t + 5.0) == 0
        assert cache.release_idle(now=t + 5.5) > 0            # ... and left it: all but the reserve
        assert cache.pool.num_created == 2 and cache.mapper.num_idle_pages() == 2
        assert memfd_bytes(cache) <= 2 * PAGE < peak
        assert cache.release_idle(now=t + 60.0) == 0          # and it stays there
        cache.check_integrity()
    finally:
        cache.close()


# ------------------------------------------------------------------ the engine
def test_engine_passes_the_waiting_queue_and_releases_nothing_while_requests_wait(tiny, clock):
    """Two seats, eight requests: while requests wait in the scheduler's queue the engine's
    ``release_idle`` calls pass ``num_waiting > 0`` and release nothing, though the fake clock jumps
    a grace period every step; once the queue is empty the idle steps fall to the reserve."""
    from engine_helpers import hf_greedy, random_prompts
    from engine_helpers import greedy, run_all

    engine = make_engine(tiny, "vmem", kv_shrink_grace_s=5.0, kv_reserve_bytes=4 * KIB, max_num_seqs=2)
    kv = engine.kv_cache
    calls: list[tuple[int, int, int]] = []        # (num_waiting, bytes released, live sequences)
    real = kv.release_idle

    def spy(now=None, num_waiting=0):
        released = real(now, num_waiting)
        calls.append((num_waiting, released, len(kv.seqs)))
        clock["t"] += 6.0                         # past the grace period before every next call
        return released
    kv.release_idle = spy
    try:
        prompts = random_prompts(len(tiny["tokenizer"]), [90, 20, 70, 15, 60, 25, 80, 10], seed=24)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", None, greedy(3 + 2 * (i % 3)), prompt_token_ids=p)
        final = run_all(engine)
        for i, p in enumerate(prompts):
            assert final[f"r{i}"].outputs[0].token_ids == hf_greedy(tiny["hf"], p, 3 + 2 * (i % 3))
        waiting = [c for c in calls if c[0] > 0]
        assert len(waiting) >= 4
        assert all(released == 0 for _, released, _ in waiting)
        # only calls with an empty queue released anything
        assert sum(r for w, r, _ in calls if w == 0) == kv.backend_stats()["num_released_pages"] * \
            kv.page_size_bytes
        n = len(calls)
        engine.step()                             # idle, the queue empty: back to the reserve
        engine.step()
        assert any(released for _, released, _ in calls[n:])
        assert kv.backend_stats()["created_bytes"] <= 4 * KIB + kv.page_size_bytes
        kv.check_integrity()
    finally:
        engine.close()


def test_release_idle_refuses_a_clock_or_queue_length_out_of_range():
    """``release_idle(now=nan)`` or a negative / fractional ``num_waiting`` is the caller's error, named,
    and nothing is released."""
    cache = make_cache(grace_s=0.0, reserve=0)
    try:
        fill(cache, 0, 4096, 1.0)
        cache.free(0)
        created = cache.pool.num_created
        for kwargs, why in (({"now": float("nan")}, "now must be a finite"),
                            ({"now": 1.0, "num_waiting": -1}, "num_waiting"),
                            ({"now": 1.0, "num_waiting": 1.5}, "num_waiting")):
            with pytest.raises(ValueError, match=why):
                cache.release_idle(**kwargs)
        assert cache.pool.num_created == created
    finally:
        cache.close()
