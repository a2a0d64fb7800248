"""The vmem warm paths that count instead of walking (``SlotMapper.unshared`` / ``mapped_below``):
the slot choice, the admission plan, the shared-bytes count and the admission itself must decide
exactly what the page walks decide, on random states with and without sharing (forks, prefix hits)."""

from __future__ import annotations

import random

import pytest
import torch

from vmkv import KVCacheFullError, KVCacheSpec
from vmkv.vmem import VMemKVCache
from vmkv.vmem.placement import pick_fork_slot, pick_slot
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: every driver call validated

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
MAX_LEN = 96


def _walked(mapper, fn):
    """``fn()`` with the counting shortcuts off: every decision comes from the page walks."""
    saved = mapper.unshared
    mapper.unshared = lambda slot: False
    try:
        return fn()
    finally:
        mapper.unshared = saved


def _reference_slot(m, num_units: int, exclude: frozenset):
    """pick_slot's choice without hits by its definition, every free slot outside ``exclude`` scored:
    fewest driver calls (a hole: a map; a shared or cached kept page: an unmap and a map), then the
    kept units closest to ``num_units`` from above (else the most below), then the lowest index."""
    def key(s):
        calls = sum(1 if (p := s.page(u, r)) is None else
                    2 if m.refcount(p) > 1 or m.prefix.is_cached(p) else 0
                    for u in range(num_units) for r in range(m.num_res))
        kept = len(s.units)
        return calls, ((0, kept - num_units) if kept >= num_units else (1, num_units - kept)), s.index
    return min((s for s in m.slots if s.is_free and s.index not in exclude), key=key, default=None)


def _check_decisions(c: VMemKVCache, n: int, rng: random.Random) -> None:
    m = c.mapper
    num_units = c.layout.num_units(n)
    fast_slot = pick_slot(m, num_units, [])
    walk_slot = _walked(m, lambda: pick_slot(m, num_units, []))
    assert fast_slot is walk_slot, (fast_slot and fast_slot.index, walk_slot and walk_slot.index)
    assert fast_slot is _reference_slot(m, num_units, frozenset())
    # with some free slots excluded (prefetch_admission's), the first choice among them included
    free = [s.index for s in m.slots if s.is_free]
    exclude = frozenset(rng.sample(free, rng.randint(0, len(free))))
    if fast_slot is not None and rng.random() < 0.5:
        exclude |= {fast_slot.index}
    want = _reference_slot(m, num_units, exclude)
    assert pick_slot(m, num_units, [], exclude) is want
    assert _walked(m, lambda: pick_slot(m, num_units, [], exclude)) is want
    if fast_slot is not None:
        assert m.plan_occupy(fast_slot, num_units, []) == _walked(
            m, lambda: m.plan_occupy(fast_slot, num_units, []))
        assert m.mapped_below(fast_slot, num_units) == sum(
            1 for u in range(num_units) for r in range(m.num_res) if fast_slot.page(u, r) is not None)
    for s in c.seqs.values():
        args = (s.units, range(s.units.claimed), s.seq_len)
        assert c._shared_bytes_of(*args) == _walked(m, lambda: c._shared_bytes_of(*args))
        # any_shared / plan_writable answer in O(1) for a slot that shares nothing: as the walk does
        units, res = range(s.units.units_end + 1), range(m.num_res)
        shared = [(u, r) for u in units for r in res
                  if (p := s.units.page(u, r)) is not None and m.refcount(p) > 1]
        assert m.any_shared(s.units, units) == bool(shared)
        assert m.plan_writable(s.units, units, res) == len(shared)


