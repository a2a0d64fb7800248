"""Backend configurations and helpers shared by the KV-cache contract tests.

Everything here goes through the interface only (``vmkv.create_kv_cache`` and the methods of
:class:`vmkv.kvcache.base.KVCache`), so the same checks run against every backend.

Tiny spec: 2 layers, 2 KV heads, head_dim 8, float32, so ``bytes_per_token = 2 * 2 * 2 * 8 * 4 = 256``.
The vmem cases use 4 KiB host pages: megacache pages hold all layers of 16 tokens
(``4096 / 256``); per-layer pages hold one layer's K (or V) of 64 tokens (``4096 / 64``), and one
allocation unit of 64 tokens costs ``2 * num_layers = 4`` pages.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from vmkv import KVCacheSpec, create_kv_cache
from vmkv.kvcache.base import CacheUsage, KVCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")


@dataclass(frozen=True)
class Case:
    """One backend configuration under test."""

    name: str
    backend: str
    max_num_seqs: int
    max_model_len: int
    capacity_tokens: int          # memory budget, in tokens of SPEC
    options: dict = field(default_factory=dict)

    def make(self, *, spec: KVCacheSpec = SPEC, max_num_seqs: int | None = None,
             max_model_len: int | None = None, capacity_tokens: int | None = None) -> KVCache:
        return create_kv_cache(
            self.backend, spec,
            max_num_seqs=max_num_seqs or self.max_num_seqs,
            max_model_len=max_model_len or self.max_model_len,
            memory_bytes=spec.kv_bytes(capacity_tokens or self.capacity_tokens),
            **self.options,
        )


CASES = [
    Case("paged-b4", "paged", 12, 64, 256, {"block_size": 4}),
    Case("paged-b16", "paged", 12, 64, 256, {"block_size": 16}),
    Case("vmem-megacache", "vmem", 12, 64, 256,
         {"driver": "host", "layout": "megacache", "page_size_bytes": 4096}),
    Case("vmem-per_layer", "vmem", 8, 128, 384,
         {"driver": "host", "layout": "per_layer", "page_size_bytes": 4096}),
    # pages mapped ahead of seq_len (off the step's critical path): waste and capacity still add up
    Case("vmem-lookahead", "vmem", 12, 64, 256,
         {"driver": "host", "layout": "megacache", "page_size_bytes": 4096, "lookahead_tokens": 20}),
]
CASE_IDS = [c.name for c in CASES]


@contextmanager
def one_torch_thread():
    """Run with one intra-op thread: tiny tensors on a shared 2-core machine otherwise spend
    milliseconds per op in contended thread hand-offs (measured: softmax 26 ms vs 8 us)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------- data
def rand_kv(gen: torch.Generator, n: int, spec: KVCacheSpec = SPEC) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random ``[n, H, D]`` K and V (never zeros: randn shifted away from 0)."""
    shape = (n, spec.num_kv_heads, spec.head_dim)
    k = torch.randn(shape, generator=gen, dtype=torch.float32) + 3.0
    v = torch.randn(shape, generator=gen, dtype=torch.float32) - 3.0
    return k.to(spec.dtype), v.to(spec.dtype)


def write_all_layers(cache: KVCache, seq_id: int, start: int, n: int,
                     gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write fresh random K/V at ``start..start+n-1`` of every layer; returns the per-layer data."""
    out = []
    for layer in range(cache.spec.num_layers):
        k, v = rand_kv(gen, n, cache.spec)
        cache.write(seq_id, layer, start, k, v)
        out.append((k, v))
    return out


