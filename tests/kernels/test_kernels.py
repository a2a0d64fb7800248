"""Triton kernels against the torch references (kernels/reference.py), both layouts.

Runs natively on CUDA and under ``TRITON_INTERPRET=1`` on CPU (tests/conftest.py sets it), so the CPU
shapes are small.  Every check uses fresh random inputs, poisons the outputs first (NaN) to prove
every element is written, and compares against the reference evaluated in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from vmkv.kernels import _checks, ops
from vmkv.kernels import reference as ref

pytestmark = pytest.mark.triton

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
if not _checks.triton_can_run(DEVICE):  # pragma: no cover - depends on the installation
    pytest.skip("Triton cannot run here (no triton, or CPU without TRITON_INTERPRET=1)",
                allow_module_level=True)

from vmkv.kernels.decode_attention import decode_attention  # noqa: E402
from vmkv.kernels.prefill_attention import prefill_attention  # noqa: E402
from vmkv.kernels.write_kv import write_kv  # noqa: E402

# (atol, rtol) per dtype, against a float64 reference (bf16: 8 mantissa bits, fp16: 11)
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3), torch.float32: (2e-5, 2e-5)}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYOUTS = ["paged4", "paged16", "megacache", "per_layer"]


def _layout_group_params():
    """Every layout x GQA ratio; the ratios 1 and 8 on paged16/per_layer are marked slow (interpreter)."""
    params = []
    for layout in LAYOUTS:
        for group in (1, 4, 8):
            slow = group != 4 and layout in ("paged16", "per_layer")
            marks = [pytest.mark.slow] if slow else []
            params.append(pytest.param(layout, group, marks=marks, id=f"{layout}-gqa{group}"))
    return params


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


class Cache:
    """A random K/V cache in one layout holding ``seq_lens`` tokens per sequence.

    ``kind``: ``paged<B>`` (blocks of B tokens, shuffled physical blocks, spare blocks around),
    ``megacache`` (layer 1 of a ``[S, M, L, 2, H, D]`` reservation: strided views) or ``per_layer``
    (``[S, M, H, D]`` per layer).
    """

    def __init__(self, kind: str, seq_lens: list[int], num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, gen: torch.Generator) -> None:
        self.kind, self.seq_lens = kind, list(seq_lens)
        num_seqs, max_len = len(seq_lens), max(seq_lens)
        self.paged = kind.startswith("paged")
        if self.paged:
            bs = int(kind[len("paged"):])
            nblocks = [-(-n // bs) for n in seq_lens]
            total = sum(nblocks) + 3
            self.key = _randn(total, bs, num_kv_heads, head_dim, dtype=dtype, gen=gen)
            self.value = _randn(total, bs, num_kv_heads, head_dim, dtype=dtype, gen=gen)
            perm = torch.randperm(total, generator=gen)
            table = torch.zeros(num_seqs, max(nblocks) + 1, dtype=torch.int32)  # padded with 0
            used = 0
            for i, n in enumerate(nblocks):
                table[i, :n] = perm[used:used + n]
                used += n
            self.block_tables = table.to(DEVICE)
            self.index = self.block_tables
        else:
            num_slots, slot_len = num_seqs + 2, max_len + 3
            if kind == "megacache":
                mega = _randn(num_slots, slot_len, 3, 2, num_kv_heads, head_dim, dtype=dtype, gen=gen)
                self.key, self.value = mega[:, :, 1, 0], mega[:, :, 1, 1]
            else:
                self.key = _randn(num_slots, slot_len, num_kv_heads, head_dim, dtype=dtype, gen=gen)
                self.value = _randn(num_slots, slot_len, num_kv_heads, head_dim, dtype=dtype, gen=gen)
            slots = torch.randperm(num_slots, generator=gen)[:num_seqs]
            self.slots_host = slots.tolist()
            self.slot_indices = slots.to(torch.int32).to(DEVICE)
            self.index = self.slot_indices

    def kwargs(self) -> dict:
        return {"block_tables": self.block_tables} if self.paged else {"slot_indices": self.slot_indices}

    def reference(self, q: torch.Tensor, query_lens: list[int], scale: float) -> torch.Tensor:
        """float64 reference output."""
        q64, k64, v64 = q.double(), self.key.double(), self.value.double()
        if self.paged:
            return ref.paged_attention_ref(q64, k64, v64, self.block_tables, self.seq_lens, query_lens, scale)
        return ref.contiguous_attention_ref(q64, k64, v64, self.slots_host, self.seq_lens, query_lens, scale)


def _assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "some output elements were never written (NaN poison left)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=atol, rtol=rtol)
    rel = (out.double() - expected).norm() / expected.norm()
    assert rel < {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype], rel


def _query_start_loc(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(query_lens[:i + 1]) for i in range(len(query_lens))],
                        dtype=torch.int32, device=DEVICE)


# ---------------------------------------------------------------------------------------- write_kv
@pytest.mark.parametrize("layout", ["paged16", "megacache", "per_layer"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(layout, dtype):
    gen = _gen(1)
    num_kv_heads, head_dim = 2, 32
    cache = Cache(layout, [17, 1, 33], num_kv_heads, head_dim, dtype, gen)
    dim0, dim1 = cache.key.shape[:2]
    num_tokens = 12
    slot_mapping = torch.randperm(dim0 * dim1, generator=gen)[:num_tokens].to(DEVICE)  # distinct
    k = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    exp_k, exp_v = cache.key.clone(), cache.value.clone()
    ref.write_kv_ref(exp_k, exp_v, k, v, slot_mapping)
    write_kv(cache.key, cache.value, k, v, slot_mapping)
    assert torch.equal(cache.key, exp_k) and torch.equal(cache.value, exp_v)


def test_write_kv_casts_skips_padding_and_leaves_the_rest():
    gen = _gen(2)
    key = _randn(4, 8, 2, 16, dtype=torch.bfloat16, gen=gen)
    value = _randn(4, 8, 2, 16, dtype=torch.bfloat16, gen=gen)
    before_k, before_v = key.clone(), value.clone()
    k = _randn(3, 2, 16, dtype=torch.float32, gen=gen)
    v = _randn(3, 2, 16, dtype=torch.float32, gen=gen)
    slot_mapping = torch.tensor([9, -1, 31], device=DEVICE)
    write_kv(key, value, k, v, slot_mapping)
    # written rows hold k cast to bf16 (one bf16 ulp: the interpreter truncates, CUDA rounds)
    torch.testing.assert_close(key[1, 1].float(), k[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(value[3, 7].float(), v[2], atol=1e-2, rtol=1e-2)
    untouched = torch.ones(4, 8, dtype=torch.bool)
    untouched[1, 1] = untouched[3, 7] = False
    assert torch.equal(key[untouched], before_k[untouched])
    assert torch.equal(value[untouched], before_v[untouched])


def test_write_kv_rejects_bad_inputs():
    key = torch.zeros(2, 4, 2, 16, device=DEVICE)
    value = torch.zeros_like(key)
    k = torch.randn(3, 2, 16, device=DEVICE)
    sm = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        write_kv(key, value, torch.randn(3, 4, 16, device=DEVICE), torch.randn(3, 4, 16, device=DEVICE), sm)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        write_kv(key, value, k, k, sm[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        write_kv(key, value, k, k, sm.float())
    with pytest.raises(ValueError, match="stride"):
        write_kv(key, value, k.transpose(1, 2).contiguous().transpose(1, 2), k, sm)
    with pytest.raises(ValueError, match="dtype"):
        write_kv(key.double(), value.double(), k, k, sm)


# ---------------------------------------------------------------------------------------- decode
# lengths: 1, block/page boundaries (3, 4, 5, 16, 17), ragged and long enough for several splits
DECODE_LENS = [1, 17, 4, 70, 5]


@pytest.mark.parametrize("layout, group", _layout_group_params())
def test_decode_matches_reference(layout, group):
    gen = _gen(10 + group)
    num_kv_heads, head_dim, dtype = 1, 32, torch.bfloat16
    cache = Cache(layout, DECODE_LENS, num_kv_heads, head_dim, dtype, gen)
    q = _randn(len(DECODE_LENS), num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    scale = head_dim ** -0.5
    expected = cache.reference(q, [1] * len(DECODE_LENS), scale)
    sl = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache.key, cache.value, sl, max_seq_len=max(DECODE_LENS), scale=scale,
                         out=out, num_splits=num_splits, block_n=16, **cache.kwargs())
        _assert_matches(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 48, 128])
def test_decode_dtypes_and_head_dims(dtype, head_dim):
    gen = _gen(20 + head_dim)
    lens = [1, 9, 33]
    cache = Cache("paged16", lens, 1, head_dim, dtype, gen)
    q = _randn(len(lens), 4, head_dim, dtype=dtype, gen=gen)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache.key, cache.value, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                     max_seq_len=max(lens), scale=0.3, out=out, num_splits=2, **cache.kwargs())
    _assert_matches(out, cache.reference(q, [1] * len(lens), 0.3), dtype)


def test_decode_many_splits_merge_in_chunks():
    """19 splits: the merge kernel loops over chunks of 16; the short sequences have empty splits."""
    gen = _gen(25)
    lens = [300, 1, 17]
    cache = Cache("megacache", lens, 1, 16, torch.float16, gen)
    q = _randn(len(lens), 2, 16, dtype=torch.float16, gen=gen)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache.key, cache.value, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                     max_seq_len=300, scale=0.25, out=out, num_splits=19, block_n=16, **cache.kwargs())
    _assert_matches(out, cache.reference(q, [1] * len(lens), 0.25), torch.float16)


@pytest.mark.parametrize("layout", ["paged16", "megacache"])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_padding_rows_and_a_grid_sized_for_any_context(layout, num_splits):
    """A captured CUDA graph's launch: the grid is sized for the longest possible context (8 splits
    over sequences of 1..40 tokens: each sequence cuts its own context), padding rows (seq_len 0)
    read nothing and come out 0, and a workspace dict is reused by a second call."""
    gen = _gen(26 + num_splits)
    lens = [40, 1, 17]
    cache = Cache(layout, lens, 2, 32, torch.bfloat16, gen)
    padded = lens + [0, 0]
    if cache.paged:
        kwargs = {"block_tables": torch.cat([cache.block_tables,
                                             torch.zeros(2, cache.block_tables.shape[1], dtype=torch.int32,
                                                         device=DEVICE)])}
    else:
        kwargs = {"slot_indices": torch.cat([cache.slot_indices,
                                             torch.zeros(2, dtype=torch.int32, device=DEVICE)])}
    q = _randn(len(padded), 4, 32, dtype=torch.bfloat16, gen=gen)
    sl = torch.tensor(padded, dtype=torch.int32, device=DEVICE)
    workspace: dict = {}
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache.key, cache.value, sl, max_seq_len=40, scale=0.2, out=out,
                         num_splits=num_splits, block_n=16, workspace=workspace, **kwargs)
        _assert_matches(out[:3], cache.reference(q[:3], [1] * 3, 0.2), torch.bfloat16)
        assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert len(workspace) == (1 if num_splits > 1 else 0)


def test_decode_rejects_bad_inputs():
    gen = _gen(3)
    cache = Cache("paged4", [5, 7], 2, 16, torch.float16, gen)
    q = _randn(2, 4, 16, dtype=torch.float16, gen=gen)
    sl = torch.tensor([5, 7], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="exactly one"):
        decode_attention(q, cache.key, cache.value, sl, max_seq_len=7, scale=1.0)
    with pytest.raises(ValueError, match="cast q"):
        decode_attention(q.float(), cache.key, cache.value, sl, max_seq_len=7, scale=1.0,
                         block_tables=cache.block_tables)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention(q[:, :3], cache.key, cache.value, sl, max_seq_len=7, scale=1.0,
                         block_tables=cache.block_tables)
    with pytest.raises(ValueError, match="stride"):
        decode_attention(q, cache.key.transpose(2, 3).contiguous().transpose(2, 3), cache.value, sl,
                         max_seq_len=7, scale=1.0, block_tables=cache.block_tables)
    with pytest.raises(ValueError, match="fewer than max_seq_len"):
        decode_attention(q, cache.key, cache.value, sl, max_seq_len=100, scale=1.0,
                         block_tables=cache.block_tables)
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        decode_attention(q, cache.key, cache.value, sl[:1], max_seq_len=7, scale=1.0,
                         block_tables=cache.block_tables)


# ---------------------------------------------------------------------------------------- prefill
# (seq_len, query_len): full prefill, chunked prefill after a prefix, a decode token in the batch,
# a length-1 prompt, chunks crossing block/page boundaries
PREFILL_CASES = [(21, 21), (37, 6), (9, 1), (1, 1), (33, 17)]


@pytest.mark.parametrize("layout, group", _layout_group_params())
def test_prefill_matches_reference(layout, group):
    gen = _gen(30 + group)
    num_kv_heads, head_dim, dtype = 1, 16, torch.bfloat16
    seq_lens = [s for s, _ in PREFILL_CASES]
    query_lens = [n for _, n in PREFILL_CASES]
    cache = Cache(layout, seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = _randn(sum(query_lens), num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    expected = cache.reference(q, query_lens, 0.25)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache.key, cache.value, _query_start_loc(query_lens),
                      torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                      max_query_len=max(query_lens), scale=0.25, out=out,
                      config=(32, 16 if layout == "paged16" else 32, 4, 1),  # paged16: one block per tile
                      **cache.kwargs())
    _assert_matches(out, expected, dtype)


@pytest.mark.parametrize("layout", ["paged16", "megacache"])
@pytest.mark.parametrize("seq_start", [1, 2, 3])
def test_prefill_seq_start_attends_the_later_sequences_only(layout, seq_start):
    """``seq_start=k``: the first k sequences' rows of ``out`` stay as they were (NaN poison), the rest
    equal the float64 reference."""
    gen = _gen(60 + seq_start)
    seq_lens, query_lens = [9, 30, 17, 40], [1, 4, 17, 11]
    cache = Cache(layout, seq_lens, 2, 16, torch.float16, gen)
    q = _randn(sum(query_lens), 4, 16, dtype=torch.float16, gen=gen)
    expected = cache.reference(q, query_lens, 0.25)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache.key, cache.value, _query_start_loc(query_lens),
                      torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), max_query_len=max(query_lens),
                      scale=0.25, out=out, seq_start=seq_start, **cache.kwargs())
    first = sum(query_lens[:seq_start])
    assert torch.isnan(out[:first]).all()
    _assert_matches(out[first:], expected[first:], torch.float16)
    with pytest.raises(ValueError, match="seq_start"):
        prefill_attention(q, cache.key, cache.value, _query_start_loc(query_lens),
                          torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                          max_query_len=max(query_lens), scale=0.25, seq_start=5, **cache.kwargs())


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_key_and_value_caches_with_different_strides(paged):
    """K in its own tensor, V a strided view of a larger one: the V row offsets are computed apart."""
    gen = _gen(35)
    lens, query_lens = [23, 5], [6, 5]
    cache = Cache("paged8" if paged else "per_layer", lens, 2, 16, torch.float16, gen)
    wide = _randn(*cache.value.shape[:2], 3, *cache.value.shape[2:], dtype=torch.float16, gen=gen)
    wide[:, :, 1] = cache.value
    cache.value = wide[:, :, 1]
    assert cache.key.stride() != cache.value.stride()
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(query_lens), 4, 16, dtype=torch.float16, gen=gen)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache.key, cache.value, _query_start_loc(query_lens), sl, max_query_len=6,
                      scale=0.25, out=out, config=(16, 16, 4, 1), **cache.kwargs())
    _assert_matches(out, cache.reference(q, query_lens, 0.25), torch.float16)
    qd = _randn(len(lens), 4, 16, dtype=torch.float16, gen=gen)
    outd = torch.full_like(qd, float("nan"))
    decode_attention(qd, cache.key, cache.value, sl, max_seq_len=23, scale=0.25, out=outd, num_splits=2,
                     block_n=16, **cache.kwargs())
    _assert_matches(outd, cache.reference(qd, [1, 1], 0.25), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_default_tiles_and_head_dim_64(dtype):
    gen = _gen(40)
    seq_lens, query_lens = [150, 7, 64], [150, 3, 40]
    cache = Cache("megacache", seq_lens, 2, 64, dtype, gen)
    q = _randn(sum(query_lens), 4, 64, dtype=dtype, gen=gen)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache.key, cache.value, _query_start_loc(query_lens),
                      torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                      max_query_len=max(query_lens), scale=0.125, out=out, slot_indices=cache.slot_indices)
    _assert_matches(out, cache.reference(q, query_lens, 0.125), dtype)


def test_prefill_rejects_bad_inputs():
    gen = _gen(4)
    cache = Cache("per_layer", [5, 7], 2, 16, torch.float16, gen)
    q = _randn(4, 4, 16, dtype=torch.float16, gen=gen)
    sl = torch.tensor([5, 7], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        prefill_attention(q, cache.key, cache.value, _query_start_loc([4]), sl, max_query_len=4,
                          scale=1.0, slot_indices=cache.slot_indices)
    with pytest.raises(ValueError, match="exactly one"):
        prefill_attention(q, cache.key, cache.value, _query_start_loc([2, 2]), sl, max_query_len=2,
                          scale=1.0)
    with pytest.raises(ValueError, match="must have 3 dimensions"):
        prefill_attention(q[0], cache.key, cache.value, _query_start_loc([2, 2]), sl, max_query_len=2,
                          scale=1.0, slot_indices=cache.slot_indices)


# ---------------------------------------------------------------------------------------- ops dispatch
def _step(layout: str, seq_lens: list[int], query_lens: list[int], impl: str, dtype=torch.float16,
          num_decodes: int = 0, seed: int = 50):
    gen = _gen(seed)
    cache = Cache(layout, seq_lens, 2, 32, dtype, gen)
    q = _randn(sum(query_lens), 8, 32, dtype=dtype, gen=gen)
    common = dict(query_start_loc=_query_start_loc(query_lens),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                  seq_lens_host=seq_lens, query_lens_host=query_lens, max_query_len=max(query_lens),
                  max_seq_len=max(seq_lens), scale=32 ** -0.5, impl=impl, num_decodes=num_decodes)
    if cache.paged:
        out = ops.paged_attention(q, cache.key, cache.value, cache.block_tables, **common)
    else:
        out = ops.contiguous_attention(q, cache.key, cache.value, cache.slot_indices,
                                       slot_indices_host=cache.slots_host, **common)
    return out, cache.reference(q, query_lens, 32 ** -0.5)


@pytest.mark.parametrize("layout", ["paged16", "megacache"])
@pytest.mark.parametrize("impl", ["triton", "torch", "auto"])
@pytest.mark.parametrize("lens", [([19, 1, 40], [1, 1, 1]), ([19, 1, 40], [19, 1, 8])],
                         ids=["decode", "mixed"])
def test_ops_dispatch_matches_reference(layout, impl, lens):
    out, expected = _step(layout, *lens, impl=impl)
    _assert_matches(out, expected, torch.float16)


@pytest.mark.parametrize("layout", ["paged16", "megacache", "per_layer"])
@pytest.mark.parametrize("num_decodes, lens", [
    (2, ([19, 7, 33, 40], [1, 1, 5, 40])),          # decodes, then a chunk and a whole prompt
    (1, ([64, 3], [1, 3])),                         # one decode before one prefill
    (3, ([5, 70, 1, 24], [1, 1, 1, 24])),           # a one-token prompt among the decodes
])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_step_splits_decode_rows_from_prefill_rows(layout, num_decodes, lens, seed):
    """A mixed step with ``num_decodes`` leading one-token rows runs them through the decode kernel and
    the rest through the prefill kernel; the one output equals the float64 reference everywhere."""
    out, expected = _step(layout, *lens, impl="triton", num_decodes=num_decodes, seed=seed)
    _assert_matches(out, expected, torch.float16)


@pytest.mark.parametrize("lens", [([12, 12, 12], [1, 1, 1]), ([12, 12, 12], [12, 12, 12]),
                                  ([19, 1, 40], [1, 1, 1]), ([19, 3, 40], [19, 2, 8])],
                         ids=["decode-batched", "prefill-batched", "decode-ragged", "chunked"])
@pytest.mark.parametrize("layout", ["megacache", "per_layer"])
def test_ops_sdpa_on_slot_views(layout, lens):
    out, expected = _step(layout, *lens, impl="sdpa")
    _assert_matches(out, expected, torch.float16)


def test_ops_sdpa_batches_consecutive_slots():
    """Uniform lengths in consecutive slots run as one SDPA call on a strided view."""
    gen = _gen(60)
    mega = _randn(6, 20, 2, 2, 2, 16, dtype=torch.float32, gen=gen)
    key, value = mega[:, :, 0, 0], mega[:, :, 0, 1]
    q = _randn(4, 4, 16, dtype=torch.float32, gen=gen)
    out = ops.contiguous_attention(
        q, key, value, torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=DEVICE),
        _query_start_loc([1] * 4), torch.full((4,), 11, dtype=torch.int32, device=DEVICE),
        seq_lens_host=[11] * 4, query_lens_host=[1] * 4, max_query_len=1, max_seq_len=11, scale=0.25,
        slot_indices_host=[1, 2, 3, 4], impl="sdpa")
    expected = ref.contiguous_attention_ref(q.double(), key.double(), value.double(), [1, 2, 3, 4],
                                            [11] * 4, [1] * 4, 0.25)
    _assert_matches(out, expected, torch.float32)


def test_ops_rejects_unknown_impl_and_auto_is_sdpa_on_cpu():
    with pytest.raises(ValueError, match="impl must be one of"):
        _step("paged16", [3], [1], impl="cuda")
    cpu = torch.device("cpu")
    for dtype in ops.SDPA_DTYPES:   # the CPU path of both layouts is SDPA (paged gathers first)
        assert ops._pick("auto", cpu, dtype, extra=("sdpa",), sdpa_fits=True) == "sdpa"
    assert ops._pick("auto", cpu, torch.float32, extra=("sdpa",), sdpa_fits=False) == "torch"
    assert ops._pick("auto", cpu, torch.float32) == "torch"            # write_kv offers no sdpa
    assert ops._pick("torch", cpu, torch.float32, extra=("sdpa",), sdpa_fits=True) == "torch"
    assert ops._pick("auto", DEVICE, torch.float64) == "torch"
    assert ops._pick("auto", DEVICE, torch.float16, fits=False) == "torch"
    cache = torch.zeros(4, 12, 2, 16, dtype=torch.float16, device=DEVICE)  # block size 12: not a power of 2
    assert not ops._kernel_fits(None, cache, paged=True) and ops._kernel_fits(None, cache, paged=False)
    assert not ops._kernel_fits(torch.zeros(1, 2, 16, device=DEVICE), cache, paged=False)  # fp32 q, fp16 cache


def test_choose_num_splits_fills_the_device():
    from vmkv.kernels.decode_attention import choose_num_splits
    sms = _checks.num_sms(DEVICE)
    assert choose_num_splits(1, 8, 32768, DEVICE, 64) * 8 >= 2 * sms or sms * 2 > 8 * 32768 // 256
    assert choose_num_splits(256, 8, 4096, DEVICE, 64) == 1 or 256 * 8 < 2 * sms
    assert choose_num_splits(1, 8, 100, DEVICE, 64) == 1  # short contexts are not split


# ---------------------------------------------------------------------------------------- native, larger
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["paged16", "paged256", "megacache"])
def test_native_long_context_gqa4(layout):
    """Bench-like shapes (head_dim 128, GQA 4, contexts of thousands) on the GPU."""
    gen = _gen(70)
    lens = [4096, 1, 2999, 7000]
    cache = Cache(layout, lens, 8, 128, torch.bfloat16, gen)
    q = _randn(len(lens), 32, 128, dtype=torch.bfloat16, gen=gen)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache.key, cache.value, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                     max_seq_len=max(lens), scale=128 ** -0.5, out=out, **cache.kwargs())
    _assert_matches(out, cache.reference(q, [1] * len(lens), 128 ** -0.5), torch.bfloat16)
    query_lens = [512, 1, 300, 129]
    qp = _randn(sum(query_lens), 32, 128, dtype=torch.bfloat16, gen=gen)
    outp = torch.full_like(qp, float("nan"))
    prefill_attention(qp, cache.key, cache.value, _query_start_loc(query_lens),
                      torch.tensor(lens, dtype=torch.int32, device=DEVICE), max_query_len=512,
                      scale=128 ** -0.5, out=outp, **cache.kwargs())
    _assert_matches(outp, cache.reference(qp, query_lens, 128 ** -0.5), torch.bfloat16)
    assert math.isfinite(outp.float().abs().max().item())


def test_reference_write_kv_skips_padding_rows():
    """The torch reference honours the kernels' padding contract: slot -1 writes nothing (it used to
    wrap around to the last entry)."""
    kc, vc = torch.zeros(3, 4, 1, 2), torch.zeros(3, 4, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2) + 1
    ref.write_kv_ref(kc, vc, k, -k, torch.tensor([5, -1, 0]))
    assert kc[1, 1].tolist() == [[1.0, 2.0]] and kc[0, 0].tolist() == [[5.0, 6.0]]
    assert int((kc != 0).any(-1).sum()) == 2 and kc[2, 3].abs().sum() == 0