def _check_fork_slot(c: VMemKVCache, parent, num_units: int) -> None:
    """pick_fork_slot against its definition: the free slot with the fewest kept pages that differ
    from the parent's first ``num_units`` units, then the lowest index (every free slot scored)."""
    m = c.mapper

    def mismatches(s):
        return sum(1 for u in range(num_units) for r in range(m.num_res)
                   if s.page(u, r) is not None and s.page(u, r) != parent.page(u, r))
    want = min((s for s in m.slots if s.is_free), key=lambda s: (mismatches(s), s.index))
    assert pick_fork_slot(m, parent, num_units) is want


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_counting_paths_decide_as_the_walks_do(seed, prefix_caching):
    rng = random.Random(seed)
    # 40 pages of 8 tokens for 6 slots of up to 12 units: admissions reclaim and get refused
    c = VMemKVCache(SPEC, max_num_seqs=6, max_model_len=MAX_LEN, memory_bytes=40 * 8192,
                    driver="host", page_size_bytes=8192, enable_prefix_caching=prefix_caching)
    try:
        page_tokens = c.layout.unit_tokens
        assert page_tokens > 0
        lens: dict[int, int] = {}
        next_id = 0
        prompts = [[rng.randrange(40) for _ in range(MAX_LEN)] for _ in range(2)]
        for _ in range(250):
            op = rng.choice(["alloc", "alloc", "extend", "free", "fork"] if seed % 2 else
                            ["alloc", "alloc", "extend", "free"])
            live = list(lens)
            try:
                if op == "alloc" or not live:
                    if len(lens) == c.max_num_seqs:
                        continue
                    n = rng.randint(1, MAX_LEN)
                    _check_decisions(c, n, rng)
                    ids = prompts[rng.randrange(2)][:n] if prefix_caching else None
                    c.allocate(next_id, n, ids)
                    lens[next_id] = n
                    next_id += 1
                elif op == "extend":
                    seq = rng.choice(live)
                    k = rng.randint(1, 2 * page_tokens)
                    if lens[seq] + k <= MAX_LEN:
                        c.extend(seq, k)
                        lens[seq] += k
                elif op == "fork":
                    if len(lens) < c.max_num_seqs:
                        parent = rng.choice(live)
                        _check_fork_slot(c, c.seqs.get(parent).units, c.layout.num_units(lens[parent]))
                        c.fork(parent, next_id)
                        lens[next_id] = lens[parent]
                        next_id += 1
                else:
                    seq = rng.choice(live)
                    c.free(seq)
                    del lens[seq]
            except KVCacheFullError:
                pass
            c.check_integrity()
            if not prefix_caching:
                for slot in c.mapper.slots:
                    private = all(c.mapper.refcount(p) == 1 for pages in slot.units.values()
                                  for p in pages if p is not None)
                    assert c.mapper.unshared(slot) == private
    finally:
        c.close()


def test_warm_admission_reuses_the_kept_pages_without_a_driver_call():
    c = VMemKVCache(SPEC, max_num_seqs=4, max_model_len=MAX_LEN, memory_bytes=1 << 24, driver="host",
                    page_size_bytes=8192, enable_prefix_caching=False)
    try:
        c.allocate(0, MAX_LEN)
        slot = c.seqs.get(0).units
        pages = {u: list(p) for u, p in slot.units.items()}
        c.free(0)
        maps = c.mapper.num_maps
        c.allocate(1, MAX_LEN - 5)
        s1 = c.seqs.get(1).units
        assert s1 is slot and c.mapper.num_maps == maps
        assert {u: list(p) for u, p in s1.units.items()} == pages
        assert s1.claimed == c.layout.num_units(MAX_LEN - 5)
        c.check_integrity()
    finally:
        c.close()


def _observe(c: VMemKVCache) -> tuple:
    """What a user or the scheduler can see of a cache, plus where every page is mapped."""
    m = c.mapper
    u = c.usage()
    return (u.allocated_bytes, u.waste_bytes, u.used_tokens, u.mapped_bytes, u.created_bytes, u.free_tokens,
            m.available_pages(), m.num_idle_pages(), m.num_allocated_pages(), m.num_reclaimable_pages(),
            tuple((s.index, s.seq_id, s.claimed if s.seq_id is not None else 0,
                   tuple(sorted((k, tuple(v)) for k, v in s.units.items()))) for s in m.slots),
            _idle_last_use(m))


def _idle_last_use(m) -> dict:
    """The last-use tick of every page the eviction order may read (mapped pages no live sequence
    claims, and cached free ones), a parked slot's pages at its vacate tick."""
    parked = {p: s.free_tick for s in m.slots if m.is_parked(s)
              for u in range(s.claimed) for p in s.units.get(u, ()) if p is not None}
    return {**{p: m.table.last_use[p] for p in m.table.reclaimable | m.pool.cached_pages()}, **parked}


