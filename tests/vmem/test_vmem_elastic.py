"""Elastic vmem memory (issue 12, items 1-3; issue 24's shrink policy, elastic.py): idle pages beyond
the reserve and the high-water mark of the claimed pages over the grace period (with its hysteresis
band) are released to the device or the OS (``KVCache.release_idle``), growth re-creates them on
demand, and nothing a live sequence claims, a pending fence guards or a prefix entry names is ever
broken.  The shrink policy's own tests: test_vmem_shrink_policy.py.

Clocks are injected (``release_idle(now=...)``), never slept on.  The GPU twin at the end checks that
``torch.cuda.mem_get_info``'s free memory rises after a shrink on the CUDA driver.
"""

from __future__ import annotations

import math
import os
import types

import pytest
import torch

from kvcache_cases import SPEC, one_torch_thread
from engine_helpers import make_engine, one_thread, tiny  # noqa: F401 (fixtures)
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: caches get CheckedDriver
from vmkv import StepSeq
from vmkv.kvcache.registry import create_kv_cache
from vmkv.kvcache.spec import KVCacheSpec
from vmkv.vmem import cache as vmem_cache
from vmkv.vmem import elastic as vmem_elastic
from vmkv.vmem.elastic import SHRINK_BAND, ShrinkWindow

KIB, MIB = 1 << 10, 1 << 20
PAGE = 64 * KIB                       # 256 tokens of SPEC per megacache page
TOKEN_BYTES = SPEC.kv_bytes(1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def make_cache(*, grace_s: float = 5.0, reserve: int = 2 * PAGE, max_num_seqs: int = 32,
               max_model_len: int = 4096, memory_bytes: int = 40 * MIB, **kw):
    return create_kv_cache("vmem", SPEC, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           memory_bytes=memory_bytes, driver="host", page_size_bytes=PAGE,
                           kv_reserve_bytes=reserve, kv_shrink_grace_s=grace_s, **kw)


def fill(cache, seq_id: int, n: int, value: float, token_ids=None) -> None:
    """Allocate ``n`` positions of ``seq_id`` and write ``value`` + position into every layer."""
    cache.allocate(seq_id, n, token_ids=token_ids)
    for layer in range(SPEC.num_layers):
        k = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, SPEC.num_kv_heads, SPEC.head_dim)
        cache.write(seq_id, layer, 0, k + value, -(k + value))


def assert_filled(cache, seq_id: int, n: int, value: float) -> None:
    for layer in range(SPEC.num_layers):
        k, v = cache.gather(seq_id, layer)
        want = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, SPEC.num_kv_heads, SPEC.head_dim)
        assert torch.equal(k, want + value) and torch.equal(v, -(want + value))


def idle_bytes(cache) -> int:
    return cache.mapper.num_idle_pages() * cache.page_size_bytes


def memfd_bytes(cache) -> int:
    drv = getattr(cache.driver, "inner", cache.driver)
    return os.fstat(drv._fd).st_blocks * 512


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ the policy (torch-free)
def test_shrink_window_releases_beyond_the_high_water_mark_after_the_grace_period():
    """The essentials (the unit tests are in test_vmem_shrink_policy.py): nothing before the grace
    period, then what lies beyond ``ceil(hwm * (1 + band / 2)) + reserve``, and only once the created
    pages exceed ``hwm * (1 + band) + reserve``."""
    w = ShrinkWindow(reserve_pages=2, grace_s=5.0)
    assert w.observe(0.0, 10, 0) == 0             # grace not over
    assert w.observe(4.9, 10, 0) == 0
    assert w.observe(5.0, 10, 0) == 8             # idle for 5 s, nothing claimed: all but the reserve
    w = ShrinkWindow(reserve_pages=2, grace_s=5.0)
    assert w.observe(0.0, 50, 40) == 0
    assert w.observe(5.0, 50, 20) == 0            # 40 claimed at t=0 is in the window: 50 <= 40*1.25+2
    assert w.observe(10.1, 50, 20) == 50 - 23 - 2  # 20 is the high-water mark now: ceil(20*1.125)=23
    assert ShrinkWindow(0, 0.0).observe(0.0, 3, 0) == 3      # grace 0: at once
    for never in (-1.0, float("inf")):
        assert ShrinkWindow(0, never).observe(1e9, 100, 0) == 0


