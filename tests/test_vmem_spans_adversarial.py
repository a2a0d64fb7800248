"""Adversarial tests of vmem spans (vmkv.vmem.page_pool, "Spans"; max_span_bytes): minimized
regressions of failures found by fuzzing, and a seeded random fuzz of the combinations most likely
to break them: prefix hits (also under injected hash collisions), fork and copy-on-write (write()
and prepare()/write_kv into shared units), look-ahead, prefetch and prefetch_admission with hits,
page creations failing for want of memory (all, only single pages, only spans, at random), the
cap, both layouts, preallocate, and release_idle interleaved.

Invariants after every operation: every live sequence reads back what was written (prefix-hit
positions hold the cached prefix's K/V), ``check_integrity()`` passes, the pool stays within the
cap; a refused operation (KVCacheFullError) leaves usage, lengths and data unchanged; nothing but
KVCacheFullError escapes; with nothing live, ``release_idle`` at grace 0 brings what is held down
to the reserve.  VMKV_SPAN_FUZZ_SEEDS / VMKV_SPAN_FUZZ_STEPS scale the fuzz.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvcache_cases import SPEC, one_torch_thread
from vmem_helpers import checked_drivers, prompt_values  # noqa: F401 - checked_drivers: autouse
from vmkv import KVCacheFullError, StepSeq, create_kv_cache
from vmkv.kvcache import hashing as hashing_mod
from vmkv.vmem.protocol import VMMError

PAGE = 4096           # SPEC: 256 B per token, 16 tokens per megacache page, 64 per per_layer page
UT = 16
H, D = SPEC.num_kv_heads, SPEC.head_dim


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def _cache(span_pages=8, cap_pages=64, max_num_seqs=4, max_model_len=32 * UT, **kw):
    kw.setdefault("kv_shrink_grace_s", 0)
    kw.setdefault("kv_reserve_bytes", 0)
    return create_kv_cache("vmem", SPEC, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           memory_bytes=cap_pages * PAGE, driver="host", page_size_bytes=PAGE,
                           max_span_bytes=span_pages * PAGE, **kw)


class _Oom:
    """Page creations fail with ENOMEM: ``mode`` None (never), "all", "single" (one-page creations
    only), "span" (span creations only) or a float (each creation with that probability)."""

    def __init__(self, cache, rng: random.Random | None = None) -> None:
        inner = getattr(cache.driver, "inner", cache.driver)
        real = inner._create_page
        self.mode = None
        self.rng = rng or random.Random(0)

        def create(num_pages=1):
            m = self.mode
            fail = (m == "all" or (m == "single" and num_pages == 1) or (m == "span" and num_pages > 1)
                    or (isinstance(m, float) and self.rng.random() < m))
            if fail:
                raise VMMError(inner.calls["create_page"], "ENOMEM (Cannot allocate memory)", "injected")
            return real(num_pages)
        inner._create_page = create


# ------------------------------------------------------------------------ minimized regressions
def test_failed_fill_gives_a_span_back_once():
    """A span created for a run of holes, then a single page's creation out of memory: the span
    goes back whole (it used to be released at its first page, then its second page 'given back'
    raised ValueError, leaving the pages after it acquired)."""
    c = _cache(span_pages=3)
    try:
        oom = _Oom(c)
        oom.mode = "single"
        before = c.usage()
        with pytest.raises(KVCacheFullError) as e:
            c.allocate(1, 4 * UT)                     # a span of 3, then one page: out of memory
        assert e.value.transient
        c.check_integrity()
        assert c.usage() == before and not c.has_seq(1)
        assert c.pool.num_in_use == 0
        oom.mode = None
        c.allocate(1, 4 * UT)
        c.check_integrity()
    finally:
        c.close()


def test_give_back_many_releases_each_span_once():
    """PagePool.give_back_many with a span's pages in mapping order, then a single page."""
    from vmkv.vmem.checked_driver import CheckedDriver
    from vmkv.vmem.host_driver import HostDriver
    from vmkv.vmem.page_pool import PagePool
    d = CheckedDriver(HostDriver("cpu", PAGE))
    try:
        pool = PagePool(d, 8)
        pages = pool.create_span(3) + [pool.acquire()] + pool.create_span(2)
        pool.give_back_many(pages)
        assert pool.num_in_use == 0 and not pool.span_of and pool.num_created == 1 and d.num_pages == 1
        pool.check_integrity()
        pool.close()
    finally:
        d.close()


