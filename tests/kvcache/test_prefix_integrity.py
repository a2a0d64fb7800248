"""Prefix-cache integrity: a hash is a lookup key, never proof (issue 9).

The unit hash is 256-bit sha256 over a typed, length-prefixed encoding; every hit is verified
against the unit's token ids, extra key and parent entry (``vmkv.kvcache.prefix.PrefixIndex``, the
one place both backends use).  Collisions are injected by replacing ``hashing.hash_unit_bytes``
(what ``unit_keys`` calls for every unit) with a constant: every unit of every prompt then lands in
one bucket, and each backend must still serve every sequence only its own K/V, stay consistent and
raise nothing.  Each test that injects asserts ``num_collisions``, so the injection cannot silently
stop reaching the code (the state machine's once did: tests/kvcache/test_kvcache_statemachine.py).
"""

from __future__ import annotations

import pytest
import torch

from kvcache_cases import CASE_IDS, CASES, SPEC, gather_all, one_torch_thread, rand_kv
from vmkv import StepSeq
from vmkv.kvcache import hashing as hashing_mod
from vmkv.kvcache.prefix import (
    HASH_BYTES,
    ROOT_HASH,
    PrefixChain,
    PrefixIndex,
    encode_extra_key,
    extra_key_digest,
    hash_unit,
    unit_keys,
)

COLLIDING = b"\x5a" * HASH_BYTES


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture
def collide(monkeypatch):
    """Every unit hash is the same value: every lookup hits a bucket of strangers (``unit_keys`` and
    ``hash_unit`` both hash through ``hash_unit_bytes``)."""
    monkeypatch.setattr(hashing_mod, "hash_unit_bytes", lambda *args, **kw: COLLIDING)


# ----------------------------------------------------------------------------- hashing
def test_hash_is_sha256_of_an_unambiguous_encoding():
    keys = unit_keys([1, 2, 3, 4, 5], 2, extra_key="t")
    assert len(keys) == 2 and all(len(k.hash) == HASH_BYTES == 32 for k in keys)
    assert keys[0].token_ids == (1, 2) and keys[1].token_ids == (3, 4)
    assert keys[0].hash == hash_unit(ROOT_HASH, (1, 2), extra_key_digest("t"))
    assert keys[1].hash == hash_unit(keys[0].hash, (3, 4), extra_key_digest("t"))     # chained
    assert unit_keys([1, 2, 3, 4, 5], 2, extra_key="t") == keys                        # deterministic
    assert unit_keys([1, 2, 9, 4], 2, extra_key="t")[0] == keys[0]
    assert unit_keys([1, 2, 9, 4], 2, extra_key="t")[1].hash != keys[1].hash


@pytest.mark.parametrize("a, b", [
    (1, True), (1, 1.0), (1, "1"), ("1", b"1"), (0, False), (None, "None"), (None, ()),
    (("a", "b"), ("ab",)), (("a", ("b",)), (("a",), "b")), ((1, 2), "(1, 2)"), ("", b""),
    (-1, 255), (0.0, -0.0),
])
def test_extra_keys_of_other_types_or_values_never_share_a_hash(a, b):
    assert encode_extra_key(a) != encode_extra_key(b)
    assert unit_keys([7, 7], 2, a)[0].hash != unit_keys([7, 7], 2, b)[0].hash


def test_extra_key_and_token_validation():
    with pytest.raises(TypeError, match="extra_key must be None, bool, int, float, str, bytes"):
        unit_keys([1, 2], 2, extra_key=["a list"])
    with pytest.raises(ValueError, match="NaN"):
        encode_extra_key(float("nan"))
    with pytest.raises(ValueError, match="int64"):
        unit_keys([1, 1 << 63], 2)
    with pytest.raises(ValueError, match="unit_tokens"):
        unit_keys([1, 2], 0)
    # a token count is in the hash: a unit is never confused with a longer one sharing its bytes
    assert hash_unit(ROOT_HASH, (1,), b"N") != hash_unit(ROOT_HASH, (1, 0), b"N")


