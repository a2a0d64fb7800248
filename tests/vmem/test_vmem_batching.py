"""vmem: batched mapping (one set_access per run of adjacent pages) and prefetch (map ahead off the
critical path), on the host driver with exact call counts.

Shapes as in test_vmem_cache.py: 2 layers, 2 KV heads, head_dim 32, fp32, 4 KiB pages, max_model_len 128.
megacache: 4 tokens per page, 1 page per unit.  per_layer: 16 tokens per page, 4 pages per unit.
"""

import random
from dataclasses import replace

import pytest
import torch

from vmkv import KVCacheFullError, KVCacheSpec
from vmkv.engine.config import CacheConfig, EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams
from vmkv.kvcache.base import KVCache
from vmkv.vmem import HostDriver, VMemKVCache, VMMError
from checked_driver import CheckedDriver
from vmkv.vmem import backing as backing_mod
from vmkv.vmem.mapper import SlotMapper
from vmem_helpers import checked_drivers, random_op  # noqa: F401 - checked_drivers is an autouse fixture

PAGE = 4096
MAX_LEN = 128
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
UT = {"megacache": 4, "per_layer": 16}
PPU = {"megacache": 1, "per_layer": 4}


class CountingDriver(CheckedDriver):
    """Checked host driver that records every map (with its set_access flag) and set_access call,
    and can be told to fail the next set_access."""

    def __init__(self) -> None:
        super().__init__(HostDriver("cpu", PAGE))
        self.maps: list[tuple[int, bool]] = []
        self.accesses: list[tuple[int, int]] = []
        self.fail_next_access = False

    def map(self, va, handle, *, set_access=True):
        super().map(va, handle, set_access=set_access)
        self.maps.append((va, set_access))

    def set_access(self, va, nbytes):
        if self.fail_next_access:
            self.fail_next_access = False
            raise VMMError("mprotect", "ENOMEM", "injected failure")
        super().set_access(va, nbytes)
        self.accesses.append((va, nbytes))

    def reset(self) -> None:
        self.maps.clear()
        self.accesses.clear()


class PageByPageMapper(SlotMapper):
    """Reference: every page its own batch (map + set_access of one page)."""

    def map_batch(self, slot, items):
        for item in items:
            super().map_batch(slot, [item])


@pytest.fixture
def make(layout):
    made = []

    def _make(num_units=16, max_num_seqs=4, **kw):
        drv = CountingDriver()
        c = VMemKVCache(SPEC, max_num_seqs=max_num_seqs, max_model_len=MAX_LEN,
                        memory_bytes=num_units * PPU[layout] * PAGE, driver=drv, layout=layout, **kw)
        made.append((c, drv))
        return c, drv

    yield _make
    for c, drv in made:
        c.close()
        drv.close()


def _runs(c, seq, units):
    """Expected ``(va, nbytes)`` set_access runs: one per reservation over consecutive ``units``."""
    slot = c.slot_of(seq)
    return sorted((c.mapper.va(r, slot, units.start), len(units) * PAGE)
                  for r in range(c.layout.num_reservations))