def test_grow_ahead_never_refuses_a_grow_that_fits():
    """A sequence of >= 8 units (ready_span_pages) claims 8 units ahead on a grow only where that
    fits: it used to check the units ahead against the plain pool but not the units the grow
    needs, and then refused a grow that fit ('needed 96 tokens, 96 available')."""
    c = _cache(span_pages=16, cap_pages=14)
    try:
        assert c.pool.ready_span_pages == 8
        c.allocate(1, 8 * UT)
        c.allocate(2, 4 * UT)
        c.free(2)                                     # 4 kept pages + 2 never created
        assert c.mapper.available_pages() == 6
        c.extend(1, 6 * UT)                           # 6 pages obtainable: fits
        assert c.seqs.get(1).units.claimed == 14
        c.check_integrity()
    finally:
        c.close()


def test_lookahead_onto_a_kept_span_with_holes_per_layer():
    """per_layer: a kept span in one reservation whose units have holes in the others (their spans
    were released).  The look-ahead's claim reaches into that span, so _claim_plan claims on to its
    end, and the holes there need fresh pages the look-ahead's budget had not counted: the fill
    raised PagePoolExhaustedError('plan/execute mismatch') out of allocate, leaving the slot
    occupied by a sequence the cache did not know (integrity broken)."""
    u = 64                                            # per_layer: 64 tokens a unit, 4 pages
    c = create_kv_cache("vmem", SPEC, max_num_seqs=4, max_model_len=16 * u, memory_bytes=46 * PAGE,
                        driver="host", page_size_bytes=PAGE, layout="per_layer", max_span_bytes=2 * PAGE,
                        kv_shrink_grace_s=0, kv_reserve_bytes=0)
    m = c.mapper
    try:
        c.allocate(1, u)
        c.extend(1, 8 * u)                            # units 1..8 of each reservation: spans of 2
        c.allocate(2, u)
        c.free(1)
        assert m.release_idle_pages(6) == 6           # the spans at units 7-8 of reservations 3, 2, 1
        s0 = m.slots[0]
        assert s0.units[8][0] is not None and s0.units[8][1:] == [None] * 3
        c.extend(2, (m.pool.num_plain_available - 4) // 4 * u)
        assert m.pool.num_plain_available == 4
        c.lookahead_tokens = u                        # (set here: the setup above without it)
        c.allocate(3, 7 * u)                          # into slot 0; the look-ahead wants unit 7
        assert c.slot_of(3) == 0 and c.has_seq(3)
        c.check_integrity()
        c.extend(3, u)                                # the grow itself still works (reclaims nothing:
        c.check_integrity()                           # the span and the holes fit in the pool)
    finally:
        c.close()


# a live slot's prefetch maps single pages (slot_ops.prefetch): once a span the grows reached into part
# of was released whole by the next grow, and the grows mapped page by page on the critical path
def test_prefetched_span_serves_the_grows_that_follow():
    c = _cache(span_pages=8, cap_pages=128, max_model_len=64 * UT)
    m = c.mapper
    try:
        c.allocate(1, 2 * UT)
        c.prefetch([1], 16 * UT)                      # units 2..17 mapped, unclaimed
        maps = m.num_maps
        for _ in range(4):
            c.extend(1, UT)
        c.check_integrity()
        assert m.num_released_span_pages == 0 and m.num_maps == maps   # no map call on the grows
    finally:
        c.close()


# ------------------------------------------------------------------------ the fuzz
def _usage_key(u, transient: bool):
    """What a refused operation must leave unchanged: all of usage() for a refusal by plan; after a
    creation out of memory (transient), the counters that reclaiming idle pages may move are left
    out (mapped, created, free tokens: the mapper reuses idle pages before it gives up)."""
    d = dict(u.__dict__) if hasattr(u, "__dict__") else u._asdict()
    if transient:
        for k in ("mapped_bytes", "created_bytes", "free_tokens", "prefix_query_tokens", "prefix_hit_tokens"):
            d.pop(k, None)
    return d


def _fuzz(seed: int, steps: int) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout = rng.choice(["megacache", "megacache", "per_layer"])
    unit = UT if layout == "megacache" else 64
    mml = rng.choice([16, 24, 32]) * UT
    ppu = 1 if layout == "megacache" else 2 * SPEC.num_layers
    slot_pages = -(-mml // unit) * ppu
    cap_pages = rng.choice([slot_pages // 2 + ppu, slot_pages, 2 * slot_pages, 3 * slot_pages])
    cap_pages = max(cap_pages, ppu)
    span_pages = rng.choice([2, 3, 5, 8, 16])
    reserve = rng.choice([0, 0, 2, 9])
    preallocate = rng.random() < 0.1
    lookahead = rng.choice([0, 0, 5, 37])
    max_num_seqs = rng.choice([3, 5])
    cache = create_kv_cache("vmem", SPEC, max_num_seqs=max_num_seqs, max_model_len=mml,
                            memory_bytes=cap_pages * PAGE, driver="host", page_size_bytes=PAGE, layout=layout,
                            kv_reserve_bytes=reserve * PAGE, kv_shrink_grace_s=0.0, lookahead_tokens=lookahead,
                            preallocate=preallocate, max_span_bytes=span_pages * PAGE)
    m = cache.mapper
    oom = _Oom(cache, random.Random(seed + 1))
    # few short alphabets: many shared prefixes; one prompt is another's prefix
    base = [rng.randrange(2) for _ in range(mml)]
    prompts = [base, base[:unit * 3] + [rng.randrange(2) for _ in range(mml)],
               [rng.randrange(3) for _ in range(mml)]]
    shadow: dict[int, list[tuple]] = {}           # seq -> [(K, V) per layer]
    next_id = 0
    t = 0.0
    counts: dict[str, int] = {}
    planned: list[tuple[int, list | None]] = []

    def bump(k: str) -> None:
        counts[k] = counts.get(k, 0) + 1

    def snap():
        return cache.usage(), {s: cache.seq_len(s) for s in shadow}

    def unchanged(before, transient: bool) -> None:
        u0, lens0 = before
        cache.check_integrity()
        assert _usage_key(cache.usage(), transient) == _usage_key(u0, transient), (cache.usage(), u0)
        assert {s: cache.seq_len(s) for s in shadow} == lens0
        check_data()

    def check_data() -> None:
        for seq, ks in shadow.items():
            for layer in range(SPEC.num_layers):
                k, v = cache.gather(seq, layer)
                assert torch.equal(k, ks[layer][0]) and torch.equal(v, ks[layer][1]), (seq, layer)

    def write(seq: int, start: int, k_layers: list, layers=None) -> None:
        for layer, k in enumerate(k_layers):
            if layers is not None and layer not in layers:
                continue
            cache.write(seq, layer, start, k, -k)
            ok, ov = shadow[seq][layer]
            shadow[seq][layer] = (torch.cat([ok[:start], k, ok[start + len(k):]]),
                                  torch.cat([ov[:start], -k, ov[start + len(k):]]))

    def admit(n: int, ids) -> None:
        nonlocal next_id
        seq = next_id
        before = snap()
        try:
            hit = cache.allocate(seq, n, token_ids=ids)
        except KVCacheFullError as e:
            bump("full")
            unchanged(before, e.transient)
            assert not cache.has_seq(seq)
            return
        next_id += 1
        bump("alloc")
        if hit:
            bump("hit")
        if ids is not None:
            full = [prompt_values(SPEC, ids, layer) for layer in range(SPEC.num_layers)]
            shadow[seq] = [(f[:hit], -f[:hit]) for f in full]
            for layer in range(SPEC.num_layers):          # the hit positions hold that prefix's K/V
                k, v = cache.gather(seq, layer)
                assert torch.equal(k[:hit], full[layer][:hit]) and torch.equal(v[:hit], -full[layer][:hit]), \
                    ("hit content", seq, hit, layer)
            if hit < n:
                write(seq, hit, [f[hit:] for f in full])
        else:
            shadow[seq] = [(torch.zeros(0, H, D), torch.zeros(0, H, D))] * SPEC.num_layers
            write(seq, 0, [torch.randn(n, H, D, generator=gen) for _ in range(SPEC.num_layers)])

    def unwritten(seqs) -> None:
        """The last position of each of ``seqs`` was extended but not written: shadowed as it reads
        (whatever its page held, which must not change behind the sequence's back)."""
        for s in seqs:
            for layer in range(SPEC.num_layers):
                k, v = cache.gather(s, layer)
                ok, ov = shadow[s][layer]
                shadow[s][layer] = (torch.cat([ok, k[-1:]]), torch.cat([ov, v[-1:]]))
        cache.check_integrity()
        check_data()

    def step(seqs: list[int]) -> None:
        """A decode step through prepare()/write_kv (copy-on-write in prepare)."""
        before = snap()
        grown = []
        try:
            for s in seqs:
                if cache.seq_len(s) < mml:
                    cache.extend(s, 1)
                    grown.append(s)
        except KVCacheFullError as e:
            bump("full")
            # the extends before the refused one stand; their new positions are unwritten: shadowed
            # as they read (whatever the page held; it must not change behind the sequence's back)
            unwritten(grown)
            return
        if not grown:
            return
        batch = [StepSeq(s, cache.seq_len(s) - 1, 1) for s in grown]
        try:
            meta = cache.prepare(batch)
        except KVCacheFullError as e:
            bump("full")
            u0, lens0 = before
            for s in grown:
                n = cache.seq_len(s)
                assert n == lens0[s] + 1
            # the extend calls happened; the prepare changed nothing: the new positions are unwritten
            unwritten(grown)
            return
        for layer in range(SPEC.num_layers):
            k = torch.randn(len(grown), H, D, generator=gen)
            cache.write_kv(layer, k, -k, meta)
            for i, s in enumerate(grown):
                ok, ov = shadow[s][layer]
                shadow[s][layer] = (torch.cat([ok, k[i:i + 1]]), torch.cat([ov, -k[i:i + 1]]))
        bump("step")

    try:
        for _ in range(steps):
            op = rng.choices(["alloc", "grow", "free", "fork", "overwrite", "step", "prefetch",
                              "prefetch_admission", "release", "oom"],
                             [7, 5, 4, 3, 3, 3, 2, 2, 3, 1.5])[0]
            if TRACE:
                print(op, {s: cache.seq_len(s) for s in shadow}, "oom", oom.mode, "created",
                      m.pool.num_created, "/", m.pool.max_pages)
            if op == "alloc" and len(cache.seqs) < cache.max_num_seqs:
                if planned and rng.random() < 0.7:
                    n, ids = planned.pop(0)
                else:
                    n = rng.randint(1, mml)
                    ids = prompts[rng.randrange(3)][:n] if rng.random() < 0.75 else None
                admit(n, ids)
            elif op == "grow" and shadow:
                seq = rng.choice(sorted(shadow))
                old = cache.seq_len(seq)
                n = rng.choice([1, 1, rng.randint(1, unit), rng.randint(1, 8 * unit)])
                if old + n <= mml:
                    before = snap()
                    try:
                        cache.extend(seq, n)
                    except KVCacheFullError as e:
                        bump("full")
                        unchanged(before, e.transient)
                    else:
                        bump("grow")
                        write(seq, old, [torch.randn(n, H, D, generator=gen) for _ in range(SPEC.num_layers)])
            elif op == "free" and shadow:
                seq = rng.choice(sorted(shadow))
                cache.free(seq, written=rng.random() < 0.9)
                del shadow[seq]
                bump("free")
            elif op == "fork" and shadow and len(cache.seqs) < cache.max_num_seqs:
                parent = rng.choice(sorted(shadow))
                before = snap()
                try:
                    cache.fork(parent, next_id)
                except KVCacheFullError as e:
                    bump("full")
                    unchanged(before, e.transient)
                    assert not cache.has_seq(next_id)
                else:
                    shadow[next_id] = list(shadow[parent])
                    next_id += 1
                    bump("fork")
            elif op == "overwrite" and shadow:
                seq = rng.choice(sorted(shadow))
                n_all = cache.seq_len(seq)
                start = rng.randrange(n_all)
                n = rng.randint(1, min(n_all - start, 2 * unit))
                layers = None if rng.random() < 0.6 else {rng.randrange(SPEC.num_layers)}
                before = snap()
                try:
                    write(seq, start, [torch.randn(n, H, D, generator=gen) for _ in range(SPEC.num_layers)],
                          layers)
                except KVCacheFullError as e:           # copy-on-write short of pages
                    bump("full")
                    # a write is per layer: the layers before the refused one are written (shadowed)
                    cache.check_integrity()
                    check_data()
                else:
                    bump("overwrite")
            elif op == "step" and shadow:
                step(rng.sample(sorted(shadow), rng.randint(1, len(shadow))))
            elif op == "prefetch" and shadow:
                cache.prefetch(sorted(shadow), rng.randint(1, 300))
                bump("prefetch")
            elif op == "prefetch_admission":
                planned = []
                for _ in range(rng.randint(1, 3)):
                    n = rng.randint(1, mml)
                    planned.append((n, prompts[rng.randrange(3)][:n] if rng.random() < 0.75 else None))
                ids = [p[1] for p in planned]
                cache.prefetch_admission([p[0] for p in planned], ids if any(i is not None for i in ids) else None)
                bump("prefetch_admission")
            elif op == "release":
                t += rng.choice([0.0, 1.0])
                cache.release_idle(now=t)
                bump("release")
            elif op == "oom":
                oom.mode = rng.choice([None, None, None, None, "all", "single", "span", 0.3])
            assert m.pool.num_created <= m.pool.max_pages
            cache.check_integrity()
            check_data()
        oom.mode = None
        for seq in sorted(shadow):
            cache.free(seq)
        shadow.clear()
        if not preallocate:
            for _ in range(cap_pages // 32 + 3):
                t += 1.0
                cache.release_idle(now=t)
            idle = m.num_idle_pages()
            assert m.pool.num_created == idle
            assert idle == reserve or (idle < reserve and m.pool.num_created == m.pool.max_pages) \
                or (reserve > m.pool.max_pages and idle == m.pool.max_pages), (idle, reserve)
        cache.check_integrity()
        counts["collisions"] = cache.prefix.num_collisions
    finally:
        cache.close()
    return counts


TRACE = bool(os.environ.get("VMKV_FUZZ_TRACE"))
SEEDS = range(int(os.environ.get("VMKV_SPAN_FUZZ_SEEDS", "8")))
STEPS = int(os.environ.get("VMKV_SPAN_FUZZ_STEPS", "150"))


@pytest.mark.parametrize("seed", SEEDS)
def test_span_fuzz(seed):
    counts = _fuzz(seed, STEPS)
    assert counts.get("alloc") or counts.get("full")
    assert counts["collisions"] == 0           # sha256: a hash met is the unit's own


@pytest.mark.parametrize("seed", SEEDS)
def test_span_fuzz_colliding_hashes(seed, monkeypatch):
    """Every unit hash the same (tests/test_prefix_integrity.py, ``collide``): hits are verified by
    tokens and parent, so each sequence still reads only its own prefix's K/V."""
    colliding = b"\x5a" * 32
    monkeypatch.setattr(hashing_mod, "hash_unit_bytes", lambda *args, **kw: colliding)   # what unit_keys calls
    counts = _fuzz(1000 + seed, STEPS)
    assert counts.get("alloc") or counts.get("full")
    assert counts["collisions"] > 0, f"the constant hash met no collision: {counts}"   # the injection fired