# ------------------------------------------------------------------ host driver
def test_host_shrink_returns_memory_to_the_os_after_the_grace_period():
    cache = make_cache(grace_s=5.0)
    try:
        for s in range(32):                      # a burst: 32 x 4096 tokens = 512 pages, 32 MiB
            fill(cache, s, 4096, float(s))
        held, rss_held = memfd_bytes(cache), rss_bytes()
        assert held >= 32 * MIB
        for s in range(32):
            cache.free(s)
        assert cache.release_idle(now=100.0) == 0          # the burst just ended
        assert cache.release_idle(now=104.9) == 0          # grace respected
        assert memfd_bytes(cache) == held
        released = cache.release_idle(now=105.0)
        assert released == 32 * MIB - 2 * PAGE             # all but the reserve
        assert idle_bytes(cache) <= 2 * PAGE                # reserve respected
        assert memfd_bytes(cache) <= 2 * PAGE               # the memfd's blocks are punched out
        assert rss_held - rss_bytes() >= released // 2      # and the process's resident memory falls
        stats = cache.backend_stats()
        assert stats["num_released_pages"] == released // PAGE
        assert stats["created_bytes"] == stats["num_pages_created"] * PAGE == 2 * PAGE
        cache.check_integrity()
        # growth re-creates pages on demand, up to the cap, and the data is correct
        for s in range(100, 120):
            fill(cache, s, 4096, float(s))
        for s in range(100, 120):
            assert_filled(cache, s, 4096, float(s))
        assert memfd_bytes(cache) >= 20 * 4096 * TOKEN_BYTES
        cache.check_integrity()
    finally:
        cache.close()


def test_shrink_never_touches_what_live_sequences_claim_and_cycles_stay_correct():
    """Grace 0, reserve 0: while sequences are live only the pages beyond ``ceil(hwm * (1 + band / 2))``
    go (hwm: the pages claimed now), once the created pages exceed ``hwm * (1 + band)``; when none is
    live every idle page goes at once."""
    cache = make_cache(grace_s=0.0, reserve=0, max_model_len=2048)
    try:
        live: dict[int, tuple[int, float]] = {}          # seq -> (positions written, value)
        t, num_released = 0.0, 0
        for cycle in range(4):
            for s in range(cycle * 10, cycle * 10 + 8):       # grow
                n = 300 + 97 * (s % 7)
                fill(cache, s, n, float(s))
                live[s] = (n, float(s))
            for s in sorted(live)[::2]:                      # half of them end
                cache.free(s)
                del live[s]
            for s in sorted(live)[:2]:                       # some keep growing
                cache.extend(s, 256)
            claimed = cache.mapper.num_allocated_pages()
            while True:                                      # rate limited: until nothing more goes
                t += 1.0
                created = cache.pool.num_created
                released = cache.release_idle(now=t) // PAGE
                if not released:
                    break
                num_released += released
                assert released <= vmem_elastic.RELEASE_PAGES_PER_CALL
                learned = cache.elastic.learned_pages        # released while live, created again
                assert cache.pool.num_created >= math.ceil(claimed * (1 + SHRINK_BAND / 2)) + learned
                assert created > claimed * (1 + SHRINK_BAND) + learned   # hysteresis: only beyond the band
            assert cache.mapper.num_allocated_pages() == claimed
            assert cache.pool.num_created <= claimed * (1 + SHRINK_BAND) + cache.elastic.learned_pages
            assert cache.usage().allocated_bytes == claimed * PAGE
            cache.check_integrity()
            for s, (n, value) in live.items():
                assert_filled_prefix(cache, s, n, value)
        assert num_released > 0
        for s in list(live):
            cache.free(s)
        assert cache.release_idle(now=t + 1.0) > 0           # none live: every idle page at once
        assert cache.mapper.num_idle_pages() == 0 == cache.backend_stats()["created_bytes"]
        cache.check_integrity()
    finally:
        cache.close()


def assert_filled_prefix(cache, seq_id: int, n: int, value: float) -> None:
    for layer in range(SPEC.num_layers):
        k, v = cache.gather(seq_id, layer)
        want = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, SPEC.num_kv_heads, SPEC.head_dim)
        assert torch.equal(k[:n], want + value) and torch.equal(v[:n], -(want + value))