def gather_all(cache: KVCache, seq_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [cache.gather(seq_id, layer) for layer in range(cache.spec.num_layers)]


def snapshot(cache: KVCache, seq_ids) -> tuple[CacheUsage, dict, dict]:
    """Everything observable about the cache: usage, seq lens, per-layer K/V of ``seq_ids``."""
    lens = {s: cache.seq_len(s) for s in seq_ids}
    data = {s: gather_all(cache, s) for s in seq_ids}
    return cache.usage(), lens, data


def assert_unchanged(cache: KVCache, snap, *, extra_absent=()) -> None:
    """The cache still looks exactly like ``snap`` (a failing operation changed nothing)."""
    usage0, lens0, data0 = snap
    cache.check_integrity()
    assert cache.usage() == usage0
    for s, n in lens0.items():
        assert cache.seq_len(s) == n
        for layer, (k0, v0) in enumerate(data0[s]):
            k, v = cache.gather(s, layer)
            assert torch.equal(k, k0) and torch.equal(v, v0), f"seq {s} layer {layer} changed"
    for s in extra_absent:
        assert not cache.has_seq(s)


def assert_data(cache: KVCache, seq_id: int, expected: list[tuple[torch.Tensor, torch.Tensor]],
                start: int = 0) -> None:
    """Positions ``start..start+n-1`` of every layer hold ``expected`` exactly."""
    for layer, (ke, ve) in enumerate(expected):
        k, v = cache.gather(seq_id, layer)
        n = ke.shape[0]
        torch.testing.assert_close(k[start:start + n], ke, rtol=0, atol=0)
        torch.testing.assert_close(v[start:start + n], ve, rtol=0, atol=0)


def check_usage(cache: KVCache, live: dict[int, int], *, shared: bool = False) -> CacheUsage:
    """Check the :class:`CacheUsage` identities for live sequences ``{seq_id: seq_len}``.

    ``shared``: some positions may be shared (fork, prefix hits), so held bytes are bounded
    instead of exact.
    """
    u = cache.usage()
    spec = cache.spec
    assert u.num_seqs == len(live), (u, live)
    assert u.used_tokens == sum(live.values()), (u, live)
    assert 0 <= u.waste_bytes <= u.allocated_bytes <= u.capacity_bytes, u
    assert 0 < u.capacity_bytes <= cache.memory_bytes, u
    assert u.allocated_bytes <= u.mapped_bytes <= u.capacity_bytes, u
    assert u.reserved_bytes >= u.mapped_bytes, u
    assert 0 <= u.prefix_hit_tokens <= u.prefix_query_tokens, u
    assert u.num_cow_copies >= 0 and u.unit_tokens >= 0 and u.free_tokens >= 0, u
    held = u.allocated_bytes - u.waste_bytes
    if not live:
        assert u.allocated_bytes == 0 and u.waste_bytes == 0, u
    else:
        # every token of a live sequence is held somewhere, shared ones once
        assert spec.kv_bytes(max(live.values())) <= held <= spec.kv_bytes(u.used_tokens), u
        if not shared:
            assert held == spec.kv_bytes(u.used_tokens), u
    if cache.backend == "paged" and not shared:
        b = u.unit_tokens
        blocks = sum(-(-n // b) for n in live.values())
        assert u.allocated_bytes == spec.kv_bytes(blocks * b), u
        assert u.waste_bytes == spec.kv_bytes(blocks * b - sum(live.values())), u
    if len(live) < cache.max_num_seqs:
        # free_tokens: what a new sequence could still get; can_allocate agrees
        if u.free_tokens > 0:
            assert cache.can_allocate(min(u.free_tokens, cache.max_model_len)), u
        if u.free_tokens < cache.max_model_len:
            assert not cache.can_allocate(u.free_tokens + 1), u
    return u


def pool_tokens(cache: KVCache) -> int:
    """Tokens the whole budget holds: ``capacity_bytes / bytes_per_token``."""
    return cache.usage().capacity_bytes // cache.spec.bytes_per_token


def allocate_capacity(cache: KVCache, total_tokens: int, first_id: int) -> list[int]:
    """Allocate ``total_tokens`` positions in sequences of at most ``max_model_len``."""
    ids, remaining, sid = [], total_tokens, first_id
    while remaining > 0:
        n = min(remaining, cache.max_model_len)
        assert cache.can_allocate(n), (n, remaining, cache.usage())
        assert cache.allocate(sid, n) == 0
        ids.append(sid)
        remaining -= n
        sid += 1
    return ids