# ---------------------------------------------------------------------- batching
def test_one_set_access_per_contiguous_run(make, layout):
    c, drv = make()
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(1, 5 * ut)
    assert len(drv.maps) == 5 * ppu and not any(acc for _, acc in drv.maps)
    assert sorted(drv.accesses) == _runs(c, 1, range(0, 5))
    drv.reset()
    c.extend(1, 3 * ut)                          # units 5..7: one run per reservation
    assert len(drv.maps) == 3 * ppu and sorted(drv.accesses) == _runs(c, 1, range(5, 8))
    drv.reset()
    c.fork(1, 2)                                 # the child maps the parent's 8 units in one batch
    assert len(drv.maps) == 8 * ppu and sorted(drv.accesses) == _runs(c, 2, range(0, 8))
    stats = c.vmm_stats()
    assert stats["num_map_batches"] == 3 and stats["num_maps"] == 16 * ppu
    assert stats["num_set_access_calls"] == 3 * c.layout.num_reservations
    assert stats["pages_per_batch_max"] == 8 * ppu
    assert stats["pages_per_batch_mean"] == pytest.approx(16 * ppu / 3)
    # per-page samples are the batch time spread over its pages
    map_us, _ = c.map_latency_samples_us()
    batch_us, pages = c.map_batch_samples()
    assert pages == [5 * ppu, 3 * ppu, 8 * ppu] and len(map_us) == 16 * ppu
    assert sum(map_us) == pytest.approx(sum(batch_us))
    assert map_us[0] == pytest.approx(batch_us[0] / (5 * ppu))
    assert stats["map_batch_us_p99"] >= stats["map_us_p99"] > 0
    assert drv.num_pending_access == 0
    c.check_integrity()


def test_prefix_hits_and_fresh_pages_share_one_run(make, layout):
    c, drv = make()
    ut = UT[layout]
    prompt = list(range(4 * ut + 1))
    c.allocate(1, len(prompt), prompt)
    for layer in range(SPEC.num_layers):
        k = torch.randn(len(prompt), SPEC.num_kv_heads, SPEC.head_dim)
        c.write(1, layer, 0, k, -k)
    drv.reset()
    assert c.allocate(2, len(prompt) + 2 * ut, prompt + [7] * (2 * ut)) == 4 * ut
    # 4 hit units + 3 fresh units (the partial one is recomputed): one run 0..7 per reservation
    assert sorted(drv.accesses) == _runs(c, 2, range(0, 7))
    for layer in range(SPEC.num_layers):
        assert torch.equal(c.gather(2, layer)[0][:4 * ut], c.gather(1, layer)[0][:4 * ut])
    c.check_integrity()


def _random_ops(c, seed, prefetch=False):
    """Seeded allocate/extend/fork/free/write under memory pressure; returns live token lists."""
    rng = random.Random(seed)
    ut = c.unit_tokens
    tokens, next_id = {}, 0
    prefixes = [[rng.randrange(50) for _ in range(3 * ut)] for _ in range(2)]

    def write_range(seq, start, end):
        for layer in range(SPEC.num_layers):
            val = torch.tensor([float(hash((seq, p, layer)) % 997) for p in range(start, end)])
            k = val.view(-1, 1, 1).expand(-1, SPEC.num_kv_heads, SPEC.head_dim)
            c.write(seq, layer, start, k, -k)

    for _ in range(120):
        before = c.usage()
        try:
            done = random_op(c, rng, tokens, next_id, prefixes, MAX_LEN, write_range,
                             new_token=lambda: 0, check_can_allocate=True)
            if done is None:
                continue
            next_id = done
        except KVCacheFullError:
            assert c.usage() == before
        if prefetch and tokens:
            lens = {s: c.seq_len(s) for s in tokens}
            c.prefetch(rng.sample(list(tokens), rng.randint(1, len(tokens))), rng.randint(0, 2 * ut))
            # the next admissions' pages, prefix hits included (a prompt of a cached prefix + a tail)
            upcoming = [rng.choice(prefixes)[:rng.randint(1, 3 * ut)] + [rng.randrange(50)]
                        for _ in range(rng.randint(1, 3))]
            c.prefetch_admission([len(t) for t in upcoming], upcoming, [None] * len(upcoming))
            assert {s: c.seq_len(s) for s in tokens} == lens
        c.check_integrity()
    return tokens


def _state(c):
    slots = [(s.index, s.seq_id, s.claimed, {u: list(p) for u, p in s.units.items()}) for s in c.mapper.slots]
    return slots, c.pool.pages_in_use(), c.usage()