def test_grace_period_memory_used_within_the_window_is_kept():
    """What live sequences claimed within the last ``grace_s`` seconds (the high-water mark), plus
    half the band, stays; the rest goes once the grace period is over."""
    cache = make_cache(grace_s=5.0, reserve=0)
    try:
        for s in range(8):                       # 8 x 4 pages
            fill(cache, s, 1024, float(s))
        for s in range(8):
            cache.free(s)
        assert cache.release_idle(now=0.0) == 0
        for s in range(8, 12):                   # a new burst 3 s later reuses 16 kept pages
            fill(cache, s, 1024, float(s))
        assert cache.release_idle(now=3.0) == 0
        assert cache.release_idle(now=4.9) == 0
        # the high-water mark is the 16 claimed pages: 32 > 16 * 1.25, ceil(16 * 1.125) = 18 stay
        assert cache.release_idle(now=5.0) == (32 - 18) * PAGE
        assert cache.backend_stats()["num_pages_created"] == 18
        assert cache.release_idle(now=6.0) == 0              # 16 claimed, last seen at 6 s
        for s in range(8, 12):
            assert_filled(cache, s, 1024, float(s))
            cache.free(s)
        assert cache.release_idle(now=6.0) == 0              # idle only since t=6
        assert cache.release_idle(now=10.9) == 0
        assert cache.release_idle(now=11.0) == 0             # 6 s is still in the window [6, 11]
        assert cache.release_idle(now=11.1) == 18 * PAGE     # ... and now out of it
        assert cache.backend_stats()["num_pages_created"] == 0
        cache.check_integrity()
    finally:
        cache.close()


def test_a_released_prefix_page_is_a_miss_never_a_stale_read():
    cache = make_cache(grace_s=0.0, reserve=0, max_model_len=1024)
    try:
        prompt = list(range(600))                        # two full pages of prefix
        fill(cache, 1, 600, 5.0, token_ids=prompt)
        cache.prepare([StepSeq(1, 0, 600)])              # written: its units are cached
        cache.free(1)
        assert cache.allocate(2, 600, token_ids=prompt) == 512      # a hit while the pages exist
        cache.free(2)
        assert cache.release_idle(now=1.0) > 0
        assert len(cache.prefix) == 0
        assert cache.allocate(3, 600, token_ids=prompt) == 0        # released: a miss
        cache.check_integrity()
    finally:
        cache.close()


def test_a_page_whose_fence_is_pending_is_not_released(monkeypatch):
    cache = make_cache(grace_s=0.0, reserve=0)
    done = {"fence": False}
    monkeypatch.setattr(cache.driver, "record_fence", lambda: object())
    monkeypatch.setattr(cache.driver, "fence_done", lambda fence: done["fence"])
    try:
        fill(cache, 1, 1024, 1.0)                        # 4 pages, kept after free behind a fence
        cache.free(1)
        assert cache.release_idle(now=1.0) == 0          # kernels may still read them: kept
        assert cache.mapper.num_idle_pages() == 4
        done["fence"] = True
        assert cache.release_idle(now=2.0) == 4 * PAGE
        cache.check_integrity()
    finally:
        cache.close()


def test_preallocated_pool_and_paged_never_release():
    cache = make_cache(grace_s=0.0, reserve=0, memory_bytes=4 * MIB, preallocate=True)
    try:
        assert cache.release_idle(now=1e6) == 0
        assert cache.backend_stats()["num_pages_created"] == 64
    finally:
        cache.close()
    paged = create_kv_cache("paged", SPEC, max_num_seqs=4, max_model_len=64, memory_bytes=SPEC.kv_bytes(256))
    try:
        assert paged.release_idle() == 0
    finally:
        paged.close()


def _no_page_creation(cache, monkeypatch) -> dict:
    """Make page creation fail with ENOMEM (memory held by another process); returns a call counter."""
    from vmkv.vmem.driver import VMMError
    inner = getattr(cache.driver, "inner", cache.driver)
    calls = {"n": 0}

    def no_memory():
        calls["n"] += 1
        raise VMMError(inner.calls["create_page"], "ENOMEM (Cannot allocate memory)", "injected")
    monkeypatch.setattr(inner, "_create_page", no_memory)     # the OS call under CheckedDriver
    return calls


