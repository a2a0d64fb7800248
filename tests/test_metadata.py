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
