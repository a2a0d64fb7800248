"""``build_metadata``: the per-token callable path and the precomputed ``slot_mapping`` path agree
with a plain Python construction of every field, for decode and mixed prefill batches."""

import random

import numpy as np
import pytest
import torch

from vmkv.kvcache import StepSeq
from vmkv.kvcache.metadata import build_metadata, step_token_positions

CPU = torch.device("cpu")


def random_batch(rng: random.Random, decode: bool) -> list[StepSeq]:
    n = rng.randint(1, 9)
    return [StepSeq(100 + i, rng.randint(0, 50), 1 if decode else rng.randint(1, 7)) for i in range(n)]


def slot_of(e: StepSeq, p: int) -> int:
    return e.seq_id * 1000 + p


def expected(batch):
    positions = [p for e in batch for p in range(e.num_computed_tokens,
                                                 e.num_computed_tokens + e.num_new_tokens)]
    qsl = [0]
    for e in batch:
        qsl.append(qsl[-1] + e.num_new_tokens)
    return {
        "positions": positions,
        "slots": [slot_of(e, p) for e in batch for p in range(e.num_computed_tokens,
                                                               e.num_computed_tokens + e.num_new_tokens)],
        "qsl": qsl,
        "seq_lens": [e.num_computed_tokens + e.num_new_tokens for e in batch],
        "ctx": [e.num_computed_tokens for e in batch],
        "last": [q - 1 for q in qsl[1:]],
        "qlens": [e.num_new_tokens for e in batch],
    }


def check(meta, batch):
    want = expected(batch)
    assert meta.seq_ids == [e.seq_id for e in batch]
    assert meta.positions.dtype == torch.int64 and meta.positions.tolist() == want["positions"]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == want["slots"]
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == want["qsl"]
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == want["seq_lens"]
    assert meta.context_lens.dtype == torch.int32 and meta.context_lens.tolist() == want["ctx"]
    assert meta.last_token_indices.dtype == torch.int64
    assert meta.last_token_indices.tolist() == want["last"]
    assert meta.seq_lens_host == want["seq_lens"] and meta.query_lens_host == want["qlens"]
    assert all(type(x) is int for x in meta.seq_lens_host + meta.query_lens_host)
    assert meta.max_query_len == max(want["qlens"]) and meta.max_seq_len == max(want["seq_lens"])
    assert meta.is_decode == all(q == 1 for q in want["qlens"])
    assert type(meta.max_query_len) is int and type(meta.max_seq_len) is int


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_callable_and_precomputed_slot_mapping_agree(seed, decode):
    batch = random_batch(random.Random(seed), decode)
    check(build_metadata(batch, device=CPU, slot_index=slot_of), batch)
    seq_index, positions = step_token_positions(batch)
    ids = np.array([e.seq_id for e in batch], dtype=np.int64)
    slots = ids[seq_index] * 1000 + positions
    check(build_metadata(batch, device=CPU, slot_mapping=slots), batch)
    check(build_metadata(batch, device=CPU, slot_mapping=torch.from_numpy(slots)), batch)


def test_step_token_positions():
    seq_index, positions = step_token_positions([StepSeq(7, 3, 2), StepSeq(8, 0, 1), StepSeq(9, 5, 3)])
    assert seq_index.dtype == np.int64 and positions.dtype == np.int64
    assert seq_index.tolist() == [0, 0, 1, 2, 2, 2]
    assert positions.tolist() == [3, 4, 0, 5, 6, 7]
    seq_index, positions = step_token_positions([StepSeq(1, 9, 1), StepSeq(2, 4, 1)])
    assert seq_index.tolist() == [0, 1] and positions.tolist() == [9, 4]


def test_backend_tensors_pass_through():
    batch = [StepSeq(1, 0, 2), StepSeq(2, 4, 1)]
    bt = torch.tensor([[3, 0], [5, 6]], dtype=torch.int32)
    meta = build_metadata(batch, device=CPU, slot_index=slot_of, block_tables=bt)
    assert meta.block_tables.tolist() == [[3, 0], [5, 6]] and meta.slot_indices is None
    si = torch.tensor([0, 1], dtype=torch.int32)
    meta = build_metadata(batch, device=CPU, slot_index=slot_of, slot_indices=si)
    assert meta.slot_indices.tolist() == [0, 1] and meta.block_tables is None


def test_errors():
    batch = [StepSeq(1, 0, 2)]
    with pytest.raises(ValueError, match="exactly one of slot_index"):
        build_metadata(batch, device=CPU)
    with pytest.raises(ValueError, match="exactly one of slot_index"):
        build_metadata(batch, device=CPU, slot_index=slot_of, slot_mapping=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"slot_mapping has shape \(3,\).*2 new tokens"):
        build_metadata(batch, device=CPU, slot_mapping=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="at least one"):
        build_metadata([], device=CPU, slot_index=slot_of)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1"):
        build_metadata([StepSeq(1, 0, 1), StepSeq(2, 3, 0)], device=CPU, slot_index=slot_of)
    with pytest.raises(ValueError, match="num_computed_tokens >= 0"):
        step_token_positions([StepSeq(1, -1, 1)])