def test_out_of_memory_on_page_creation_reuses_idle_pages(monkeypatch):
    """Creating a page fails (outside pressure) while freed slots keep idle pages: the allocation
    reuses them, kept pages without a prefix entry first, then cached ones least recently used
    (their entries dropped: a later lookup is a miss), instead of failing."""
    cache = make_cache(grace_s=float("inf"), reserve=0, max_model_len=2048)
    p1, p2 = list(range(600)), list(range(1000, 1600))      # two full cached pages each
    try:
        fill(cache, 1, 1024, 1.0)                            # 4 pages, no prefix entry
        fill(cache, 2, 600, 2.0, token_ids=p1)               # 3 pages, 2 cached
        fill(cache, 3, 600, 3.0, token_ids=p2)
        cache.prepare([StepSeq(2, 0, 600), StepSeq(3, 0, 600)])
        for s in (1, 2, 3):                                  # p1 is used less recently than p2
            cache.free(s)
        assert len(cache.prefix) == 4 and cache.mapper.num_idle_pages() == 10
        created = cache.backend_stats()["num_pages_created"]
        calls = _no_page_creation(cache, monkeypatch)
        fill(cache, 4, 2048, 4.0)                            # 8 pages, none can be created
        assert calls["n"] > 0 and cache.backend_stats()["num_pages_created"] == created
        assert cache.mapper.num_reused_on_oom > 0 and cache.backend_stats()["num_reused_on_oom"] > 0
        assert_filled(cache, 4, 2048, 4.0)
        cache.check_integrity()
        assert len(cache.prefix) == 2                        # p1's entries evicted, p2's kept
        cache.free(4)
        monkeypatch.undo()
        assert cache.allocate(5, 600, token_ids=p2) == 512   # still a hit
        assert cache.allocate(6, 600, token_ids=p1) == 0     # reused: a miss, never a stale read
        assert_filled_prefix(cache, 5, 512, 3.0)
        cache.check_integrity()
    finally:
        cache.close()


def test_out_of_memory_reuse_skips_pages_whose_fence_is_pending(monkeypatch):
    from vmkv import KVCacheFullError
    cache = make_cache(grace_s=float("inf"), reserve=0)
    done = {"fence": False}
    monkeypatch.setattr(cache.driver, "record_fence", lambda: object())
    monkeypatch.setattr(cache.driver, "fence_done", lambda fence: done["fence"])
    try:
        fill(cache, 1, 1024, 1.0)                            # 2 slots x 4 pages kept behind
        fill(cache, 2, 1024, 2.0)                            # pending fences
        cache.free(1)
        cache.free(2)
        _no_page_creation(cache, monkeypatch)
        before = (cache.usage(), cache.mapper.num_idle_pages(), cache.driver.num_mappings)
        with pytest.raises(KVCacheFullError) as err:         # one slot's 4 in place, the other's
            cache.allocate(3, 2048)                          # kernels may still read: untouched
        assert err.value.transient
        assert (cache.usage(), cache.mapper.num_idle_pages(), cache.driver.num_mappings) == before
        cache.check_integrity()
        done["fence"] = True
        fill(cache, 3, 2048, 3.0)                            # fences done: reused
        assert_filled(cache, 3, 2048, 3.0)
        assert cache.mapper.num_reused_on_oom > 0
        cache.check_integrity()
    finally:
        cache.close()


# ------------------------------------------------------------------ the engine
@pytest.fixture
def clock(monkeypatch):
    """``release_idle``'s clock, moved by hand."""
    now = {"t": 1000.0}
    fake = types.SimpleNamespace(monotonic=lambda: now["t"], perf_counter_ns=vmem_cache.time.perf_counter_ns)
    monkeypatch.setattr(vmem_cache, "time", fake)
    return now


def _engine(tiny, **knobs):

    return make_engine(tiny, "vmem", **{"kv_shrink_grace_s": 5.0, "kv_reserve_bytes": 4 * KIB, **knobs})


