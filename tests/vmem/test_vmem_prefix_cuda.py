"""vmem prefix cache on the CUDA driver (issue 9): verified hits, retention of unmapped cached pages.

A cached page that leaves every slot stays a cuMemCreate handle holding its K/V (cached free in the
pool); a later hit maps the same handle again, so the data must read back bit for bit.  An injected
hash collision must be a miss (before the fix it reached an ``assert`` in the mapper).
"""

import random

import pytest
import torch

from vmkv import KVCacheFullError, KVCacheSpec, StepSeq
from vmkv.kvcache import hashing as hashing_mod
from vmkv.kvcache import prefix as prefix_mod

pytestmark = pytest.mark.gpu

pytest.importorskip("cuda.bindings")

from vmkv.vmem import VMemKVCache  # noqa: E402
from vmem_helpers import checked_drivers, random_kv, random_op  # noqa: E402, F401 - checked_drivers: autouse fixture

MIB = 1024 * 1024
# 2 layers x 8 KV heads x 128 dims, bf16: 8 KiB per token -> 256 tokens per 2 MiB megacache page;
# per_layer: 2 KiB per token per reservation -> 1024 tokens per page, 4 pages per unit
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
MAX_LEN = 4096
PPU = {"megacache": 1, "per_layer": 4}


@pytest.fixture
def make(layout):
    caches = []

    def _make(num_units, max_num_seqs):
        c = VMemKVCache(SPEC, max_num_seqs=max_num_seqs, max_model_len=MAX_LEN,
                        memory_bytes=num_units * PPU[layout] * 2 * MIB, driver="cuda", layout=layout)
        caches.append(c)
        return c

    yield _make
    torch.cuda.synchronize()
    for c in caches:
        c.close()


def _prefill(c, seq, start, n, seed):
    meta = c.prepare([StepSeq(seq, start, n - start)])
    out = []
    for layer in range(SPEC.num_layers):
        k, v = random_kv(SPEC, n - start, seed * 10 + layer)
        c.write_kv(layer, k, v, meta)
        out.append((k, v))
    return out


def _holds(c, seq, data, n):
    for layer, (k, v) in enumerate(data):
        gk, gv = c.gather(seq, layer)
        assert torch.equal(gk[:n], k[:n]) and torch.equal(gv[:n], v[:n]), (seq, layer)


def test_cuda_cached_pages_survive_unmapped_and_map_back(make):
    c = make(num_units=16, max_num_seqs=2)
    ut = c.unit_tokens
    n = min(MAX_LEN, 3 * ut + 1)
    full = (n - 1) // ut * ut
    prompt = [random.Random(1).randrange(32000) for _ in range(n)]
    c.allocate(1, n, prompt)
    data = _prefill(c, 1, 0, n, seed=1)
    c.free(1)
    for seq in (2, 3):                           # both slots taken by others: the pages leave
        c.allocate(seq, n, [t + seq * 100_000 for t in prompt])
        _prefill(c, seq, 0, n, seed=seq)
    assert c.vmm_stats()["num_cached_free_pages"] > 0
    c.free(2)
    c.free(3)
    assert c.allocate(4, n, prompt) == full
    _holds(c, 4, data, full)
    c.check_integrity()


def test_cuda_injected_collision_is_a_miss(make, monkeypatch):
    # every unit hashes alike (the function unit_keys calls: patching prefix_mod.hash_unit, as this
    # test once did, reached nothing, so b was a plain miss and no collision was ever verified)
    monkeypatch.setattr(hashing_mod, "hash_unit_bytes", lambda *a: bytes(prefix_mod.HASH_BYTES))
    c = make(num_units=16, max_num_seqs=4)
    ut = c.unit_tokens
    n = min(MAX_LEN, 2 * ut + 1)
    a = list(range(n))
    c.allocate(1, n, a)
    _prefill(c, 1, 0, n, seed=5)
    b = [t + 7 for t in a]
    assert c.allocate(2, n, b) == 0
    assert c.prefix.num_collisions >= 1                   # b's first unit met a's in the one bucket
    data_b = _prefill(c, 2, 0, n, seed=6)
    _holds(c, 2, data_b, n)
    c.check_integrity()


def _values(ids, start, end, layer):
    """K of positions ``start..end-1``: a function of the token prefix (a rolling hash),
    ``[n, H, D]`` on the GPU (rounded to bf16 as the cache stores it)."""
    h, vals = 0, []
    for p in range(end):
        h = (h * 31 + ids[p] + 1) % 1000003
        if p >= start:
            vals.append((h % 1000) / 8.0 + layer)
    vals = torch.tensor(vals)
    return vals.view(-1, 1, 1).expand(-1, SPEC.num_kv_heads, SPEC.head_dim).to("cuda", SPEC.dtype)


def test_cuda_random_prefix_traffic_under_pressure(make, layout):
    """Seeded allocate/extend/fork/free with shared prefixes in a small pool: cached pages move out,
    are revived and evicted; every live sequence reads back its own history."""
    rng = random.Random(7)
    c = make(num_units=10, max_num_seqs=4)
    ut = c.unit_tokens
    prefixes = [[rng.randrange(50) for _ in range(2 * ut)] for _ in range(2)]
    tokens: dict = {}
    next_id = 0

    def write_range(seq, start, end):
        for layer in range(SPEC.num_layers):
            k = _values(tokens[seq], start, end, layer)
            c.write(seq, layer, start, k, -k)

    for _ in range(60):
        before = c.usage()
        try:
            done = random_op(c, rng, tokens, next_id, prefixes, min(MAX_LEN, 3 * ut), write_range,
                             new_token=lambda: rng.randrange(50))
            if done is not None:
                next_id = done
        except KVCacheFullError:
            assert c.usage() == before
        c.check_integrity()
        for seq, ids in tokens.items():
            gk, gv = c.gather(seq, 1)
            want = _values(ids, 0, len(ids), 1)
            assert torch.equal(gk, want) and torch.equal(gv, -want), seq
    assert c.usage().prefix_hit_tokens > 0