def test_a_long_extra_key_is_hashed_once_per_call_not_once_per_unit(monkeypatch):
    """A 7 MB ``cache_salt`` used to be fed into every unit's sha256 (seconds per allocate on the
    engine thread); now its typed encoding is digested once and each unit hashes 32 bytes of it."""
    fed: list[int] = []
    real = hashing_mod.hashlib.sha256

    class _Counting:
        def __init__(self, data=b""):
            self._h = real(data)
            fed.append(len(data))

        def update(self, data):
            fed.append(len(data))
            self._h.update(data)

        def digest(self):
            return self._h.digest()

    monkeypatch.setattr(hashing_mod.hashlib, "sha256", _Counting)
    tokens = list(range(64))
    small, huge = "s", "x" * (1 << 20)
    unit_keys(tokens, 2, small)
    small_bytes = sum(fed)
    fed.clear()
    keys = unit_keys(tokens, 2, huge)
    assert len(keys) == 32
    assert sum(fed) - small_bytes == len(huge) - len(small)          # the salt's bytes, once
    assert max(len(k.extra) for k in keys) == HASH_BYTES             # verification compares 32 bytes


def test_different_salts_never_share_and_hits_are_verified_on_the_digest():
    index = PrefixIndex()
    a, b = "x" * 5000, "x" * 4999 + "y"
    _register_prompt(index, [1, 1, 2, 2], 2, 100, extra_key=a)
    assert [e.handles for e in index.match(unit_keys([1, 1, 2, 2], 2, a))] == [(100,), (101,)]
    assert index.match(unit_keys([1, 1, 2, 2], 2, b)) == []
    assert index.match(unit_keys([1, 1, 2, 2], 2, (a,))) == []
    assert extra_key_digest(a) != extra_key_digest(b) and len(extra_key_digest(a)) == HASH_BYTES


# ----------------------------------------------------------------------------- the index
def _register_prompt(index: PrefixIndex, tokens, unit, handle0, extra_key=None):
    chain = PrefixChain(unit_keys(tokens, unit, extra_key))
    chain.register_upto(len(tokens) // unit,
                        lambda key, parent, i: index.register(key, parent, (handle0 + i,)))
    return chain


def test_index_verifies_tokens_extra_key_and_parent_under_collisions(collide):
    index = PrefixIndex()
    a = [1, 1, 2, 2, 3, 3]
    _register_prompt(index, a, 2, handle0=100)                       # units 100, 101, 102
    assert len(index) == 3 and index.entry_of(101).depth == 1
    # same bucket, different tokens: a miss, counted as a collision
    assert index.match(unit_keys([9, 9, 2, 2], 2)) == []
    assert index.num_collisions == 1
    # the second unit matches a's second unit's tokens, but its parent is not a's first unit
    c = [8, 8, 2, 2, 3, 3]
    _register_prompt(index, c, 2, handle0=200)                       # lives beside a in the bucket
    assert len(index) == 6
    assert [e.handles for e in index.match(unit_keys(a, 2))] == [(100,), (101,), (102,)]
    assert [e.handles for e in index.match(unit_keys(c, 2))] == [(200,), (201,), (202,)]
    assert [e.handles for e in index.match(unit_keys([1, 1, 2, 2, 4, 4], 2))] == [(100,), (101,)]
    # other extra key: a miss
    assert index.match(unit_keys(a, 2, extra_key="tenant")) == []
    # a lookup changes nothing, and counts nothing until record()
    look = index.lookup(a + [5], 2)
    assert look.hit_tokens == 6 and index.num_query_tokens == 0
    index.record(look)
    assert (index.num_query_tokens, index.num_hit_tokens) == (7, 6)
    index.check_integrity()


def test_index_same_content_registers_once_and_drop_cascades():
    index = PrefixIndex()
    keys = unit_keys([1, 2, 3, 4, 5, 6], 2)
    e0 = index.register(keys[0], None, (10,))
    e1 = index.register(keys[1], e0, (11,))
    assert index.register(keys[0], None, (20,)) is e0              # same content: the first wins
    assert not index.is_cached(20)
    assert index.register(keys[1], e0, (11,)) is e1                # idempotent for its own handle
    assert index.register(keys[2], e0, (11,)) is None              # 11 caches other content
    e2 = index.register(keys[2], e1, (12,))
    # dropping the middle drops the descendants (they can never match without their parent)
    assert sorted(index.drop(11)) == [11, 12]
    assert not e1.alive and not e2.alive and e0.alive and e0.children == []
    assert index.register(keys[2], e1, (13,)) is None              # a broken chain registers nothing
    assert [e.handles for e in index.match(keys)] == [(10,)]
    assert index.drop(11) == [] and len(index) == 1
    index.check_integrity()
    assert index.clear() == 1 and not e0.alive and len(index) == 0
    index.check_integrity()