def test_engine_burst_then_idle_steps_fall_to_the_reserve(tiny, clock):
    from engine_helpers import hf_greedy, random_prompts
    from engine_helpers import greedy, run_all

    engine = _engine(tiny)
    kv = engine.kv_cache
    try:
        prompts = random_prompts(len(tiny["tokenizer"]), [40, 70, 25, 90, 33, 60], seed=12)
        for burst in range(2):
            for i, p in enumerate(prompts):
                engine.add_request(f"b{burst}-{i}", None, greedy(6), prompt_token_ids=p)
            final = run_all(engine)
            peak = kv.backend_stats()["created_bytes"]
            assert peak > 8 * kv.page_size_bytes
            for i, p in enumerate(prompts):
                assert final[f"b{burst}-{i}"].outputs[0].token_ids == hf_greedy(tiny["hf"], p, 6)
            engine.step()                                 # idle, within the grace: nothing goes
            assert kv.backend_stats()["created_bytes"] == peak
            clock["t"] += 5.5
            engine.step()                                 # idle past the grace period
            u = kv.usage()
            held = kv.backend_stats()["created_bytes"]
            assert held - u.allocated_bytes <= 4 * KIB + kv.page_size_bytes
            kv.check_integrity()
    finally:
        engine.close()


def test_engine_recovers_when_page_creation_fails_for_a_while_after_a_shrink(tiny, clock, monkeypatch):
    from engine_helpers import hf_greedy, random_prompts
    from engine_helpers import greedy, run_all
    from vmkv.vmem.driver import VMMError

    engine = _engine(tiny, kv_shrink_grace_s=0.0)
    kv = engine.kv_cache
    try:
        prompts = random_prompts(len(tiny["tokenizer"]), [50, 80, 30, 64], seed=13)
        for i, p in enumerate(prompts):
            engine.add_request(f"a{i}", None, greedy(4), prompt_token_ids=p)
        run_all(engine)
        clock["t"] += 1.0           # grace 0: the burst's last step, at the same instant, is in the window
        engine.step()
        assert kv.backend_stats()["num_released_pages"] > 0
        inner = getattr(kv.driver, "inner", kv.driver)
        real, calls = inner._create_page, {"n": 0}

        def flaky():                        # memory held elsewhere for the next 12 creations
            calls["n"] += 1
            if calls["n"] <= 12:
                raise VMMError(inner.calls["create_page"], "ENOMEM (Cannot allocate memory)", "injected")
            return real()

        monkeypatch.setattr(inner, "_create_page", flaky)
        for i, p in enumerate(prompts):
            engine.add_request(f"b{i}", None, greedy(4), prompt_token_ids=p)
        final = run_all(engine)
        assert calls["n"] > 12 and engine.scheduler.num_transient_full > 0
        for i, p in enumerate(prompts):
            assert final[f"b{i}"].error is None
            assert final[f"b{i}"].outputs[0].token_ids == hf_greedy(tiny["hf"], p, 4)
        kv.check_integrity()
    finally:
        engine.close()


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_cuda_shrink_returns_device_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")
    spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float16, device="cuda")
    page = 2 * MIB
    cache = create_kv_cache("vmem", spec, max_num_seqs=16, max_model_len=8192, memory_bytes=1024 * MIB,
                            driver="cuda", kv_reserve_bytes=2 * page, kv_shrink_grace_s=5.0)
    try:
        for s in range(16):
            cache.allocate(s, 8192)
            for layer in range(spec.num_layers):
                kv = torch.randn(8192, 8, 128, device="cuda", dtype=torch.float16)
                cache.write(s, layer, 0, kv, kv)
        torch.cuda.synchronize()
        for s in range(16):
            cache.free(s)
        free_before = torch.cuda.mem_get_info()[0]
        assert cache.release_idle(now=0.0) == 0 and cache.release_idle(now=4.0) == 0
        released = cache.release_idle(now=5.0)
        held = cache.backend_stats()["created_bytes"]
        assert released >= 500 * MIB and held <= 2 * page
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] - free_before >= released - 64 * MIB
        for s in range(4):                                  # growth re-creates pages
            cache.allocate(100 + s, 4096)
        cache.check_integrity()
    finally:
        cache.close()
