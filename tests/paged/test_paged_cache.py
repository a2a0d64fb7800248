"""PagedKVCache: block tables, copy-on-write, prefix caching, accounting and the per-step path.

Tiny spec: 2 layers, 2 KV heads, head_dim 8, float64 -> 512 bytes per token; block_size 4 -> 2048
bytes per block.
"""

import pytest
import torch

from vmkv.kernels.reference import attention_one_seq_ref
from vmkv.kvcache import (
    DuplicateSequenceError,
    KVCacheError,
    KVCacheFullError,
    KVCacheSpec,
    StepSeq,
    UnknownSequenceError,
    create_kv_cache,
)
from vmkv.kvcache.prefix import unit_keys
from vmkv.paged import PagedKVCache, TooManySequencesError

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float64)
BS = 4
BLOCK_BYTES = BS * SPEC.bytes_per_token  # 2048


def make(num_blocks=8, max_num_seqs=4, max_model_len=32, **kw) -> PagedKVCache:
    cache = create_kv_cache("paged", SPEC, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            memory_bytes=num_blocks * BLOCK_BYTES + BLOCK_BYTES - 1,
                            block_size=BS, **kw)
    assert isinstance(cache, PagedKVCache) and cache.num_blocks == num_blocks
    return cache


def rand_kv(n, gen, heads=SPEC.num_kv_heads):
    shape = (n, heads, SPEC.head_dim)
    return (torch.randn(shape, generator=gen, dtype=torch.float64),
            torch.randn(shape, generator=gen, dtype=torch.float64))


def write_all_layers(cache, seq_id, start, n, gen):
    """Write random K/V at positions start..start+n-1 of every layer; returns [(k, v)] per layer."""
    out = []
    for layer in range(SPEC.num_layers):
        k, v = rand_kv(n, gen)
        cache.write(seq_id, layer, start, k, v)
        out.append((k, v))
    return out


def snapshot(cache):
    return (cache.usage(), {s: cache.block_table(s) for s in list(cache.seqs)},
            cache.pool.free_block_ids(), cache.kv_tensor.clone())


def assert_unchanged(cache, snap):
    usage, tables, free_ids, kv = snap
    assert cache.usage() == usage
    assert {s: cache.block_table(s) for s in list(cache.seqs)} == tables
    assert cache.pool.free_block_ids() == free_ids
    assert torch.equal(cache.kv_tensor, kv)
    cache.check_integrity()


# ---------------------------------------------------------------------- construction
def test_layout_and_views():
    cache = make()
    assert cache.kv_tensor.shape == (2, 2, 8, BS, 2, 8)
    assert cache.kv_tensor.dtype == torch.float64
    cache.key_cache(1)[3, 2] = 7.0
    cache.value_cache(0)[5, 1] = -3.0
    assert torch.all(cache.kv_tensor[1, 0, 3, 2] == 7.0)
    assert torch.all(cache.kv_tensor[0, 1, 5, 1] == -3.0)
    assert cache.key_cache(0).shape == (8, BS, 2, 8)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        cache.key_cache(2)