# ----------------------------------------------------------------------------- both backends
def _write_prompt(cache, seq_id, n, gen, start=0):
    """One prefill step over ``start..n-1``; returns the per-layer K/V written."""
    meta = cache.prepare([StepSeq(seq_id, start, n - start)])
    out = []
    for layer in range(SPEC.num_layers):
        k, v = rand_kv(gen, n - start)
        cache.write_kv(layer, k, v, meta)
        out.append((k, v))
    return out


def _assert_holds(cache, seq_id, data, start=0):
    for (k, v), (gk, gv) in zip(data, gather_all(cache, seq_id)):
        n = k.shape[0]
        assert torch.equal(gk[start:start + n], k) and torch.equal(gv[start:start + n], v), \
            f"sequence {seq_id} reads K/V it never wrote"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_injected_collision_never_shares_kv(case, collide):
    cache = case.make()
    try:
        unit = cache.usage().unit_tokens
        if unit == 0:
            pytest.skip("fractional unit: prefix caching off")
        gen = torch.Generator().manual_seed(9)
        n = min(cache.max_model_len, 3 * unit + 1)
        a = torch.randint(0, 1000, (n,), generator=gen).tolist()
        b = [t + 1000 for t in a]                   # every unit differs, every hash collides
        assert cache.allocate(1, n, a) == 0
        data_a = _write_prompt(cache, 1, n, gen)
        u0 = cache.usage()
        assert cache.allocate(2, n, b) == 0         # hash hits, tokens differ: a miss
        assert cache.prefix.num_collisions == 1     # the injection fired: b's first unit met a's
        u1 = cache.usage()
        assert u1.prefix_hit_tokens == u0.prefix_hit_tokens
        assert u1.prefix_query_tokens == u0.prefix_query_tokens + n
        data_b = _write_prompt(cache, 2, n, gen)
        _assert_holds(cache, 1, data_a)
        _assert_holds(cache, 2, data_b)
        cache.check_integrity()
        # a diverges from b only after its first unit: exactly one verified unit hits
        c = a[:unit] + b[unit:]
        hit_c = cache.allocate(3, n, c)
        assert hit_c == (unit if n - 1 >= unit else 0)
        _assert_holds(cache, 3, [(k[:hit_c], v[:hit_c]) for k, v in data_a])
        # both prompts are cached side by side in the colliding bucket, each for its own prompt
        cache.free(1)
        cache.free(2)
        full = (n - 1) // unit * unit
        assert cache.allocate(4, n, b) == full
        _assert_holds(cache, 4, [(k[:full], v[:full]) for k, v in data_b])
        assert cache.allocate(5, n, a) == full
        _assert_holds(cache, 5, [(k[:full], v[:full]) for k, v in data_a])
        # the second unit of b after the first unit of a: the parent check rejects it
        d = b[:unit] + a[unit:]
        assert cache.allocate(6, n, d) == (unit if n - 1 >= unit else 0)
        _assert_holds(cache, 6, [(k[:unit], v[:unit]) for k, v in data_b])
        cache.check_integrity()
    finally:
        cache.close()


def test_vmem_collision_at_another_unit_is_a_miss_not_an_assert(collide):
    """Before the fix, a colliding hit of unit 0 against a unit cached at page index 1 reached
    the mapper's ``assert pos == (res, unit)`` and every later step raised."""
    from vmkv.vmem import VMemKVCache

    spec = SPEC
    cache = VMemKVCache(spec, max_num_seqs=4, max_model_len=64, memory_bytes=spec.kv_bytes(256),
                        driver="host", layout="megacache", page_size_bytes=4096)
    try:
        unit = cache.unit_tokens
        gen = torch.Generator().manual_seed(3)
        a = list(range(2 * unit + 1))
        cache.allocate(1, len(a), a)
        _write_prompt(cache, 1, len(a), gen)
        cache.free(1)
        # with a constant hash, an index that trusted hashes would return a's units, in whatever
        # order its buckets hold them; the verified index returns none of them
        b = [5000 + t for t in range(2 * unit + 1)]
        assert cache.allocate(2, len(b), b) == 0
        data_b = _write_prompt(cache, 2, len(b), gen)
        _assert_holds(cache, 2, data_b)
        assert cache.prefix.num_collisions >= 1
        cache.check_integrity()
    finally:
        cache.close()