def test_batched_mapping_matches_page_by_page(layout, monkeypatch):
    def run(mapper_cls):
        monkeypatch.setattr(backing_mod, "SlotMapper", mapper_cls)
        drv = CountingDriver()
        c = VMemKVCache(SPEC, max_num_seqs=5, max_model_len=MAX_LEN, memory_bytes=12 * PPU[layout] * PAGE,
                        driver=drv, layout=layout)
        tokens = _random_ops(c, seed=77)
        data = {s: [c.gather(s, layer) for layer in range(SPEC.num_layers)] for s in tokens}
        out = (_state(c), data, c.vmm_stats(), len(drv.accesses))
        c.close()
        drv.close()
        return out

    (state_b, data_b, stats_b, acc_b), (state_p, data_p, stats_p, acc_p) = run(SlotMapper), run(PageByPageMapper)
    assert state_b == state_p
    assert data_b.keys() == data_p.keys()
    for s in data_b:
        for (kb, vb), (kp, vp) in zip(data_b[s], data_p[s]):
            assert torch.equal(kb, kp) and torch.equal(vb, vp)
    for key in ("num_maps", "num_unmaps", "num_reclaimed_pages", "num_cow_copies"):
        assert stats_b[key] == stats_p[key], key
    assert stats_p["num_set_access_calls"] == acc_p == stats_p["num_maps"]    # one per page
    assert acc_b == stats_b["num_set_access_calls"] < acc_p                    # batched: fewer


def test_failed_set_access_undoes_the_batch(make, layout):
    c, drv = make(num_units=8)
    ut = UT[layout]
    c.allocate(1, 2 * ut)
    c.free(1)                                    # slot 0 keeps 2 units
    # pages the failed batch created stay in the pool for the next allocation (created_bytes may
    # grow); everything a sequence or a mapping holds is as before
    before = (replace(c.usage(), created_bytes=0), c.vmm_stats()["num_maps"], drv.num_mappings)
    drv.fail_next_access = True
    with pytest.raises(VMMError, match="injected"):
        c.allocate(2, 5 * ut)                    # reuses the kept units, maps 3 more: fails
    after = (replace(c.usage(), created_bytes=0), c.vmm_stats()["num_maps"], drv.num_mappings)
    assert not c.has_seq(2) and after == before
    assert drv.num_pending_access == 0
    c.check_integrity()
    c.allocate(2, 5 * ut)                        # works once the driver does
    c.extend(2, ut)
    drv.fail_next_access = True
    with pytest.raises(VMMError):
        c.extend(2, 2 * ut)
    assert c.seq_len(2) == 6 * ut and c.mapper.slots[c.slot_of(2)].claimed == 6
    c.check_integrity()
    drv.fail_next_access = True
    with pytest.raises(VMMError):
        c.fork(2, 3)
    assert not c.has_seq(3)
    c.check_integrity()


# ---------------------------------------------------------------------- prefetch
def test_prefetch_maps_ahead_so_extend_makes_no_driver_call(make, layout):
    c, drv = make(num_units=16)
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(1, ut)                            # exactly one unit
    u0 = c.usage()
    drv.reset()
    c.prefetch([1], 2 * ut)                      # units 1 and 2, one batch
    assert c.seq_len(1) == ut and len(drv.maps) == 2 * ppu
    assert sorted(drv.accesses) == _runs(c, 1, range(1, 3))
    u1 = c.usage()
    assert u1.mapped_bytes == u0.mapped_bytes + 2 * ppu * PAGE
    # not claimed: not allocated, still available for admission
    assert (u1.allocated_bytes, u1.free_tokens, u1.used_tokens) == (u0.allocated_bytes, u0.free_tokens, ut)
    c.check_integrity()
    drv.reset()
    for _ in range(2 * ut):
        c.extend(1, 1)
    assert drv.maps == [] and drv.accesses == []             # no driver call on the critical path
    assert c.usage().allocated_bytes == 3 * ppu * PAGE
    c.prefetch([1], 2 * ut)                      # idempotent once mapped ... and tops up
    c.prefetch([1], 2 * ut)
    assert len(drv.maps) == 2 * ppu
    stats = c.vmm_stats()
    assert stats["num_prefetched_pages"] == 4 * ppu and stats["prefetch_time_us"] > 0
    c.check_integrity()