@pytest.mark.parametrize("seed", range(8))
def test_parked_slots_behave_as_released_ones(seed, monkeypatch):
    """Two caches run the same random operations, one parking freed slots and one releasing their
    claims at once: after every operation both show the same usage, counts and mappings, and the same
    pages go back to the driver on an elastic release."""
    rng = random.Random(seed)
    caches = [VMemKVCache(SPEC, max_num_seqs=5, max_model_len=MAX_LEN, memory_bytes=30 * 8192,
                          driver="host", page_size_bytes=8192, enable_prefix_caching=bool(seed % 2),
                          kv_reserve_bytes=2 * 8192, kv_shrink_grace_s=0.0)
              for _ in range(2)]
    monkeypatch.setattr(caches[1].mapper, "park", lambda slot: False)
    parks = 0
    try:
        lens: dict[int, int] = {}
        next_id = 0
        prompt = [rng.randrange(40) for _ in range(MAX_LEN)]
        for step in range(300):
            op = rng.choice(["alloc", "alloc", "extend", "free", "free", "fork", "release"])
            live = list(lens)
            args = None
            if op == "alloc" or not live:
                if len(lens) < 5:
                    n = rng.randint(1, MAX_LEN)
                    args = ("allocate", next_id, n, prompt[:n] if rng.random() < 0.3 else None)
            elif op == "extend":
                seq = rng.choice(live)
                k = rng.randint(1, 12)
                if lens[seq] + k <= MAX_LEN:
                    args = ("extend", seq, k)
            elif op == "fork":
                if len(lens) < 5:
                    args = ("fork", rng.choice(live), next_id)
            elif op == "free":
                args = ("free", rng.choice(live))
            else:
                args = ("release_idle",)
            if args is None:
                continue
            outcomes = []
            for c in caches:
                try:
                    if args[0] == "release_idle":
                        outcomes.append(c.release_idle(now=float(step)))
                    else:
                        outcomes.append(getattr(c, args[0])(*args[1:]))
                except KVCacheFullError as e:
                    outcomes.append(("full", str(e)))
                c.check_integrity()
            assert outcomes[0] == outcomes[1], (step, args, outcomes)
            if not isinstance(outcomes[0], tuple):
                if args[0] == "allocate":
                    lens[args[1]] = args[2]
                    next_id += 1
                elif args[0] == "extend":
                    lens[args[1]] += args[2]
                elif args[0] == "fork":
                    lens[args[2]] = lens[args[1]]
                    next_id += 1
                elif args[0] == "free":
                    del lens[args[1]]
            parks = max(parks, caches[0].mapper.num_parks)
            a, b = (_observe(c) for c in caches)
            assert a == b, (step, args)
        assert parks > 0, "no slot was parked: the test did not exercise parking"
        assert caches[1].mapper.num_parks == 0
    finally:
        for c in caches:
            c.close()


def test_a_fork_reuses_a_freed_sibling_slot_that_keeps_the_parent_pages():
    """A freed fork child keeps the parent's pages mapped: the next fork takes its slot (no page
    differs, so no map), though a slot keeping nothing is free at a higher index."""
    c = VMemKVCache(SPEC, max_num_seqs=4, max_model_len=MAX_LEN, memory_bytes=1 << 24, driver="host",
                    page_size_bytes=8192, enable_prefix_caching=False)
    try:
        c.allocate(0, 40)
        c.fork(0, 1)
        c.fork(0, 2)
        sibling = c.seqs.get(1).units
        c.free(1)
        assert c.mapper.free_slots.lowest_empty() is not None
        assert c.mapper.free_slots.lowest_empty() > sibling.index
        maps = c.mapper.num_maps
        c.fork(0, 3)
        assert c.seqs.get(3).units is sibling and c.mapper.num_maps == maps
        _check_fork_slot(c, c.seqs.get(0).units, c.layout.num_units(40))
        c.check_integrity()
    finally:
        c.close()


def test_a_fork_elsewhere_leaves_other_slots_on_the_counting_paths():
    """Sharing is tracked per slot (``PageTable.shared_positions``): a live fork keeps its own two slots
    on the page walks, while another sequence's slot is still parked on free and adopted on reuse."""
    c = VMemKVCache(SPEC, max_num_seqs=5, max_model_len=MAX_LEN, memory_bytes=1 << 24, driver="host",
                    page_size_bytes=8192, enable_prefix_caching=False)
    try:
        m = c.mapper
        c.allocate(0, 40)
        c.fork(0, 1)
        child = c.seqs.get(1).units
        shared = {c.seqs.get(0).units.index, child.index}
        assert set(m.table.shared_positions) == shared
        c.allocate(2, MAX_LEN)
        slot = c.seqs.get(2).units
        assert m.unshared(slot) and not any(m.unshared(m.slots[i]) for i in shared)
        c.free(2)
        assert m.is_parked(slot) and m.num_parks == 1
        maps = m.num_maps
        c.allocate(3, MAX_LEN)
        assert c.seqs.get(3).units is slot and m.num_adoptions == 1 and m.num_maps == maps
        c.free(1)                       # the child's slot keeps the parent's pages: still shared
        assert set(m.table.shared_positions) == shared and not m.is_parked(child)
        c.check_integrity()
    finally:
        c.close()
