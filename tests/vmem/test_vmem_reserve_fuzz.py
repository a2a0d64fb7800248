"""Seeded random fuzz of the vmem elastic reserve and shrink (elastic.py, ``release_idle``):
admissions with and without prefix hits, grows, frees, forks, overwrites, prefetch,
prefetch_admission and release_idle (sometimes with requests waiting) on an advancing fake clock,
with page creations failing for a while (another process holds the memory), both layouts, grace 0 and
> 0.  After every operation: every live sequence reads back what was written, the integrity check
passes, the pool stays within the cap, and every release is what a brute-force model of the shrink
window allows (high-water mark of the claimed pages over the grace period, hysteresis band, nothing
while requests wait), within the rate limit while sequences are live.  At quiet points: once the
grace period has passed with nothing changing, no more than the band over the claimed pages plus the
reserve stays created (the reserve plain free while sequences are live; only the reserve when none
is), and a further call neither creates nor releases a page.

Clocks are injected, never slept on; nothing is timed.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvcache_cases import SPEC, one_torch_thread
from vmem_helpers import ShrinkModel, checked_drivers, prompt_values  # noqa: F401 - checked_drivers: autouse
from vmkv import KVCacheFullError, create_kv_cache
from vmkv.vmem import elastic as vmem_elastic
from vmkv.vmem.driver import VMMError

PAGE = 16 << 10
MML = 512
H, D = SPEC.num_kv_heads, SPEC.head_dim


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


class _Oom:
    """Page creations fail with ENOMEM while ``on``."""

    def __init__(self, cache) -> None:
        inner = getattr(cache.driver, "inner", cache.driver)
        real = inner._create_page
        self.on = False

        def create(*args):
            if self.on:
                raise VMMError(inner.calls["create_page"], "ENOMEM (Cannot allocate memory)", "injected")
            return real(*args)
        inner._create_page = create


def _run(seed: int, layout: str, grace: float, steps: int) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    reserve = rng.choice([0, 1, 3, 6])
    cap_pages = rng.choice([20, 40, 80])
    cache = create_kv_cache("vmem", SPEC, max_num_seqs=6, max_model_len=MML, memory_bytes=cap_pages * PAGE,
                            driver="host", page_size_bytes=PAGE, layout=layout,
                            kv_reserve_bytes=reserve * PAGE, kv_shrink_grace_s=grace,
                            lookahead_tokens=rng.choice([0, 0, 37]))
    m = cache.mapper
    oom = _Oom(cache)
    model = ShrinkModel(reserve, grace, vmem_elastic.SHRINK_BAND)
    prompts = [[rng.randrange(3) for _ in range(MML)] for _ in range(3)]
    shadow: dict[int, list[torch.Tensor]] = {}    # seq -> [K per layer] (V = -K)
    plen: dict[int, int] = {}                     # prompt positions of the seq (never overwritten)
    next_id = 0
    t = 0.0
    counts = dict.fromkeys(["alloc", "hit", "full", "grow", "free", "fork", "overwrite", "prefetch",
                            "prefetch_admission", "release", "released", "waiting", "quiet"], 0)
    planned: list[tuple[int, list | None]] = []

    def write(seq: int, start: int, k_layers: list[torch.Tensor]) -> None:
        for layer, k in enumerate(k_layers):
            cache.write(seq, layer, start, k, -k)
            old = shadow[seq][layer]
            shadow[seq][layer] = torch.cat([old[:start], k, old[start + len(k):]])

    def admit(n: int, ids) -> None:
        nonlocal next_id
        seq = next_id
        try:
            hit = cache.allocate(seq, n, token_ids=ids)
        except KVCacheFullError:
            counts["full"] += 1
            return
        next_id += 1
        counts["alloc"] += 1
        counts["hit"] += hit > 0
        if ids is not None:
            full = [prompt_values(SPEC, ids, layer) for layer in range(SPEC.num_layers)]
            shadow[seq] = [f[:hit] for f in full]
            for layer in range(SPEC.num_layers):          # the hit positions hold that prefix's K/V
                k, v = cache.gather(seq, layer)
                assert torch.equal(k[:hit], full[layer][:hit]) and torch.equal(v[:hit], -full[layer][:hit])
            if hit < n:
                write(seq, hit, [f[hit:] for f in full])
            plen[seq] = n
        else:
            shadow[seq] = [torch.zeros(0, H, D)] * SPEC.num_layers
            write(seq, 0, [torch.randn(n, H, D, generator=gen) for _ in range(SPEC.num_layers)])
            plen[seq] = 0

    released_live = [0]         # pages released while sequences were live (bounds the learned pages)

    def release(now: float, num_waiting: int = 0) -> int:
        created0, released0 = m.pool.num_created, m.num_released_pages
        topped0 = cache.elastic.num_topped_up_pages
        live = len(cache.seqs)
        # the window's view (after the call's top-up) and answer, taken here by wrapping observe
        window = cache.elastic.window
        seen = {}
        real_observe = window.observe

        def observe(now_, created, claimed, waiting=0, extra=0):
            seen.update(created=created, claimed=claimed, waiting=waiting, extra=extra)
            seen["num"] = real_observe(now_, created, claimed, waiting, extra)
            return seen["num"]
        window.observe = observe
        try:
            got = cache.release_idle(now=now, num_waiting=num_waiting) // PAGE
        finally:
            del window.observe
        topped = cache.elastic.num_topped_up_pages - topped0
        assert (seen["created"], seen["claimed"], seen["waiting"]) == (
            created0 + topped, m.num_allocated_pages(), num_waiting)
        # learned pages: at most what was released while sequences were live (ElasticPolicy)
        assert 0 <= seen["extra"] <= released_live[0]
        allowed = model.allowed(now, seen["created"], seen["claimed"], num_waiting, seen["extra"])
        assert seen["num"] == allowed, (now, seen, allowed)
        if live:
            allowed = min(allowed, vmem_elastic.RELEASE_PAGES_PER_CALL)
        # idle pages are never short of the allowance (no fence pending on the host driver, no copy
        # planned between operations): exactly what the window allows goes
        assert got == allowed, (now, got, allowed, seen)
        if num_waiting:
            assert got == 0
        assert m.num_released_pages - released0 == got
        assert m.pool.num_created == created0 + topped - got
        counts["release"] += 1
        counts["released"] += got
        if live:
            released_live[0] += got
        return got

    def quiet() -> None:
        """Nothing changes for longer than the grace period: what is held comes down to the reserve
        plus the hysteresis band over what live sequences claim."""
        nonlocal t
        oom.on = False
        for _ in range(2 + (cap_pages // vmem_elastic.RELEASE_PAGES_PER_CALL + 1) * 2):
            t += max(grace, 0.0) + 1.0
            release(t)
        idle, free, created = m.num_idle_pages(), m.pool.num_free, m.pool.num_created
        claimed, band = m.num_allocated_pages(), vmem_elastic.SHRINK_BAND
        at_cap = created == m.pool.max_pages
        if len(cache.seqs):     # the reserve as plain free pages, idle pages within the band kept
            assert free >= reserve or at_cap, (idle, free, created, reserve)
            learned = cache.elastic.learned_pages
            assert created <= max(claimed * (1 + band), math.ceil(claimed * (1 + band / 2))) + reserve \
                + learned, (idle, free, created, claimed, reserve, learned)
        else:
            assert claimed == 0 and (idle == reserve or (at_cap and idle <= reserve)), \
                (idle, free, created, reserve)
        # and it stays there: no creation, no release
        t += max(grace, 0.0) + 1.0
        assert release(t) == 0
        assert m.pool.num_created == created and m.num_idle_pages() == idle
        counts["quiet"] += 1

    try:
        for _ in range(steps):
            op = rng.choices(["alloc", "grow", "free", "fork", "overwrite", "prefetch", "prefetch_admission",
                              "release", "oom", "quiet"], [6, 6, 4, 2, 2, 2, 2, 5, 1, 0.5])[0]
            if TRACE:
                print(op, sorted(shadow), {s: cache.seq_len(s) for s in shadow})
            if op == "alloc" and len(cache.seqs) < cache.max_num_seqs:
                if planned and rng.random() < 0.7:
                    n, ids = planned.pop(0)
                else:
                    n = rng.randint(1, MML)
                    ids = prompts[rng.randrange(3)][:n] if rng.random() < 0.6 else None
                admit(n, ids)
            elif op == "grow" and shadow:
                seq = rng.choice(sorted(shadow))
                old = cache.seq_len(seq)
                n = rng.randint(1, 200)
                if old + n <= MML:
                    try:
                        cache.extend(seq, n)
                    except KVCacheFullError as e:
                        if TRACE:
                            print("  grow", seq, old, n, "full:", e, "oom", oom.on)
                        counts["full"] += 1
                        assert cache.seq_len(seq) == old
                    else:
                        if TRACE:
                            print("  grow", seq, old, n, "ok oom", oom.on)
                        counts["grow"] += 1
                        write(seq, old, [torch.randn(n, H, D, generator=gen) for _ in range(SPEC.num_layers)])
            elif op == "free" and shadow:
                seq = rng.choice(sorted(shadow))
                cache.free(seq)
                del shadow[seq], plen[seq]
                counts["free"] += 1
            elif op == "fork" and shadow and len(cache.seqs) < cache.max_num_seqs:
                parent = rng.choice(sorted(shadow))
                try:
                    cache.fork(parent, next_id)
                except KVCacheFullError:
                    counts["full"] += 1
                else:
                    shadow[next_id] = list(shadow[parent])
                    plen[next_id] = plen[parent]
                    next_id += 1
                    counts["fork"] += 1
            elif op == "overwrite" and shadow:
                seq = rng.choice(sorted(shadow))
                n_all = cache.seq_len(seq)
                if n_all > plen[seq]:
                    start = rng.randrange(plen[seq], n_all)
                    n = rng.randint(1, n_all - start)
                    try:
                        write(seq, start, [torch.randn(n, H, D, generator=gen) for _ in range(SPEC.num_layers)])
                    except KVCacheFullError:           # copy-on-write short of pages
                        counts["full"] += 1
                    else:
                        counts["overwrite"] += 1
            elif op == "prefetch" and shadow:
                cache.prefetch(sorted(shadow), rng.randint(1, 300))
                counts["prefetch"] += 1
            elif op == "prefetch_admission":
                planned = []
                for _ in range(rng.randint(1, 3)):
                    n = rng.randint(1, MML)
                    planned.append((n, prompts[rng.randrange(3)][:n] if rng.random() < 0.6 else None))
                ids = [p[1] for p in planned]
                cache.prefetch_admission([p[0] for p in planned], ids if any(i is not None for i in ids) else None)
                counts["prefetch_admission"] += 1
            elif op == "release":
                t += rng.choice([0.0, 0.3, 1.0, grace, grace + 0.5, 7.0])
                waiting = rng.choice([1, 3]) if rng.random() < 0.2 else 0
                counts["waiting"] += waiting > 0
                release(t, waiting)
            elif op == "oom":
                oom.on = not oom.on
            elif op == "quiet":
                quiet()
            assert m.pool.num_created <= m.pool.max_pages
            cache.check_integrity()
            for seq, ks in shadow.items():
                for layer in range(SPEC.num_layers):
                    k, v = cache.gather(seq, layer)
                    assert torch.equal(k, ks[layer]) and torch.equal(v, -ks[layer]), (seq, layer)
        for seq in sorted(shadow):
            cache.free(seq)
        shadow.clear()
        quiet()
        cache.check_integrity()
    finally:
        cache.close()
    return counts


TRACE = bool(__import__("os").environ.get("VMKV_FUZZ_TRACE"))
SEEDS = range(int(__import__("os").environ.get("VMKV_FUZZ_SEEDS", "6")))


@pytest.mark.parametrize("grace", [0.0, 2.0])
@pytest.mark.parametrize("layout", ["megacache", "per_layer"])
@pytest.mark.parametrize("seed", SEEDS)
def test_reserve_fuzz(seed, layout, grace):
    counts = _run(seed, layout, grace, steps=int(__import__("os").environ.get("VMKV_FUZZ_STEPS", "150")))
    assert counts["alloc"] and counts["release"] and counts["released"]