def test_prefetched_pages_are_reclaimable_for_admission(make, layout):
    c, drv = make(num_units=8)
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(1, 2 * ut)
    c.prefetch([1], 6 * ut)                      # maps the 6 free units ahead
    u = c.usage()
    assert u.mapped_bytes == u.capacity_bytes and u.allocated_bytes == 2 * ppu * PAGE
    assert u.free_tokens == 6 * ut and c.can_allocate(6 * ut) and not c.can_allocate(6 * ut + 1)
    c.allocate(2, 6 * ut)                        # takes them back (reclaims without a fence wait)
    stats = c.vmm_stats()
    assert stats["num_reclaimed_pages"] == 6 * ppu and stats["num_fence_waits"] == 0
    assert c.usage().free_tokens == 0 and not c.can_allocate(1)
    c.check_integrity()
    with pytest.raises(KVCacheFullError):
        c.extend(1, 1)                           # the prefetched unit is gone, the pool is empty
    c.free(2)
    c.extend(1, 1)
    c.check_integrity()


def test_prefetch_on_a_full_pool_is_a_no_op(make, layout):
    c, drv = make(num_units=6)
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(1, 3 * ut)
    c.allocate(2, 2 * ut)
    c.allocate(3, ut)
    c.free(3)                                    # a kept unit: reclaimable, but prefetch never reclaims
    before = (c.usage(), c.vmm_stats()["num_maps"], c.vmm_stats()["num_unmaps"], drv.num_mappings)
    c.prefetch([1, 2, 99], 4 * ut)               # unknown id 99 is skipped; nothing raises
    assert (c.usage(), c.vmm_stats()["num_maps"], c.vmm_stats()["num_unmaps"], drv.num_mappings) == before
    assert (c.seq_len(1), c.seq_len(2)) == (3 * ut, 2 * ut)
    c.prefetch([1], MAX_LEN * 4)                 # past max_model_len: capped, still nothing to map
    c.prefetch([1], 0)
    with pytest.raises(ValueError, match="num_tokens"):
        c.prefetch([1], -1)
    with pytest.raises(ValueError, match="num_tokens"):
        c.prefetch([1], 1.5)
    c.check_integrity()
    c.free(2)                                    # 2 units freed, but kept: still no pool page
    c.prefetch([1], ut)
    assert c.vmm_stats()["num_maps"] == before[1]
    assert ppu * 6 == c.pool.max_pages


def test_prefetch_then_free_keeps_pages_for_the_next_request(make, layout):
    c, drv = make(num_units=8)
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(1, ut + 1)
    c.prefetch([1], 3 * ut - 1)                  # up to 4 ut: 2 units in use, 2 more ahead
    c.free(1)
    u = c.usage()
    assert (u.num_seqs, u.allocated_bytes, u.waste_bytes) == (0, 0, 0)
    assert u.mapped_bytes == 4 * ppu * PAGE and u.free_tokens == 8 * ut
    c.check_integrity()
    drv.reset()
    c.allocate(2, 4 * ut)                        # the kept slot with the prefetched units: no map
    assert drv.maps == [] and c.usage().allocated_bytes == 4 * ppu * PAGE
    c.check_integrity()


