"""PagedKVCache's host block-table array and written marks (the vectorized ``prepare`` path).

The cache keeps a numpy ``int32 [max_num_seqs, max_blocks_per_seq]`` row per live sequence, updated
in place by allocate / extend / fork / free / copy-on-write; ``prepare`` gathers the step's block
tables from it and computes the slot mapping with numpy.  These tests drive random operations and
compare everything with the list block tables and the per-token formula
``block_table[p // block_size] * block_size + p % block_size``.

Tiny spec: 2 layers, 1 KV head, head_dim 4, float32 -> 64 bytes per token; block_size 4.
"""

import random

import numpy as np
import pytest
import torch

from vmkv.kvcache import KVCacheFullError, KVCacheSpec, StepSeq, create_kv_cache
from vmkv.paged import PagedKVCache
from vmkv.paged.host_tables import HostBlockTables

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
BS = 4


def make(num_blocks=24, max_num_seqs=6, max_model_len=40) -> PagedKVCache:
    cache = create_kv_cache("paged", SPEC, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            memory_bytes=num_blocks * BS * SPEC.bytes_per_token, block_size=BS)
    assert isinstance(cache, PagedKVCache) and cache.num_blocks == num_blocks
    return cache


def check_step(cache: PagedKVCache, batch: list[StepSeq]) -> None:
    """prepare() the batch and compare its block tables and slot mapping with the list tables
    (read after prepare: copy-on-write may have replaced blocks)."""
    meta = cache.prepare(batch)
    tables = [cache.block_table(e.seq_id) for e in batch]
    # a multiple of 16 columns, capped at max_blocks_per_seq (paged.cache._build_metadata)
    width = min(cache.max_blocks_per_seq, -(-max(len(t) for t in tables) // 16) * 16)
    want_bt = [t + [0] * (width - len(t)) for t in tables]
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == want_bt
    want_slots = [t[p // BS] * BS + p % BS for e, t in zip(batch, tables)
                  for p in range(e.num_computed_tokens, e.num_computed_tokens + e.num_new_tokens)]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == want_slots
    want_pos = [p for e in batch
                for p in range(e.num_computed_tokens, e.num_computed_tokens + e.num_new_tokens)]
    assert meta.positions.tolist() == want_pos


@pytest.mark.parametrize("seed", range(6))
def test_host_rows_follow_block_tables_under_random_operations(seed):
    rng = random.Random(seed)
    cache = make()
    prompts = [[rng.randrange(4) for _ in range(16)] for _ in range(2)]  # shared prefixes
    computed: dict[int, int] = {}
    next_id = 0
    for _ in range(120):
        live = list(computed)
        op = rng.choice(["alloc", "alloc", "extend", "extend", "fork", "free", "step", "step"])
        try:
            if op == "alloc" or not live:
                n = rng.randint(1, 14)
                ids = rng.choice(prompts)[:n] if rng.random() < 0.6 else None
                hit = cache.allocate(next_id, n, ids)
                computed[next_id] = hit
                next_id += 1
            elif op == "extend":
                sid = rng.choice(live)
                cache.extend(sid, min(rng.randint(1, 6), cache.max_model_len - cache.seq_len(sid)))
            elif op == "fork":
                parent, child = rng.choice(live), next_id
                next_id += 1
                cache.fork(parent, child)
                computed[child] = computed[parent]
            elif op == "free":
                sid = rng.choice(live)
                cache.free(sid)
                del computed[sid]
            else:
                batch = []
                for sid in rng.sample(live, rng.randint(1, len(live))):
                    start = computed[sid] if rng.random() < 0.8 else rng.randrange(cache.seq_len(sid))
                    n = cache.seq_len(sid) - start
                    if n > 0:
                        batch.append(StepSeq(sid, start, rng.randint(1, n)))
                if batch:
                    check_step(cache, batch)
                    for e in batch:
                        computed[e.seq_id] = max(computed[e.seq_id],
                                                 e.num_computed_tokens + e.num_new_tokens)
        except KVCacheFullError:
            pass
        cache.check_integrity()  # includes the host rows == list tables check
    assert cache.usage().num_cow_copies > 0, "the random walk should exercise copy-on-write"


def test_rows_are_recycled_and_zeroed():
    cache = make(max_num_seqs=2)
    cache.allocate(1, 9)
    cache.allocate(2, 3)
    row1 = cache.seqs[1].row
    cache.free(1)
    assert not cache.blocks.tables.array[row1].any()
    cache.allocate(3, 2)
    assert cache.seqs[3].row == row1
    check_step(cache, [StepSeq(3, 0, 2), StepSeq(2, 0, 3)])
    cache.close()
    assert not cache.blocks.tables.array.any() and cache.blocks.tables.num_free_rows == 2


def test_integrity_detects_a_stale_host_row():
    cache = make()
    cache.allocate(1, 9)
    cache.check_integrity()
    row = cache.seqs[1].row
    cache.blocks.tables.array[row, 0] += 1
    with pytest.raises(AssertionError, match="host block-table row"):
        cache.check_integrity()
    cache.blocks.tables.array[row, 0] -= 1
    cache.blocks.tables.array[row, 5] = 7  # padding past the 3 blocks must stay 0
    with pytest.raises(AssertionError, match="padded with 0"):
        cache.check_integrity()


def test_cow_in_prepare_updates_the_host_row():
    cache = make()
    cache.allocate(1, 6)
    cache.prepare([StepSeq(1, 0, 6)])
    cache.fork(1, 2)
    assert cache.block_table(1) == cache.block_table(2)
    check_step(cache, [StepSeq(2, 5, 1)])  # writes into shared block 1 -> copy for sequence 2
    assert cache.block_table(2)[1] != cache.block_table(1)[1]
    assert cache.blocks.tables.array[cache.seqs[2].row, :2].tolist() == cache.block_table(2)
    cache.check_integrity()


def test_written_marks_collapse_and_register_once_all_layers_are_written():
    gen = torch.Generator().manual_seed(0)
    cache = make()
    prompt = list(range(10))
    cache.allocate(1, 10, prompt)
    s = cache.seqs[1]
    assert s.marks == [0, 0] and s.written == 0
    k = torch.randn(10, 1, 4, generator=gen)
    cache.write(1, 0, 0, k, k)                  # layer 0 only: per-layer marks appear
    assert s.marks == [10, 0] and s.written == 0
    assert cache.pool.num_cached_blocks == 0
    # a prepare of positions 0..5 marks every layer up to 6: layer 0 keeps 10
    cache.prepare([StepSeq(1, 0, 6)])
    assert s.marks == [10, 6] and s.written == 6
    assert cache.pool.num_cached_blocks == 1    # block 0 (positions 0..3) in every layer
    cache.prepare([StepSeq(1, 6, 4)])           # layers agree again: one scalar mark
    assert s.marks == [10, 10] and s.written == 10
    assert cache.pool.num_cached_blocks == 2
    assert cache.allocate(2, 10, prompt) == 8   # two full blocks hit
    cache.check_integrity()


def test_decode_prepare_does_not_reregister():
    cache = make()
    cache.allocate(1, 8, list(range(8)))
    cache.prepare([StepSeq(1, 0, 8)])
    assert cache.seqs[1].prefix.num_registered == 2
    calls = []
    orig = cache.pool.register
    cache.pool.register = lambda *a: calls.append(a) or orig(*a)
    for pos in range(8, 14):
        cache.extend(1, 1)
        cache.prepare([StepSeq(1, pos, 1)])
    # every prompt unit is registered: decode steps neither register nor track marks
    assert calls == [] and cache.seqs[1].prefix.done


def test_host_table_shape_and_dtype():
    cache = make(max_num_seqs=3, max_model_len=41)
    assert cache.blocks.tables.array.shape == (3, 11) and cache.blocks.tables.array.dtype == np.int32
    cache.allocate(1, 41)
    assert cache.blocks.tables.array[cache.seqs[1].row].tolist() == cache.block_table(1)


def test_host_block_tables_unit():
    t = HostBlockTables(3, 4)
    a = t.new_row([5, 6])
    b = t.copy_row(a)
    t.append(b, 2, [7])
    t.set(a, 0, 9)
    assert (a, b) == (0, 1) and t.num_free_rows == 1
    assert t.gather([b, a], 2, 3).tolist() == [[5, 6, 7], [9, 6, 0]]
    assert t.gather([a], 1, 3).flags["C_CONTIGUOUS"]
    t.check({10: (a, [9, 6]), 11: (b, [5, 6, 7])})
    with pytest.raises(AssertionError, match="rows reused"):
        t.check({10: (a, [9, 6]), 11: (a, [9, 6])})
    t.release(a, 2)
    assert t.array[a].tolist() == [0, 0, 0, 0] and t.new_row([1]) == a
    with pytest.raises(ValueError, match="must be positive"):
        HostBlockTables(0, 4)