def test_bad_construction():
    with pytest.raises(ValueError, match="holds no block of 2048 bytes"):
        PagedKVCache(SPEC, max_num_seqs=1, max_model_len=8, memory_bytes=2047, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(SPEC, max_num_seqs=1, max_model_len=8, memory_bytes=1 << 20, block_size=0)
    # the constructor's rule is PagedOptions' (a power of two in [1, MAX_BLOCK_SIZE]), not its own
    from vmkv.paged.options import MAX_BLOCK_SIZE, PagedOptions

    for bad in (24, 2 * MAX_BLOCK_SIZE, True, 16.0):
        with pytest.raises(ValueError) as e:
            PagedKVCache(SPEC, max_num_seqs=1, max_model_len=8, memory_bytes=1 << 30, block_size=bad)
        with pytest.raises(ValueError) as want:
            PagedOptions(block_size=bad)
        assert str(e.value) == str(want.value).replace("PagedOptions.", "PagedKVCache.")


# ---------------------------------------------------------------------- lifecycle + data
def test_allocate_extend_write_gather_roundtrip():
    gen = torch.Generator().manual_seed(0)
    cache = make()
    assert cache.allocate(1, 6) == 0
    assert cache.allocate(2, 3) == 0
    assert cache.block_table(1) == [0, 1] and cache.block_table(2) == [2]
    first = write_all_layers(cache, 1, 0, 6, gen)
    cache.extend(1, 5)                                   # 11 tokens -> 3 blocks
    assert cache.seq_len(1) == 11 and cache.block_table(1) == [0, 1, 3]
    second = write_all_layers(cache, 1, 6, 5, gen)
    other = write_all_layers(cache, 2, 0, 3, gen)
    for layer in range(2):
        k, v = cache.gather(1, layer)
        assert k.shape == (11, 2, 8)
        torch.testing.assert_close(k, torch.cat([first[layer][0], second[layer][0]]), rtol=0, atol=0)
        torch.testing.assert_close(v, torch.cat([first[layer][1], second[layer][1]]), rtol=0, atol=0)
        k2, v2 = cache.gather(2, layer)
        assert torch.equal(k2, other[layer][0]) and torch.equal(v2, other[layer][1])
    k, _ = cache.gather(1, 0)
    k.zero_()                                            # a copy: the cache is untouched
    assert torch.equal(cache.gather(1, 0)[0][:6], first[0][0])
    cache.extend(1, 0)
    assert cache.seq_len(1) == 11
    cache.free(1)
    assert not cache.has_seq(1) and cache.has_seq(2)
    assert cache.pool.free_block_ids() == [4, 5, 6, 7, 3, 1, 0]   # freed tail first
    cache.check_integrity()


def test_write_casts_dtype_and_checks_range():
    cache = make()
    cache.allocate(1, 5)
    k = torch.randn(2, 2, 8, dtype=torch.float32)
    cache.write(1, 0, 3, k, k * 2)
    torch.testing.assert_close(cache.gather(1, 0)[0][3:5], k.double())
    with pytest.raises(ValueError, match=r"positions \[4, 6\) outside \[0, 5\)"):
        cache.write(1, 0, 4, k, k)
    with pytest.raises(ValueError, match=r"must be \[num_tokens, 2, 8\]"):
        cache.write(1, 0, 0, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="layer"):
        cache.write(1, 2, 0, k, k)


def test_lifecycle_errors():
    cache = make(max_num_seqs=2)
    cache.allocate(1, 4)
    with pytest.raises(DuplicateSequenceError):
        cache.allocate(1, 4)
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        cache.allocate(2, 33)
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        cache.allocate(2, 0)
    with pytest.raises(ValueError, match="token_ids has 3 ids, num_tokens is 4"):
        cache.allocate(2, 4, token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="max_model_len 32"):
        cache.extend(1, 29)
    with pytest.raises(UnknownSequenceError, match="sequence 9"):
        cache.extend(9, 1)
    for op in (cache.free, cache.seq_len, cache.block_table):
        with pytest.raises(UnknownSequenceError):
            op(9)
    with pytest.raises(UnknownSequenceError):
        cache.gather(9, 0)
    cache.fork(1, 2)
    with pytest.raises(TooManySequencesError, match="max_num_seqs reached: 2 of 2") as err:
        cache.allocate(3, 4)
    assert isinstance(err.value, KVCacheFullError) and isinstance(err.value, ValueError)
    with pytest.raises(TooManySequencesError):
        cache.fork(1, 3)
    with pytest.raises(DuplicateSequenceError):
        cache.fork(1, 2)
    assert not cache.can_allocate(4) and cache.free_tokens == 28     # memory is free, no seq
    cache.free(2)
    assert cache.can_allocate(4) and cache.free_tokens == 28
    assert not cache.can_allocate(33) and not cache.can_allocate(0)
    cache.check_integrity()


# ---------------------------------------------------------------------- fork + copy-on-write
def test_fork_cow_isolation_both_directions():
    gen = torch.Generator().manual_seed(1)
    cache = make()
    cache.allocate(1, 6)
    base = write_all_layers(cache, 1, 0, 6, gen)
    cache.fork(1, 2)
    assert cache.block_table(2) == [0, 1] and cache.seq_len(2) == 6
    assert cache.pool.refcount(0) == 2 and cache.pool.refcount(1) == 2
    # child writes position 5 (block 1): block 1 is copied to block 2 for the child only
    kc, vc = rand_kv(1, gen)
    cache.write(2, 1, 5, kc, vc)
    assert cache.block_table(2) == [0, 2] and cache.block_table(1) == [0, 1]
    assert cache.usage().num_cow_copies == 1
    assert torch.equal(cache.gather(1, 1)[0], base[1][0])           # parent unchanged
    ck, cv = cache.gather(2, 1)
    assert torch.equal(ck[:5], base[1][0][:5]) and torch.equal(ck[5], kc[0])
    assert torch.equal(cv[5], vc[0])
    assert torch.equal(cache.gather(2, 0)[0], base[0][0])           # copy covers all layers
    # parent writes position 1 (block 0, still shared): the parent gets the copy (block 3)
    kp, vp = rand_kv(1, gen)
    cache.write(1, 0, 1, kp, vp)
    assert cache.block_table(1) == [3, 1] and cache.block_table(2) == [0, 2]
    assert torch.equal(cache.gather(1, 0)[0][1], kp[0])
    assert torch.equal(cache.gather(2, 0)[0], base[0][0])           # child unchanged
    assert cache.usage().num_cow_copies == 2
    # no longer shared: writes go in place
    cache.write(1, 0, 2, kp, vp)
    assert cache.block_table(1) == [3, 1] and cache.usage().num_cow_copies == 2
    cache.check_integrity()


def test_extend_copies_shared_last_block_eagerly():
    cache = make()
    cache.allocate(1, 6)
    cache.fork(1, 2)
    cache.extend(2, 1)                  # position 6 lies in shared block 1 -> copy now
    assert cache.block_table(2) == [0, 2] and cache.block_table(1) == [0, 1]
    assert cache.pool.refcount(1) == 1 and cache.usage().num_cow_copies == 1
    cache.allocate(3, 8)                # blocks 3, 4
    cache.fork(3, 4)
    cache.extend(4, 1)                  # block-aligned: a new block, no copy
    assert cache.block_table(4) == [3, 4, 5] and cache.usage().num_cow_copies == 1
    cache.check_integrity()


def test_prepare_copies_shared_block_of_write_range():
    cache = make()
    cache.allocate(1, 5)
    cache.prepare([StepSeq(1, 0, 5)])
    cache.fork(1, 2)
    cache.extend(1, 1)                   # parent copies block 1 -> block 2 eagerly
    assert cache.block_table(1) == [0, 2]
    # both sharers rewrite position 4 in one step: the child's block 1 is no longer shared
    meta = cache.prepare([StepSeq(1, 4, 2), StepSeq(2, 4, 1)])
    assert cache.block_table(2) == [0, 1] and cache.usage().num_cow_copies == 1
    assert meta.slot_mapping.tolist() == [2 * BS + 0, 2 * BS + 1, 1 * BS + 0]
    # a shared block written by two sharers in one step is copied once
    cache.fork(2, 3)
    cache.prepare([StepSeq(2, 4, 1), StepSeq(3, 4, 1)])
    assert cache.block_table(2) == [0, 3] and cache.block_table(3) == [0, 1]
    assert cache.usage().num_cow_copies == 2
    cache.check_integrity()


# ---------------------------------------------------------------------- prefix caching
def test_prefix_cache_hits_counts_and_data():
    gen = torch.Generator().manual_seed(2)
    cache = make(num_blocks=12, max_num_seqs=8)
    prompt = list(range(100, 110))                       # 10 tokens: 2 full blocks
    assert cache.allocate(1, 10, prompt) == 0
    # not registered before written
    assert cache.allocate(2, 10, prompt) == 0
    assert cache.block_table(2) == [3, 4, 5]
    cache.free(2)
    data = write_all_layers(cache, 1, 0, 10, gen)         # every layer of 0..9: registers blocks 0, 1
    assert cache.allocate(3, 10, prompt) == 8
    assert cache.block_table(3)[:2] == [0, 1]
    assert cache.pool.refcount(0) == 2 and cache.pool.refcount(1) == 2
    for layer in range(2):
        k, v = cache.gather(3, layer)
        assert torch.equal(k[:8], data[layer][0][:8]) and torch.equal(v[:8], data[layer][1][:8])
    # at most (num_tokens - 1) // block_size blocks: an 8-token prompt hits 1 block
    assert cache.allocate(4, 8, prompt[:8]) == 4
    # divergence in the second block: only the first block hits
    assert cache.allocate(5, 10, prompt[:5] + [0] * 5) == 4
    # another extra_key (tenant salt) never hits
    assert cache.allocate(6, 10, prompt, extra_key="tenant-b") == 0
    u = cache.usage()
    assert u.prefix_query_tokens == 10 + 10 + 10 + 8 + 10 + 10
    assert u.prefix_hit_tokens == 8 + 4 + 4
    # no token ids: no lookup, no counting
    cache.free(6)
    assert cache.allocate(6, 10) == 0 and cache.usage().prefix_query_tokens == u.prefix_query_tokens
    cache.check_integrity()


def test_prefix_registered_only_when_every_layer_written():
    gen = torch.Generator().manual_seed(3)
    cache = make(num_blocks=16)
    prompt = list(range(9))
    cache.allocate(1, 9, prompt)
    k, v = rand_kv(9, gen)
    cache.write(1, 0, 0, k, v)                           # layer 0 only
    assert cache.allocate(2, 9, prompt) == 0
    cache.write(1, 1, 4, k[4:], v[4:])                   # layer 1 has a gap at 0..3
    assert cache.allocate(3, 9, prompt) == 0
    cache.write(1, 1, 0, k[:4], v[:4])                   # layer 1 now written 0..7 -> 2 blocks
    assert cache.pool.num_cached_blocks == 1             # contiguous prefix: block 0 only
    assert cache.allocate(4, 9, prompt) == 4
    cache.check_integrity()


def test_prefix_disabled():
    cache = make(enable_prefix_caching=False)
    prompt = list(range(9))
    cache.allocate(1, 9, prompt)
    cache.prepare([StepSeq(1, 0, 9)])
    assert cache.allocate(2, 9, prompt) == 0
    assert cache.usage().prefix_query_tokens == 0


def test_cached_free_blocks_revived_then_evicted_lru():
    cache = make(num_blocks=8)
    prompt = list(range(50, 62))                         # 12 tokens: 3 full blocks
    cache.allocate(1, 12, prompt)
    cache.prepare([StepSeq(1, 0, 12)])
    assert cache.pool.num_cached_blocks == 3
    cache.free(1)                                        # cached LRU (tail first): 2, 1, 0
    assert cache.pool.num_cached_free_blocks == 3 and cache.usage().free_tokens == 32
    # revive: a prompt with the same 12 tokens hits 2 blocks (the last token is computed)
    assert cache.allocate(2, 12, prompt) == 8
    assert cache.block_table(2) == [0, 1, 3]
    cache.free(2)                                        # 3 plain free; cached LRU: 2, 1, 0
    assert cache.pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    # 24 tokens take the 5 plain free blocks, then evict cached block 2 (least recently freed)
    cache.allocate(3, 24)
    assert cache.block_table(3) == [4, 5, 6, 7, 3, 2]
    keys = unit_keys(prompt, BS)
    assert cache.pool.block_hash(2) is None
    assert [e.handles for e in cache.prefix.match(keys)] == [(0,), (1,)]
    # the prompt still hits blocks 0, 1 but needs 1 new block while only 0 and 1 are free
    snap = snapshot(cache)
    with pytest.raises(KVCacheFullError, match="needs 1 new blocks, 0 free") as err:
        cache.allocate(4, 12, prompt)
    assert (err.value.needed_tokens, err.value.available_tokens) == (12, 8)   # 8 = the hits
    assert_unchanged(cache, snap)
    cache.free(3)
    assert cache.allocate(4, 12, prompt) == 8
    assert cache.block_table(4) == [0, 1, 2]             # block 2 plain free again, at the tail
    assert cache.usage().prefix_hit_tokens == 16
    cache.check_integrity()


# ---------------------------------------------------------------------- full cache
def test_full_errors_leave_state_unchanged():
    gen = torch.Generator().manual_seed(4)
    cache = make(num_blocks=4)
    cache.allocate(1, 6)
    write_all_layers(cache, 1, 0, 6, gen)
    cache.fork(1, 2)
    cache.allocate(3, 8)                                 # all 4 blocks used
    snap = snapshot(cache)
    assert not cache.can_allocate(1) and cache.free_tokens == 0
    with pytest.raises(KVCacheFullError) as err:
        cache.allocate(4, 1)
    assert err.value.needed_tokens == 1 and err.value.available_tokens == 0
    with pytest.raises(KVCacheFullError, match="copy-on-write") as err:
        cache.extend(2, 1)                               # shared block 1 needs a copy
    # 1 new position + a 4-token block copy, against 2 positions of room in block 1
    assert (err.value.needed_tokens, err.value.available_tokens) == (5, 2)
    with pytest.raises(KVCacheFullError, match="copy-on-write") as err:
        cache.write(2, 0, 0, *rand_kv(1, gen))
    assert (err.value.needed_tokens, err.value.available_tokens) == (4, 0)
    with pytest.raises(KVCacheFullError, match="copy-on-write"):
        cache.prepare([StepSeq(3, 0, 8), StepSeq(2, 5, 1)])
    with pytest.raises(KVCacheFullError, match="2 new blocks") as err:
        cache.extend(3, 5)
    assert (err.value.needed_tokens, err.value.available_tokens) == (5, 0)
    assert_unchanged(cache, snap)
    cache.free(3)
    cache.extend(2, 1)                                   # now it fits: copy + no new block
    assert cache.usage().num_cow_copies == 1
    cache.check_integrity()


# ---------------------------------------------------------------------- accounting
def test_usage_exact_numbers():
    cache = make(num_blocks=8)
    u = cache.usage()
    assert (u.num_seqs, u.used_tokens, u.allocated_bytes, u.waste_bytes) == (0, 0, 0, 0)
    assert u.capacity_bytes == u.mapped_bytes == u.reserved_bytes == 8 * 2048
    assert u.free_tokens == 32 and u.unit_tokens == BS
    cache.allocate(1, 6)
    u = cache.usage()
    assert (u.used_tokens, u.allocated_bytes, u.waste_bytes) == (6, 4096, 2 * 512)
    assert u.free_tokens == 24 and u.waste_pct == pytest.approx(25.0)
    cache.fork(1, 2)                                     # shared blocks count once
    u = cache.usage()
    assert (u.num_seqs, u.used_tokens, u.allocated_bytes, u.waste_bytes) == (2, 12, 4096, 1024)
    cache.extend(2, 1)                                   # copy-on-write of block 1 -> block 2
    u = cache.usage()
    # blocks 0 (4 used), 1 (parent: 2 used), 2 (child: 3 used) -> 9 tokens in 3 blocks
    assert (u.used_tokens, u.allocated_bytes, u.waste_bytes) == (13, 6144, 6144 - 9 * 512)
    assert u.num_cow_copies == 1 and u.free_tokens == 20
    cache.free(1)
    cache.free(2)
    u = cache.usage()
    assert (u.allocated_bytes, u.waste_bytes, u.free_tokens) == (0, 0, 32)
    cache.check_integrity()


def test_integrity_detects_corruption():
    cache = make()
    cache.allocate(1, 6)
    cache.check_integrity()
    cache.pool.incref(1)
    with pytest.raises(AssertionError, match="block 1: refcount 2 but 1"):
        cache.check_integrity()
    cache.pool.decref(1)
    cache.seqs[1].units.append(5)
    with pytest.raises(AssertionError, match="3 blocks for seq_len 6"):
        cache.check_integrity()


# ---------------------------------------------------------------------- per-step path
def test_prepare_write_kv_attention_mixed_batch_gqa():
    gen = torch.Generator().manual_seed(5)
    num_heads = 4                                         # GQA: 2 query heads per KV head
    cache = make(num_blocks=16)
    cache.allocate(1, 7)                                  # prefill 7
    cache.allocate(2, 9)                                  # 9 already computed, then decode 1
    cache.allocate(3, 9)                                  # chunked prefill: 4 computed, 5 new
    for sid, n in ((2, 9), (3, 4)):
        meta = cache.prepare([StepSeq(sid, 0, n)])
        for layer in range(2):
            cache.write_kv(layer, *rand_kv(n, gen), meta)
    cache.extend(2, 1)
    batch = [StepSeq(1, 0, 7), StepSeq(2, 9, 1), StepSeq(3, 4, 5)]
    meta = cache.prepare(batch)
    # width: a multiple of 16 capped at max_blocks_per_seq (one Triton specialization of the stride)
    width = min(16, cache.max_blocks_per_seq)
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (3, width)
    assert cache.block_table(2) == [2, 3, 4] and cache.block_table(3) == [5, 6, 7]
    pad = [0] * (width - 3)
    assert meta.block_tables.tolist() == [[0, 1, 0] + pad, [2, 3, 4] + pad, [5, 6, 7] + pad]
    assert meta.query_start_loc.tolist() == [0, 7, 8, 13]
    assert meta.seq_lens.tolist() == [7, 10, 9] and meta.context_lens.tolist() == [0, 9, 4]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 6, 17, 24, 25, 26, 27, 28]
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 4, 5, 6, 7, 8]
    assert not meta.is_decode and meta.max_query_len == 7 and meta.max_seq_len == 10
    for layer in range(2):
        k, v = rand_kv(13, gen)
        cache.write_kv(layer, k, v, meta)
        q = torch.randn(13, num_heads, 8, generator=gen, dtype=torch.float64)
        out = cache.attention(layer, q, meta)
        assert out.shape == (13, num_heads, 8) and out.dtype == torch.float64
        starts = meta.query_start_loc.tolist()
        for i, e in enumerate(batch):
            gk, gv = cache.gather(e.seq_id, layer)
            end = e.num_computed_tokens + e.num_new_tokens
            qs = q[starts[i]:starts[i + 1]]
            assert torch.equal(gk[e.num_computed_tokens:end], k[starts[i]:starts[i + 1]])
            want = attention_one_seq_ref(qs, gk[:end], gv[:end], e.num_computed_tokens, 8 ** -0.5)
            torch.testing.assert_close(out[starts[i]:starts[i + 1]], want)
        out2 = cache.attention(layer, q, meta, scale=0.3)
        want2 = attention_one_seq_ref(q[7:8], *[t[:10] for t in cache.gather(2, layer)], 9, 0.3)
        torch.testing.assert_close(out2[7:8], want2)
    with pytest.raises(ValueError, match="q must be"):
        cache.attention(0, torch.zeros(13, 3, 8, dtype=torch.float64), meta)
    with pytest.raises(ValueError, match="metadata has 13"):
        cache.write_kv(0, *rand_kv(12, gen), meta)
    cache.check_integrity()


def test_prepare_validation():
    cache = make()
    cache.allocate(1, 5)
    with pytest.raises(ValueError, match="at least one"):
        cache.prepare([])
    with pytest.raises(ValueError, match="past seq_len 5"):
        cache.prepare([StepSeq(1, 4, 2)])
    with pytest.raises(ValueError, match="twice"):
        cache.prepare([StepSeq(1, 0, 1), StepSeq(1, 1, 1)])
    with pytest.raises(ValueError, match="num_new_tokens"):
        cache.prepare([StepSeq(1, 0, 0)])
    with pytest.raises(UnknownSequenceError):
        cache.prepare([StepSeq(7, 0, 1)])
    meta = cache.prepare([StepSeq(1, 4, 1)])
    assert meta.is_decode and meta.last_token_indices.tolist() == [0]


def test_close_is_idempotent():
    cache = make()
    cache.allocate(1, 4)
    cache.close()
    cache.close()
    assert not cache.has_seq(1) and not cache.can_allocate(1)
    with pytest.raises(KVCacheError, match="closed"):
        cache.allocate(2, 4)