def test_prefetch_with_lookahead_and_fork(make, layout):
    c, drv = make(num_units=16, lookahead_tokens=1)
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(1, ut + ut // 2)
    c.fork(1, 2)                                 # unit 1 is shared and half full
    c.prefetch([1, 2], 2 * ut)
    c.check_integrity()
    drv.reset()
    c.extend(2, ut)                              # copy-on-write of unit 1; unit 2 was prefetched
    assert len(drv.maps) == ppu                  # only the private copy of unit 1
    c.check_integrity()


def test_random_operations_with_prefetch_stay_consistent(make, layout):
    c, _ = make(num_units=12, max_num_seqs=5)
    tokens = _random_ops(c, seed=4321, prefetch=True)
    u = c.usage()
    assert u.used_tokens == sum(len(t) for t in tokens.values())
    assert u.allocated_bytes <= u.mapped_bytes <= u.capacity_bytes
    assert c.vmm_stats()["num_prefetched_pages"] > 0


def test_base_prefetch_is_a_no_op():
    assert KVCache.prefetch.__doc__ and "never raises KVCacheFullError" in KVCache.prefetch.__doc__
    assert KVCache.prefetch(object(), [1], 16) is None
    assert KVCache.prefetch_admission(object(), [16]) is None


def test_prefetch_admission_maps_the_next_admissions_off_the_critical_path(make, layout):
    """The pages of the admissions expected next are mapped into the slots ``allocate`` will pick,
    unclaimed; the admissions then make no driver call.  More lengths than free slots or pages:
    best effort, nothing raises, nothing is claimed."""
    c, drv = make(num_units=16, max_num_seqs=4)
    ut, ppu = UT[layout], PPU[layout]
    c.allocate(0, ut)
    drv.reset()
    c.prefetch_admission([3 * ut, ut - 1])
    assert len(drv.maps) == 4 * ppu and c.usage().used_tokens == ut
    assert c.usage().free_tokens == 15 * ut                 # unclaimed: still available
    c.check_integrity()
    drv.reset()
    c.allocate(1, 3 * ut)
    c.allocate(2, ut - 1)
    assert drv.maps == [] and drv.accesses == []
    c.prefetch_admission([100 * ut, ut, ut, ut])            # too long for the pool; more than the slots
    c.check_integrity()
    assert c.usage().used_tokens == 5 * ut - 1
    assert c.vmm_stats()["num_prefetched_pages"] >= 4 * ppu


def test_prefetch_admission_maps_prefix_hits_into_the_slot(make, layout):
    """A waiting prompt that shares a cached prefix: its hit pages and its other pages are mapped
    into the slot ``allocate`` then picks, so the admission makes no driver call and still shares
    the prefix; the lookup counts no statistic."""
    from vmkv.kvcache.base import StepSeq

    c, drv = make(num_units=16, max_num_seqs=4)
    ut = UT[layout]
    prompt = [7 + i % 50 for i in range(3 * ut + 2)]
    c.allocate(1, len(prompt), prompt)
    c.prepare([StepSeq(1, 0, len(prompt))])             # written: its 3 full units get registered
    other = prompt[:3 * ut] + [99, 98, 97]
    q0 = c.usage().prefix_query_tokens
    drv.reset()
    c.prefetch_admission([len(other)], [other], [None])
    assert drv.maps and c.usage().prefix_query_tokens == q0   # mapped ahead, nothing counted
    c.check_integrity()
    drv.reset()
    assert c.allocate(2, len(other), other) == 3 * ut           # the prefix is shared ...
    assert drv.maps == [] and drv.accesses == []                # ... and nothing was mapped now
    c.check_integrity()
    c.free(1)
    c.free(2)
    c.check_integrity()


# ---------------------------------------------------------------------- engine
def _engine(backend: str, prefetch_tokens: int | None, **kw) -> LLMEngine:
    knobs = {"max_model_len": 96, "memory_bytes": 64 * 4096, "max_num_seqs": 4, "random_weights": "tiny",
             "prefetch_tokens": prefetch_tokens, **kw}
    if backend == "vmem":
        knobs.update(driver="host", page_size_bytes=4096)
    return LLMEngine(EngineConfig.from_args(None, backend, "cpu", "float32", **knobs))


def test_engine_prefetch_takes_maps_off_the_critical_path():
    torch.set_num_threads(1)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 13, 21))]
    results = {}
    for pf in (0, 8):
        eng = _engine("vmem", pf, layout="megacache")          # 512 B/token: 8 tokens per page
        for i, p in enumerate(prompts):
            eng.add_request(str(i), None, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                            prompt_token_ids=p)
        out = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
            eng.kv_cache.check_integrity()
        st = eng.get_stats()
        stats = eng.kv_cache.vmm_stats()
        results[pf] = (out, st, stats)
        eng.close()
    (out0, st0, vs0), (out8, st8, vs8) = results[0], results[8]
    assert out0 == out8 and all(len(t) == 30 for t in out8.values())     # same greedy tokens
    # both back the next positions and map the next admissions while the forward runs
    assert st0.prefetch_time_s_total > 0 and st8.prefetch_time_s_total > 0
    assert vs8["num_prefetched_pages"] > vs0["num_prefetched_pages"]
    # the cache's own prefetch time is part of the runner's off-critical-path time (which also
    # holds the extends of the next positions)
    assert 0 < vs8["prefetch_time_us"] <= st8.prefetch_time_s_total * 1e6
    # the same pages got mapped, but most of them before the extend that needed them
    assert vs8["num_maps"] >= vs0["num_maps"]
    assert vs8["num_maps"] - vs8["num_prefetched_pages"] < vs0["num_maps"] / 2