def test_padded_decode_step_lands_in_the_graph_buffer():
    """``pad_to``: real rows first, padding rows read and write nothing (seq_len 0, slot -1), every
    field is a view of ``out`` at the offsets of :func:`step_layout`, so a step laid out for 8 rows
    always lands at the same addresses."""
    from vmkv.kvcache.metadata import step_layout
    batch = [StepSeq(5, 9, 1), StepSeq(6, 3, 1), StepSeq(7, 0, 1)]
    layout, nbytes = step_layout(8, 8, 4)
    out = torch.full((nbytes + 16,), 0xAB, dtype=torch.uint8)
    bt = np.arange(12, dtype=np.int32).reshape(3, 4)
    seq_index, positions = step_token_positions(batch)
    slots = bt[seq_index, positions // 4].astype(np.int64) * 4 + positions % 4
    calls = []
    meta = build_metadata(batch, device=CPU, block_tables=bt, slot_mapping=slots, pad_to=8, out=out,
                          plan=lambda rows, longest: calls.append((rows, longest)) or 5)
    assert calls == [(8, 10)] and meta.num_splits == 5 and meta.num_padded_seqs == 8
    assert meta.seq_ids == [5, 6, 7] and meta.num_seqs == 3 and meta.num_tokens == 8
    assert meta.seq_lens.tolist() == [10, 4, 1, 0, 0, 0, 0, 0]
    assert meta.slot_mapping.tolist() == slots.tolist() + [-1] * 5
    assert meta.positions.tolist() == [9, 3, 0, 0, 0, 0, 0, 0]
    assert meta.query_start_loc.tolist() == list(range(9))
    assert meta.last_token_indices.tolist() == list(range(8))
    assert meta.block_tables.tolist() == bt.tolist() + [[0] * 4] * 5
    assert meta.seq_lens_host == [10, 4, 1] and meta.query_lens_host == [1, 1, 1]
    base = out.data_ptr()
    for name, field in (("positions", meta.positions), ("slot_mapping", meta.slot_mapping),
                        ("seq_lens", meta.seq_lens), ("table", meta.block_tables)):
        assert field.data_ptr() == base + layout[name][0], name
    # every row padding (what a graph is captured with): the same addresses
    empty = build_metadata([], device=CPU, block_tables=np.zeros((0, 4), np.int32),
                           slot_mapping=np.zeros(0, np.int64), pad_to=8, out=out)
    assert empty.seq_ids == [] and empty.seq_lens.tolist() == [0] * 8
    assert empty.slot_mapping.tolist() == [-1] * 8 and empty.block_tables.data_ptr() == meta.block_tables.data_ptr()


def test_pad_to_rejects_prefill_and_small_pads():
    with pytest.raises(ValueError, match="pad_to"):
        build_metadata([StepSeq(1, 0, 2)], device=CPU, slot_index=slot_of, pad_to=4)
    with pytest.raises(ValueError, match="pad_to"):
        build_metadata([StepSeq(1, 0, 1), StepSeq(2, 0, 1)], device=CPU, slot_index=slot_of, pad_to=1)
    with pytest.raises(ValueError, match="empty|at least one"):
        build_metadata([], device=CPU, slot_index=slot_of)


def test_steps_do_not_share_buffers_on_cpu():
    """A metadata object stays valid after the next prepare (fresh buffers off CUDA)."""
    a = build_metadata([StepSeq(1, 4, 1)], device=CPU, slot_index=slot_of)
    b = build_metadata([StepSeq(2, 8, 1)], device=CPU, slot_index=slot_of)
    assert a.seq_lens.tolist() == [5] and b.seq_lens.tolist() == [9]


@pytest.mark.parametrize("seed", range(20))
def test_num_decodes_is_the_leading_run_of_one_token_rows_and_is_planned(seed):
    """``num_decodes`` counts the batch's leading one-token rows (all of them in a decode step); the
    decode plan is asked for those rows and their longest context, and only when there are some."""
    rng = random.Random(seed)
    batch = [StepSeq(i, rng.randint(0, 40), rng.choice([1, 1, 1, rng.randint(1, 9)])) for i in range(rng.randint(1, 9))]
    lead = 0
    while lead < len(batch) and batch[lead].num_new_tokens == 1:
        lead += 1
    asked = []

    def plan(rows, longest):
        asked.append((rows, longest))
        return 7
    meta = build_metadata(batch, device=CPU, slot_index=slot_of, plan=plan)
    assert meta.num_decodes == lead
    if lead == len(batch):
        assert asked == [(lead, max(e.num_computed_tokens + 1 for e in batch))] and meta.num_splits == 7
    elif lead:
        assert asked == [(lead, max(e.num_computed_tokens + 1 for e in batch[:lead]))] and meta.num_splits == 7
    else:
        assert asked == [] and meta.num_splits == 0


@pytest.mark.parametrize("seed", range(10))
def test_every_packed_field_is_16_byte_aligned(seed):
    """Triton specializes kernels on 16-byte pointer alignment: a field whose alignment varied with
    the step's sizes compiled new variants mid-run, so every field starts at a multiple of 16."""
    from vmkv.kvcache.metadata import FIELD_ALIGN, step_layout
    rng = random.Random(seed)
    layout, nbytes = step_layout(rng.randint(1, 9000), rng.randint(1, 300), rng.choice([0, rng.randint(1, 200)]))
    assert FIELD_ALIGN == 16 and nbytes % 16 == 0
    assert all(off % 16 == 0 for off, _, _ in layout.values())
