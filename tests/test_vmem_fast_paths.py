"""The vmem warm paths that count instead of walking (``SlotMapper.unshared`` / ``mapped_below``):
the slot choice, the admission plan, the shared-bytes count and the admission itself must decide
exactly what the page walks decide, on random states with and without sharing (forks, prefix hits)."""

from __future__ import annotations

import random

import pytest
import torch

from vmkv import KVCacheFullError, KVCacheSpec
from vmkv.vmem import VMemKVCache
from vmkv.vmem.placement import pick_slot
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: every driver call validated

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
MAX_LEN = 96


def _walked(mapper, fn):
    """``fn()`` with the counting shortcuts off: every decision comes from the page walks."""
    saved = mapper.unshared
    mapper.unshared = lambda: False
    try:
        return fn()
    finally:
        mapper.unshared = saved


def _check_decisions(c: VMemKVCache, n: int) -> None:
    m = c.mapper
    num_units = c.layout.num_units(n)
    fast_slot = pick_slot(m, num_units, [])
    walk_slot = _walked(m, lambda: pick_slot(m, num_units, []))
    assert fast_slot is walk_slot, (fast_slot and fast_slot.index, walk_slot and walk_slot.index)
    if fast_slot is not None:
        assert m.plan_occupy(fast_slot, num_units, []) == _walked(
            m, lambda: m.plan_occupy(fast_slot, num_units, []))
        assert m.mapped_below(fast_slot, num_units) == sum(
            1 for u in range(num_units) for r in range(m.num_res) if fast_slot.page(u, r) is not None)
    for s in c.seqs.values():
        args = (s.units, range(s.units.claimed), s.seq_len)
        assert c._shared_bytes_of(*args) == _walked(m, lambda: c._shared_bytes_of(*args))


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
                    _check_decisions(c, n)
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
            if not prefix_caching and not any(c.mapper.refcount(p) > 1 for p in c.mapper.table.entries):
                assert c.mapper.unshared()
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