def test_engine_prefetch_config():
    assert CacheConfig().resolved_prefetch_tokens("cpu") == 0
    assert CacheConfig().resolved_prefetch_tokens("cuda") == 16
    assert CacheConfig(prefetch_tokens=4).resolved_prefetch_tokens("cpu") == 4
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="prefetch_tokens"):
            CacheConfig(prefetch_tokens=bad)
    eng = _engine("paged", 8)                    # paged keeps the default no-op prefetch
    eng.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=5), prompt_token_ids=[5, 6, 7])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.runner.prefetch_tokens == 8 and eng.get_stats().prefetch_time_s_total >= 0
    eng.close()


@pytest.mark.parametrize("seed", range(3))
def test_pick_slot_equals_the_exhaustive_choice(make, layout, seed):
    """pick_slot's bounded search (candidates in the order of a lower bound, stopped once the bound
    exceeds the best) picks exactly the slot an exhaustive min over the same key picks."""
    from vmkv.vmem import placement

    c, _ = make(num_units=12, max_num_seqs=5)
    live = _random_ops(c, seed=100 + seed)
    for sid in list(live)[::2]:                      # freed slots keep their pages: they compete
        c.free(sid)
    m = c.mapper
    rng = random.Random(seed)

    def exhaustive(num_units, hits):
        def calls(s):
            n = num_units * m.num_res
            for u, pages in s.units.items():
                if u >= num_units:
                    continue
                for r, p in enumerate(pages):
                    if p is None:
                        continue
                    if u < len(hits):
                        n += -1 if p == hits[u][r] else 1
                    elif m.refcount(p) > 1 or m.prefix.is_cached(p):
                        n += 1
                    else:
                        n -= 1
            return n
        free = [s for s in m.slots if s.is_free]
        cands = [s for s in free if s.units] + ([min((s for s in free if not s.units), key=lambda s: s.index)]
                                                if any(not s.units for s in free) else [])

        def key(s):
            kept = len(s.units)
            fit = (0, kept - num_units) if kept >= num_units else (1, num_units - kept)
            return (calls(s), fit, s.index)
        return min(cands, key=key) if cands else None

    for _ in range(40):
        num_units = rng.randint(1, c.layout.pages_per_slot)
        live = [s for s in m.slots if not s.is_free and s.units]
        hits = []
        if live and rng.random() < 0.5:
            src = rng.choice(live)
            hits = [list(src.units[u]) for u in range(min(src.claimed, num_units)) if u in src.units]
        assert placement.pick_slot(m, num_units, hits) is exhaustive(num_units, hits)
    assert sum(1 for s in m.slots if s.is_free and s.units) >= 1       # kept slots competed
