"""The KV-cache contract: one suite, every backend (STYLE.md rule 7).

The contract is the docstrings of :mod:`vmkv.kvcache.base`; caches are built only through
``vmkv.create_kv_cache`` and used only through the :class:`~vmkv.kvcache.base.KVCache` methods.
Data is fresh random K/V (never zeros) and is compared exactly (the cache stores, it never computes).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from kvcache_cases import (
    CASE_IDS,
    CASES,
    SPEC,
    allocate_capacity,
    pool_tokens,
    assert_data,
    assert_unchanged,
    check_usage,
    gather_all,
    one_torch_thread,
    rand_kv,
    snapshot,
    write_all_layers,
)
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: vmem drivers validate every call
from vmkv import KVCacheFullError, StepSeq
from vmkv.kernels.reference import attention_one_seq_ref
from vmkv.kvcache.base import DuplicateSequenceError, KVCacheError, UnknownSequenceError
from checked_driver import CheckedDriver

NUM_HEADS = 4 * SPEC.num_kv_heads  # GQA: 4 query heads per KV head


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request):
    return request.param


@pytest.fixture
def cache(case):
    c = case.make()
    yield c
    c.close()


def test_vmem_cases_run_on_a_checked_driver():
    """The one look behind the interface: vmem's driver is wrapped in CheckedDriver here (the
    ``checked_drivers`` fixture), so a misused driver call fails the contract suite too."""
    vmem_cases = [c for c in CASES if c.backend == "vmem"]
    assert vmem_cases
    for case in vmem_cases:
        with case.make() as c:
            assert isinstance(c.driver, CheckedDriver), case.name


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def unit_of(cache) -> int:
    """Tokens per allocation unit (block or page); 16 when the backend reports it fractional."""
    return cache.usage().unit_tokens or 16


def fill(cache, gen, first_id: int = 100, chunk: int | None = None) -> dict[int, list]:
    """Allocate and write sequences until no token can be allocated; returns their data."""
    chunk = chunk or cache.max_model_len // 2 - 2
    data: dict[int, list] = {}
    sid = first_id
    while cache.can_allocate(1):
        assert cache.usage().num_seqs < cache.max_num_seqs, "test config: memory should run out first"
        n = min(chunk, cache.usage().free_tokens)
        assert n >= 1, cache.usage()
        assert cache.allocate(sid, n) == 0
        data[sid] = write_all_layers(cache, sid, 0, n, gen)
        sid += 1
    assert cache.usage().free_tokens == 0
    return data


# ----------------------------------------------------------------------------- lifecycle and data
def test_roundtrip_allocate_extend_write_gather(cache, gen):
    u0 = cache.usage()
    assert u0.num_seqs == 0 and u0.used_tokens == 0 and u0.free_tokens > 0
    assert cache.backend in ("paged", "vmem")
    assert cache.allocate(1, 10) == 0
    assert cache.seq_len(1) == 10 and cache.has_seq(1) and not cache.has_seq(2)
    first = write_all_layers(cache, 1, 0, 10, gen)
    cache.extend(1, 7)
    assert cache.seq_len(1) == 17
    second = write_all_layers(cache, 1, 10, 7, gen)
    for layer in range(SPEC.num_layers):
        k, v = cache.gather(1, layer)
        assert k.shape == v.shape == (17, SPEC.num_kv_heads, SPEC.head_dim)
        assert k.dtype == v.dtype == SPEC.dtype and k.device.type == "cpu"
        torch.testing.assert_close(k, torch.cat([first[layer][0], second[layer][0]]), rtol=0, atol=0)
        torch.testing.assert_close(v, torch.cat([first[layer][1], second[layer][1]]), rtol=0, atol=0)
        # gather returns copies: scribbling on them does not reach the cache
        k.fill_(7.0)
        v.fill_(7.0)
    assert_data(cache, 1, first, 0)
    assert_data(cache, 1, second, 10)
    cache.check_integrity()
    check_usage(cache, {1: 17})


def test_writes_cross_unit_boundaries(cache, gen):
    unit = unit_of(cache)
    n = min(cache.max_model_len, 3 * unit + 3)
    cache.allocate(7, n)
    shape = (n, SPEC.num_kv_heads, SPEC.head_dim)
    expected = [(torch.empty(shape), torch.empty(shape)) for _ in range(SPEC.num_layers)]
    # irregular chunks, each straddling at least one unit boundary where possible
    bounds = sorted({0, n, *[min(n, max(1, i * unit - 1)) for i in range(1, 4)],
                     *[min(n, i * unit + 2) for i in range(1, 4)]})
    for a, b in zip(bounds, bounds[1:]):
        for layer, (k, v) in enumerate(write_all_layers(cache, 7, a, b - a, gen)):
            expected[layer][0][a:b] = k
            expected[layer][1][a:b] = v
    assert_data(cache, 7, expected)
    # one write spanning two boundaries, overwriting the middle
    a = max(0, unit - 2)
    b = min(n, 2 * unit + 2)
    for layer, (k, v) in enumerate(write_all_layers(cache, 7, a, b - a, gen)):
        expected[layer][0][a:b] = k
        expected[layer][1][a:b] = v
    assert_data(cache, 7, expected)
    cache.check_integrity()
    check_usage(cache, {7: n})


def test_write_casts_other_float_dtypes(cache, gen):
    cache.allocate(1, 5)
    k, v = rand_kv(gen, 5)
    cache.write(1, 1, 0, k.double(), v.double())
    kg, vg = cache.gather(1, 1)
    assert kg.dtype == SPEC.dtype
    torch.testing.assert_close(kg, k, rtol=0, atol=0)
    torch.testing.assert_close(vg, v, rtol=0, atol=0)


def test_sequences_are_isolated(cache, gen):
    lens = {1: 9, 2: 23, 3: 1}
    data = {}
    for s, n in lens.items():
        cache.allocate(s, n)
        data[s] = write_all_layers(cache, s, 0, n, gen)
    for s in lens:
        assert_data(cache, s, data[s])
    check_usage(cache, lens)


def test_fork_copy_on_write(cache, gen):
    unit = unit_of(cache)
    n = unit + unit // 2 + 1  # a full unit and a partial one
    cache.allocate(1, n)
    parent = write_all_layers(cache, 1, 0, n, gen)
    cow0 = cache.usage().num_cow_copies
    cache.fork(1, 2)
    assert cache.seq_len(2) == n
    assert_data(cache, 2, parent)
    check_usage(cache, {1: n, 2: n}, shared=True)
    # child writes into the shared full unit and the shared partial unit
    child_p0 = write_all_layers(cache, 2, 0, 1, gen)
    child_last = write_all_layers(cache, 2, n - 1, 1, gen)
    assert cache.usage().num_cow_copies > cow0
    # parent writes elsewhere in both units
    parent_p1 = write_all_layers(cache, 1, 1, 1, gen)
    parent_mid = write_all_layers(cache, 1, n - 2, 1, gen)
    cache.check_integrity()
    for layer in range(SPEC.num_layers):
        kp, vp = cache.gather(1, layer)
        kc, vc = cache.gather(2, layer)
        exp_p = parent[layer][0].clone()
        exp_p[1] = parent_p1[layer][0][0]
        exp_p[n - 2] = parent_mid[layer][0][0]
        exp_c = parent[layer][0].clone()
        exp_c[0] = child_p0[layer][0][0]
        exp_c[n - 1] = child_last[layer][0][0]
        torch.testing.assert_close(kp, exp_p, rtol=0, atol=0)
        torch.testing.assert_close(kc, exp_c, rtol=0, atol=0)
        # positions nobody rewrote still read the shared prefix on both sides
        untouched = [p for p in range(n) if p not in (0, 1, n - 2, n - 1)]
        torch.testing.assert_close(vp[untouched], parent[layer][1][untouched], rtol=0, atol=0)
        torch.testing.assert_close(vc[untouched], parent[layer][1][untouched], rtol=0, atol=0)
        assert torch.equal(vp[0], parent[layer][1][0]) and torch.equal(vc[1], parent[layer][1][1])
    # both sides grow independently
    grow = min(unit, cache.max_model_len - n)
    cache.extend(1, 3)
    cache.extend(2, grow)
    tail_p = write_all_layers(cache, 1, n, 3, gen)
    tail_c = write_all_layers(cache, 2, n, grow, gen)
    assert_data(cache, 1, tail_p, n)
    assert_data(cache, 2, tail_c, n)
    check_usage(cache, {1: n + 3, 2: n + grow}, shared=True)
    # freeing the parent leaves the child whole
    before_free = gather_all(cache, 2)
    cache.free(1)
    cache.check_integrity()
    for layer, (k, v) in enumerate(before_free):
        kc, vc = cache.gather(2, layer)
        assert torch.equal(kc, k) and torch.equal(vc, v)
    check_usage(cache, {2: n + grow})
    cache.free(2)
    check_usage(cache, {})


def test_fork_of_fork_and_free_child(cache, gen):
    cache.allocate(1, 6)
    data = write_all_layers(cache, 1, 0, 6, gen)
    cache.fork(1, 2)
    cache.fork(2, 3)
    write_all_layers(cache, 3, 5, 1, gen)
    cache.free(2)
    cache.free(3)
    assert_data(cache, 1, data)
    check_usage(cache, {1: 6})


def test_free_returns_memory(cache, gen):
    u0 = cache.usage()
    lens = {1: 5, 2: 17, 3: 33}
    for s, n in lens.items():
        cache.allocate(s, n)
        write_all_layers(cache, s, 0, n, gen)
    cache.fork(3, 4)
    write_all_layers(cache, 4, 0, 2, gen)
    assert cache.usage().allocated_bytes > 0
    assert cache.usage().free_tokens <= u0.free_tokens
    keep = gather_all(cache, 2)
    for s in (1, 3, 4):
        cache.free(s)
        assert not cache.has_seq(s)
        cache.check_integrity()
    check_usage(cache, {2: 17})
    for layer, (k, v) in enumerate(keep):
        assert torch.equal(cache.gather(2, layer)[0], k) and torch.equal(cache.gather(2, layer)[1], v)
    cache.free(2)
    u = check_usage(cache, {})
    assert (u.num_seqs, u.used_tokens, u.allocated_bytes, u.waste_bytes) == (0, 0, 0, 0)
    assert u.free_tokens == u0.free_tokens
    assert cache.can_allocate(min(u0.free_tokens, cache.max_model_len))


def test_full_capacity_again_after_free_all(cache, gen):
    free0 = cache.usage().free_tokens
    total = pool_tokens(cache)
    assert total >= free0 > 0
    # a fresh cache backs its whole budget (max_model_len is a multiple of the unit here)
    for s in allocate_capacity(cache, total, first_id=500):
        cache.free(s)
    # churn: sequences of odd lengths, forks, growth
    for s, n in enumerate([3, 21, 9, 40], start=1):
        cache.allocate(s, n)
        write_all_layers(cache, s, 0, n, gen)
    cache.fork(2, 10)
    cache.extend(10, 5)
    write_all_layers(cache, 10, 0, 26, gen)
    for s in (1, 2, 3, 4, 10):
        if cache.has_seq(s):
            cache.free(s)
    assert cache.usage().free_tokens == free0
    ids = allocate_capacity(cache, total, first_id=50)
    assert cache.usage().free_tokens == 0 and not cache.can_allocate(1)
    check_usage(cache, {s: cache.seq_len(s) for s in ids})
    for s in ids:
        cache.free(s)
    check_usage(cache, {})
    cache.check_integrity()


# ----------------------------------------------------------------------------- full cache
def test_allocate_when_full_raises_and_changes_nothing(cache, gen):
    data = fill(cache, gen)
    assert not cache.can_allocate(1)
    snap = snapshot(cache, data)
    n = min(cache.max_model_len, 2 * unit_of(cache))
    with pytest.raises(KVCacheFullError) as info:
        cache.allocate(1, n)
    err = info.value
    assert err.needed_tokens > 0 and 0 <= err.available_tokens < err.needed_tokens
    assert str(err.needed_tokens) in str(err)
    assert_unchanged(cache, snap, extra_absent=[1])
    for s, d in data.items():
        assert_data(cache, s, d)
    check_usage(cache, {s: cache.seq_len(s) for s in data})


def exact(case):
    """``case`` without look-ahead mapping: every backed position is one a sequence asked for, so
    a full cache has no slack and every growth or copy must raise."""
    return dataclasses.replace(case, options={k: v for k, v in case.options.items()
                                              if k != "lookahead_tokens"})


def test_extend_when_full_raises_and_changes_nothing(case, gen):
    with exact(case).make() as cache:
        data = fill(cache, gen)
        victim = next(iter(data))
        n = cache.seq_len(victim)
        more = cache.max_model_len - n
        snap = snapshot(cache, data)
        slack_tokens = snap[0].waste_bytes // SPEC.bytes_per_token   # unit tails, all sequences
        assert more > slack_tokens, "test config: the extend must need memory"
        with pytest.raises(KVCacheFullError) as err:
            cache.extend(victim, more)
        assert err.value.needed_tokens > 0
        assert 0 <= err.value.available_tokens < err.value.needed_tokens
        assert_unchanged(cache, snap)
        # the sequence still works
        write_all_layers(cache, victim, n - 1, 1, gen)
        cache.check_integrity()


def test_fork_when_full(case, gen):
    """In a full cache a fork still succeeds (it shares everything, no memory); then a write or
    an extend that needs a copy-on-write copy raises KVCacheFullError changing nothing; after
    the child is freed everything is as before."""
    with exact(case).make() as cache:
        data = fill(cache, gen)
        parent = next(iter(data))
        n = cache.seq_len(parent)
        assert n % unit_of(cache) != 0, "test wants a partial last unit"
        cache.fork(parent, 1)
        assert cache.seq_len(1) == n
        assert_data(cache, 1, data[parent])
        forked = snapshot(cache, [*data, 1])
        with pytest.raises(KVCacheFullError):
            write_all_layers(cache, 1, n - 1, 1, gen)    # the shared partial unit needs a copy
        assert_unchanged(cache, forked)
        with pytest.raises(KVCacheFullError) as err:
            cache.extend(1, 1)   # position n lies in the shared partial unit
        assert 0 <= err.value.available_tokens < err.value.needed_tokens
        assert_unchanged(cache, forked)
        cache.free(1)
        cache.check_integrity()
        for s, d in data.items():
            assert_data(cache, s, d)
        check_usage(cache, {s: cache.seq_len(s) for s in data})


def test_extend_into_shared_unit_counts_the_copy(case, gen):
    """extend() into a shared partial unit needs a copy-on-write copy plus any new unit; the
    error reports more needed than available, and a successful extend makes every later write
    below seq_len possible with no free memory left."""
    case = exact(case)              # counts exact units: no pages mapped ahead
    probe = case.make()
    unit = unit_of(probe)
    probe.close()
    cache = case.make(capacity_tokens=4 * unit)
    try:
        half = unit // 2
        cache.allocate(1, half)
        a = write_all_layers(cache, 1, 0, half, gen)
        cache.fork(1, 2)
        assert cache.usage().waste_bytes == SPEC.kv_bytes(unit - half)
        cache.allocate(3, 2 * unit)
        write_all_layers(cache, 3, 0, 2 * unit, gen)
        # one unit free: the copy of the shared unit and one new unit do not fit
        snap = snapshot(cache, [1, 2, 3])
        with pytest.raises(KVCacheFullError) as info:
            cache.extend(2, unit - half + 1)
        assert 0 <= info.value.available_tokens < info.value.needed_tokens, str(info.value)
        assert_unchanged(cache, snap)
        # the copy alone fits
        cache.extend(2, unit - half)
        assert not cache.can_allocate(1)
        mine = write_all_layers(cache, 2, 0, unit, gen)
        assert_data(cache, 2, mine)
        assert_data(cache, 1, a)
        cache.check_integrity()
        check_usage(cache, {1: half, 2: unit, 3: 2 * unit})
    finally:
        cache.close()


def test_too_many_sequences(case, gen):
    cache = case.make(capacity_tokens=case.max_num_seqs * case.max_model_len)
    try:
        for s in range(cache.max_num_seqs):
            cache.allocate(s, 2)
            write_all_layers(cache, s, 0, 2, gen)
        assert not cache.can_allocate(1)
        snap = snapshot(cache, range(cache.max_num_seqs))
        # base.py: allocate raises ValueError ("too many sequences"), fork KVCacheFullError (no slot)
        with pytest.raises(ValueError):
            cache.allocate(1000, 1)
        assert_unchanged(cache, snap, extra_absent=[1000])
        with pytest.raises(KVCacheFullError):
            cache.fork(0, 1000)
        assert_unchanged(cache, snap, extra_absent=[1000])
        cache.free(3)
        assert cache.can_allocate(1)
        cache.fork(0, 1000)
        check_usage(cache, {s: 2 for s in [*range(cache.max_num_seqs), 1000] if s != 3}, shared=True)
    finally:
        cache.close()


# ----------------------------------------------------------------------------- error cases
def test_unknown_sequence_errors(cache, gen):
    cache.allocate(1, 4)
    write_all_layers(cache, 1, 0, 4, gen)
    snap = snapshot(cache, [1])
    k, v = rand_kv(gen, 1)
    calls = [
        lambda: cache.seq_len(99),
        lambda: cache.extend(99, 1),
        lambda: cache.free(99),
        lambda: cache.fork(99, 100),
        lambda: cache.write(99, 0, 0, k, v),
        lambda: cache.gather(99, 0),
        lambda: cache.prepare([StepSeq(99, 0, 1)]),
        lambda: cache.prepare([StepSeq(1, 0, 1), StepSeq(99, 0, 1)]),
    ]
    for call in calls:
        with pytest.raises(UnknownSequenceError) as info:
            call()
        assert isinstance(info.value, KVCacheError) and "99" in str(info.value)
        assert_unchanged(cache, snap, extra_absent=[99, 100])
    assert not cache.has_seq(99)
    cache.free(1)
    with pytest.raises(UnknownSequenceError):
        cache.free(1)
    with pytest.raises(UnknownSequenceError):
        cache.gather(1, 0)


def test_duplicate_sequence_errors(cache, gen):
    cache.allocate(1, 4)
    cache.allocate(2, 3)
    write_all_layers(cache, 1, 0, 4, gen)
    snap = snapshot(cache, [1, 2])
    for call in (lambda: cache.allocate(1, 2), lambda: cache.fork(1, 2), lambda: cache.fork(1, 1)):
        with pytest.raises(DuplicateSequenceError) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, KVCacheError)
        assert_unchanged(cache, snap)


def test_value_errors_change_nothing(cache, gen):
    mml = cache.max_model_len
    cache.allocate(1, 6)
    data = write_all_layers(cache, 1, 0, 6, gen)
    snap = snapshot(cache, [1])
    k1, v1 = rand_kv(gen, 1)
    k3, v3 = rand_kv(gen, 3)
    bad_heads = torch.randn(3, SPEC.num_kv_heads + 1, SPEC.head_dim)
    meta = cache.prepare([StepSeq(1, 6 - 3, 3)])
    snap = snapshot(cache, [1])
    calls = [
        lambda: cache.allocate(2, 0),
        lambda: cache.allocate(2, mml + 1),
        lambda: cache.allocate(2, 5, token_ids=[1, 2]),
        lambda: cache.extend(1, mml),
        lambda: cache.extend(1, -1),
        lambda: cache.write(1, 0, 4, k3, v3),             # 4 + 3 > seq_len 6
        lambda: cache.write(1, 0, -1, k1, v1),
        lambda: cache.write(1, 0, 0, bad_heads, bad_heads),
        lambda: cache.write(1, SPEC.num_layers, 0, k1, v1),
        lambda: cache.write(1, -1, 0, k1, v1),
        lambda: cache.gather(1, SPEC.num_layers),
        lambda: cache.prepare([]),
        lambda: cache.prepare([StepSeq(1, 4, 3)]),        # 4 + 3 > seq_len 6
        lambda: cache.prepare([StepSeq(1, 0, 0)]),
        lambda: cache.write_kv(0, k1, v1, meta),           # meta has 3 tokens
        lambda: cache.write_kv(SPEC.num_layers, k3, v3, meta),
        lambda: cache.write_kv(0, bad_heads, bad_heads, meta),
        lambda: cache.attention(0, torch.randn(3, SPEC.num_kv_heads + 1, SPEC.head_dim), meta),
        lambda: cache.attention(SPEC.num_layers, torch.randn(3, NUM_HEADS, SPEC.head_dim), meta),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(ValueError):
            call()
        try:
            assert_unchanged(cache, snap, extra_absent=[2])
        except AssertionError as e:
            raise AssertionError(f"call #{i} changed the cache: {e}") from e
    assert_data(cache, 1, data)


def test_close_is_idempotent(case):
    c = case.make()
    c.allocate(1, 3)
    c.close()
    c.close()
    with case.make() as c2:
        assert c2.allocate(1, 3) == 0


def test_backend_stats_is_a_dict_of_plain_values(cache, gen):
    cache.allocate(1, 5)
    write_all_layers(cache, 1, 0, 5, gen)
    stats = cache.backend_stats()
    assert isinstance(stats, dict) and stats
    assert all(isinstance(k, str) and isinstance(v, (int, float, str)) for k, v in stats.items())
    assert stats["num_cow_copies"] == cache.usage().num_cow_copies


def test_backend_samples_are_lists_of_floats_counted_by_backend_stats(cache, gen):
    """``backend_samples()``: raw samples by name, each list no longer than its ``num_*`` counter in
    ``backend_stats()`` (vmem: one ``map_us`` per mapped page; paged keeps none)."""
    cache.allocate(1, 5)
    write_all_layers(cache, 1, 0, 5, gen)
    cache.extend(1, 40)
    samples, stats = cache.backend_samples(), cache.backend_stats()
    assert isinstance(samples, dict)
    assert all(isinstance(k, str) and isinstance(v, list) for k, v in samples.items())
    assert all(isinstance(x, float) for v in samples.values() for x in v)
    counters = {"map_us": "num_maps", "unmap_us": "num_unmaps"}
    assert set(samples) <= set(counters)
    for key, values in samples.items():
        assert len(values) <= stats[counters[key]]
    if "num_maps" in stats:
        assert len(samples["map_us"]) == stats["num_maps"] > 0
    else:
        assert samples == {}


# ----------------------------------------------------------------------------- prefix caching
def _prefix_unit(cache) -> int:
    unit = cache.usage().unit_tokens
    if unit == 0:
        pytest.skip("backend reports a fractional unit: prefix caching disabled")
    return unit


def _prefill(cache, seq_id, n, gen, start=0):
    """Run one step that computes positions ``start..n-1`` on every layer; returns the K/V."""
    meta = cache.prepare([StepSeq(seq_id, start, n - start)])
    out = []
    for layer in range(SPEC.num_layers):
        k, v = rand_kv(gen, n - start)
        cache.write_kv(layer, k, v, meta)
        out.append((k, v))
    return out


def test_prefix_cache_hit(cache, gen):
    unit = _prefix_unit(cache)
    n = min(cache.max_model_len, 2 * unit + unit // 2)
    tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
    assert cache.allocate(1, n, token_ids=tokens) == 0
    a = _prefill(cache, 1, n, gen)
    u0 = cache.usage()
    hit = cache.allocate(2, n, token_ids=tokens)
    assert hit == (n - 1) // unit * unit and 0 < hit < n and hit % unit == 0
    u1 = cache.usage()
    assert u1.prefix_hit_tokens - u0.prefix_hit_tokens == hit
    assert hit <= u1.prefix_query_tokens - u0.prefix_query_tokens <= n
    assert cache.seq_len(2) == n
    for layer in range(SPEC.num_layers):
        k, v = cache.gather(2, layer)
        torch.testing.assert_close(k[:hit], a[layer][0][:hit], rtol=0, atol=0)
        torch.testing.assert_close(v[:hit], a[layer][1][:hit], rtol=0, atol=0)
    # the second sequence computes only its tail; the first is untouched
    b_tail = _prefill(cache, 2, n, gen, start=hit)
    assert_data(cache, 2, b_tail, hit)
    assert_data(cache, 1, a)
    cache.check_integrity()
    check_usage(cache, {1: n, 2: n}, shared=True)
    held = cache.usage().allocated_bytes - cache.usage().waste_bytes
    assert held <= SPEC.kv_bytes(2 * n - hit), "hit units must be shared, not copied"


def test_prefix_cache_miss_on_different_tokens(cache, gen):
    unit = _prefix_unit(cache)
    n = min(cache.max_model_len, 2 * unit + unit // 2)
    tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
    cache.allocate(1, n, token_ids=tokens)
    _prefill(cache, 1, n, gen)
    # never seen: no hit
    assert cache.allocate(2, n, token_ids=[t + 1 for t in tokens]) == 0
    cache.free(2)
    # first token differs: the chained hash differs for every unit
    assert cache.allocate(3, n, token_ids=[tokens[0] + 1, *tokens[1:]]) == 0
    cache.free(3)
    # diverges inside the second unit: only the first unit hits
    if n - 1 > unit:
        other = list(tokens)
        other[unit] += 1
        assert cache.allocate(4, n, token_ids=other) == unit
        cache.free(4)
    # no token ids: prefix caching off for this sequence
    assert cache.allocate(5, n) == 0
    cache.free(5)
    # a prompt of at most one unit never hits (the last prompt token is always computed)
    short = min(unit, n)
    assert cache.allocate(6, short, token_ids=tokens[:short]) == 0
    cache.check_integrity()


def test_prefix_cache_extra_key(cache, gen):
    unit = _prefix_unit(cache)
    if "extra_key" not in inspect.signature(cache.allocate).parameters:
        pytest.skip("allocate() takes no extra_key")
    n = min(cache.max_model_len, 2 * unit + 1)
    tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
    cache.allocate(1, n, token_ids=tokens, extra_key="tenant-a")
    _prefill(cache, 1, n, gen)
    assert cache.allocate(2, n, token_ids=tokens, extra_key="tenant-b") == 0
    assert cache.allocate(3, n, token_ids=tokens, extra_key="tenant-a") == (n - 1) // unit * unit


def test_prefix_hit_is_copy_on_write(cache, gen):
    unit = _prefix_unit(cache)
    n = min(cache.max_model_len, 2 * unit + 1)
    tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
    cache.allocate(1, n, token_ids=tokens)
    a = _prefill(cache, 1, n, gen)
    hit = cache.allocate(2, n, token_ids=tokens)
    assert hit > 0
    cow0 = cache.usage().num_cow_copies
    mine = write_all_layers(cache, 2, 0, 1, gen)     # into a shared, prefix-cached unit
    assert cache.usage().num_cow_copies > cow0
    assert_data(cache, 1, a)
    assert_data(cache, 2, mine, 0)
    for layer in range(SPEC.num_layers):
        k, _ = cache.gather(2, layer)
        torch.testing.assert_close(k[1:hit], a[layer][0][1:hit], rtol=0, atol=0)
    cache.check_integrity()


def test_cached_prefix_survives_other_requests_while_memory_is_free(cache, gen):
    """Issue 9: asked, freed, other requests (sharing its first unit, or nothing, alone and two at
    a time) come and go with free memory left; re-asking the prompt hits every full unit."""
    unit = _prefix_unit(cache)
    n = min(cache.max_model_len, 3 * unit + 1)
    full = (n - 1) // unit * unit
    prompt = torch.randint(0, 1000, (n,), generator=gen).tolist()
    cache.allocate(1, n, token_ids=prompt)
    a = _prefill(cache, 1, n, gen)
    cache.free(1)
    sid = 2

    def ask(*tails):
        nonlocal sid
        ids = []
        for tail in tails:
            tokens = (prompt[:unit] + tail)[:n] if tail[0] >= 0 else [t + 5000 for t in tail[1:]][:n]
            hit = cache.allocate(sid, len(tokens), token_ids=tokens)
            _prefill(cache, sid, len(tokens), gen, start=hit)
            ids.append(sid)
            sid += 1
        assert cache.usage().free_tokens > 0
        for s in ids:
            cache.free(s)

    other = [torch.randint(0, 1000, (n,), generator=gen).tolist() for _ in range(4)]
    ask(other[0])                                    # shares the first unit
    ask([-1] + other[1])                             # shares nothing
    ask(other[2], [-1] + other[3])                   # two at a time
    ask(other[3])
    u0 = cache.usage()
    assert cache.allocate(sid, n, token_ids=prompt) == full
    assert cache.usage().prefix_hit_tokens - u0.prefix_hit_tokens == full
    assert_data(cache, sid, [(k[:full], v[:full]) for k, v in a])
    cache.check_integrity()


def test_free_unwritten_drops_only_the_prefix_units_it_registered(cache, gen):
    """prepare() registers a step's full prompt units before the forward writes them; when the
    forward fails, ``free(seq, written=False)`` drops them (the units the sequence found at
    allocate, written by an earlier request, stay cached)."""
    unit = _prefix_unit(cache)
    n = min(cache.max_model_len, 3 * unit + 1)
    prompt = torch.randint(0, 1000, (n,), generator=gen).tolist()
    cache.allocate(1, unit + 1, token_ids=prompt[:unit + 1])
    first = _prefill(cache, 1, unit + 1, gen)
    cache.free(1)
    assert cache.allocate(2, n, token_ids=prompt) == unit
    cache.prepare([StepSeq(2, unit, n - unit)])       # registers units 1.. as written; then the
    cache.free(2, written=False)                        # forward fails: nothing was written
    cache.check_integrity()
    assert cache.allocate(3, n, token_ids=prompt) == unit
    assert_data(cache, 3, [(k[:unit], v[:unit]) for k, v in first])
    rest = _prefill(cache, 3, n, gen, start=unit)       # a normal run registers them again
    cache.free(3)
    full = (n - 1) // unit * unit
    assert cache.allocate(4, n, token_ids=prompt) == full
    assert_data(cache, 4, [(k[:full - unit], v[:full - unit]) for k, v in rest], start=unit)
    cache.check_integrity()


def test_failed_allocate_counts_no_prefix_lookup(cache, gen):
    """A lookup is counted once per successful allocate: one that raises KVCacheFullError (after
    finding hits) changes nothing, statistics included; the retry that succeeds counts once."""
    unit = _prefix_unit(cache)
    n = min(cache.max_model_len, 2 * unit + 1)
    prompt = torch.randint(0, 1000, (n,), generator=gen).tolist()
    cache.allocate(1, n, token_ids=prompt)
    _prefill(cache, 1, n, gen)
    fill(cache, gen)
    snap = snapshot(cache, [1])
    for attempt in range(3):
        with pytest.raises(KVCacheFullError):
            cache.allocate(2, n, token_ids=prompt)
        assert_unchanged(cache, snap, extra_absent=[2])
    cache.free(100)
    u0 = cache.usage()
    hit = cache.allocate(2, n, token_ids=prompt)
    assert hit == (n - 1) // unit * unit
    u1 = cache.usage()
    assert (u1.prefix_query_tokens - u0.prefix_query_tokens, u1.prefix_hit_tokens - u0.prefix_hit_tokens) \
        == (n, hit)
    cache.check_integrity()


# ----------------------------------------------------------------------------- per-step path
def _check_attention(cache, meta, q_by_layer, gen, scale=None):
    """attention() equals the per-sequence reference on gathered K/V, for every layer."""
    qsl = meta.query_start_loc.tolist()
    for layer, q in enumerate(q_by_layer):
        out = cache.attention(layer, q, meta) if scale is None else cache.attention(layer, q, meta, scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        for i, sid in enumerate(meta.seq_ids):
            end = meta.seq_lens_host[i]
            ctx = end - meta.query_lens_host[i]
            k, v = cache.gather(sid, layer)
            ref = attention_one_seq_ref(q[qsl[i]:qsl[i + 1]], k[:end], v[:end], ctx,
                                        scale if scale is not None else SPEC.head_dim ** -0.5)
            torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, rtol=1e-5, atol=1e-5)


def test_step_mixed_batch(cache, gen):
    unit = unit_of(cache)
    # A: chunked prefill continuing from 24 cached tokens; B: fresh prefill;
    # C: decode at 30; D: decode crossing into a new unit
    cache.allocate(1, 40)
    ctx_a = write_all_layers(cache, 1, 0, 24, gen)
    cache.allocate(2, 20)
    cache.allocate(3, 30)
    write_all_layers(cache, 3, 0, 30, gen)
    cache.extend(3, 1)
    len_d = min(unit, cache.max_model_len - 1)
    cache.allocate(4, len_d)
    write_all_layers(cache, 4, 0, len_d, gen)
    cache.extend(4, 1)
    batch = [StepSeq(3, 30, 1), StepSeq(1, 24, 16), StepSeq(4, len_d, 1), StepSeq(2, 0, 20)]
    meta = cache.prepare(batch)

    qlens = [1, 16, 1, 20]
    seq_lens = [31, 40, len_d + 1, 20]
    ctx = [30, 24, len_d, 0]
    positions = [30, *range(24, 40), len_d, *range(20)]
    assert meta.seq_ids == [3, 1, 4, 2]
    assert meta.num_seqs == 4 and meta.num_tokens == 38
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == [0, 1, 17, 18, 38]
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == seq_lens
    assert meta.context_lens.dtype == torch.int32 and meta.context_lens.tolist() == ctx
    assert meta.positions.dtype == torch.int64 and meta.positions.tolist() == positions
    assert meta.last_token_indices.dtype == torch.int64 and meta.last_token_indices.tolist() == [0, 16, 17, 37]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.shape == (38,)
    assert len(set(meta.slot_mapping.tolist())) == 38, "two new tokens write the same place"
    assert meta.max_query_len == 20 and meta.max_seq_len == max(seq_lens)
    assert meta.is_decode is False
    assert meta.seq_lens_host == seq_lens and meta.query_lens_host == qlens
    if cache.backend == "paged":
        bt = meta.block_tables
        assert bt is not None and bt.dtype == torch.int32 and bt.shape[0] == 4
        assert bt.shape[1] >= -(-max(seq_lens) // unit)
    else:
        si = meta.slot_indices
        assert si is not None and si.dtype == torch.int32 and si.shape == (4,)
        assert len(set(si.tolist())) == 4 and all(0 <= s < cache.max_num_seqs for s in si.tolist())

    new_kv, qs = [], []
    for layer in range(SPEC.num_layers):
        k, v = rand_kv(gen, 38)
        cache.write_kv(layer, k, v, meta)
        new_kv.append((k, v))
        qs.append(torch.randn(38, NUM_HEADS, SPEC.head_dim, generator=gen))
    # the step wrote each token at its sequence position
    qsl = meta.query_start_loc.tolist()
    for i, e in enumerate(batch):
        part = [(k[qsl[i]:qsl[i + 1]], v[qsl[i]:qsl[i + 1]]) for k, v in new_kv]
        assert_data(cache, e.seq_id, part, e.num_computed_tokens)
    assert_data(cache, 1, ctx_a, 0)
    _check_attention(cache, meta, qs, gen)
    _check_attention(cache, meta, qs, gen, scale=0.3)
    check_usage(cache, {1: 40, 2: 20, 3: 31, 4: len_d + 1})
    cache.check_integrity()


def test_decode_steps_across_unit_boundary(cache, gen):
    unit = unit_of(cache)
    lens = {1: max(1, min(unit - 2, cache.max_model_len - 6)), 2: 5}
    for s, n in lens.items():
        cache.allocate(s, n)
        _prefill(cache, s, n, gen)
    for _ in range(4):
        for s in lens:
            cache.extend(s, 1)
        meta = cache.prepare([StepSeq(s, n, 1) for s, n in lens.items()])
        assert meta.is_decode is True and meta.max_query_len == 1
        assert meta.positions.tolist() == list(lens.values())
        assert meta.last_token_indices.tolist() == [0, 1]
        qs = []
        for layer in range(SPEC.num_layers):
            k, v = rand_kv(gen, 2)
            cache.write_kv(layer, k, v, meta)
            for i, s in enumerate(lens):
                kg, vg = cache.gather(s, layer)
                assert torch.equal(kg[lens[s]], k[i]) and torch.equal(vg[lens[s]], v[i])
            qs.append(torch.randn(2, NUM_HEADS, SPEC.head_dim, generator=gen))
        _check_attention(cache, meta, qs, gen)
        lens = {s: n + 1 for s, n in lens.items()}
    check_usage(cache, lens)
    cache.check_integrity()


def test_step_on_forked_sequences_is_copy_on_write(cache, gen):
    n = unit_of(cache) + 3
    cache.allocate(1, n)
    base = _prefill(cache, 1, n, gen)
    cache.fork(1, 2)
    cache.extend(1, 1)
    cache.extend(2, 1)
    # both decode into the shared partial unit in one step; then the child rewrites position 0
    meta = cache.prepare([StepSeq(1, n, 1), StepSeq(2, n, 1)])
    new = []
    for layer in range(SPEC.num_layers):
        k, v = rand_kv(gen, 2)
        cache.write_kv(layer, k, v, meta)
        new.append((k, v))
    for i, s in enumerate((1, 2)):
        assert_data(cache, s, base, 0)
        assert_data(cache, s, [(k[i:i + 1], v[i:i + 1]) for k, v in new], n)
    meta = cache.prepare([StepSeq(2, 0, 1)])
    child0 = []
    for layer in range(SPEC.num_layers):
        k, v = rand_kv(gen, 1)
        cache.write_kv(layer, k, v, meta)
        child0.append((k, v))
    assert_data(cache, 2, child0, 0)
    assert_data(cache, 1, base, 0)
    cache.check_integrity()
    check_usage(cache, {1: n + 1, 2: n + 1}, shared=True)
