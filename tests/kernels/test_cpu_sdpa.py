"""The CPU attention path of both layouts: ``impl="auto"`` on CPU runs SDPA (:mod:`vmkv.kernels.sdpa`;
paged gathers each sequence's blocks first), checked against the float64 reference on random inputs:
prefill over a cached prefix, chunked prefill, decode, mixed batches, GQA."""

from __future__ import annotations

import pytest
import torch

from vmkv.kernels import ops
from vmkv.kernels import reference as ref
from vmkv.kernels import sdpa

CPU = torch.device("cpu")
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}

# (seq_lens after the step, query_lens): new tokens are the last query_len positions
CASES = {
    "prefill": ([37, 64], [37, 64]),
    "prefill-cached-prefix": ([50, 33], [18, 1 + 32 - 16]),
    "chunked": ([40, 40, 9], [8, 8, 9]),
    "decode": ([19, 1, 70, 33], [1, 1, 1, 1]),
    "mixed": ([19, 45, 7], [1, 20, 7]),
}


def _layout(kind: str, seq_lens, num_kv, head_dim, dtype, gen):
    """(key, value, index, host index): ``paged<B>`` shuffled blocks or ``slots`` (megacache-like strided
    views of a ``[S, M, 2, 2, H, D]`` tensor)."""
    if kind.startswith("paged"):
        bs = int(kind[len("paged"):])
        nblocks = [-(-n // bs) for n in seq_lens]
        total = sum(nblocks) + 2
        key = torch.randn(total, bs, num_kv, head_dim, generator=gen).to(dtype)
        value = torch.randn(total, bs, num_kv, head_dim, generator=gen).to(dtype)
        perm = torch.randperm(total, generator=gen)
        table = torch.zeros(len(seq_lens), max(nblocks) + 1, dtype=torch.int32)
        used = 0
        for i, n in enumerate(nblocks):
            table[i, :n] = perm[used:used + n]
            used += n
        return key, value, table, None
    mega = torch.randn(len(seq_lens) + 2, max(seq_lens) + 3, 2, 2, num_kv, head_dim, generator=gen).to(dtype)
    key, value = mega[:, :, 1, 0], mega[:, :, 1, 1]
    slots = torch.randperm(len(seq_lens) + 2, generator=gen)[:len(seq_lens)]
    return key, value, slots.to(torch.int32), slots.tolist()


def _run(kind, case, num_heads, num_kv, dtype, impl, head_dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens, query_lens = CASES[case]
    key, value, index, host = _layout(kind, seq_lens, num_kv, head_dim, dtype, gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    common = dict(seq_lens_host=seq_lens, query_lens_host=query_lens, max_query_len=max(query_lens),
                  max_seq_len=max(seq_lens), scale=scale, impl=impl)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    if host is None:
        out = ops.paged_attention(q, key, value, index, qsl, sl, **common)
        expected = ref.paged_attention_ref(q.double(), key.double(), value.double(), index, seq_lens,
                                           query_lens, scale)
    else:
        out = ops.contiguous_attention(q, key, value, index, qsl, sl, slot_indices_host=host, **common)
        expected = ref.contiguous_attention_ref(q.double(), key.double(), value.double(), host, seq_lens,
                                                query_lens, scale)
    return out, expected


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["paged4", "paged16", "slots"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)], ids=["mha", "gqa4", "gqa3"])
def test_cpu_sdpa_matches_float64_reference(kind, case, heads):
    for impl in ("auto", "sdpa"):  # auto on CPU is SDPA
        out, expected = _run(kind, case, *heads, torch.float32, impl)
        assert out.dtype == torch.float32 and out.shape == expected.shape
        torch.testing.assert_close(out.double(), expected, atol=TOL[torch.float32][0],
                                   rtol=TOL[torch.float32][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["paged16", "slots"])
def test_cpu_sdpa_half_dtypes(kind, dtype):
    out, expected = _run(kind, "mixed", 8, 2, dtype, "auto", seed=3)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_cpu_auto_picks_sdpa_and_torch_stays_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(sdpa, "_per_sequence",
                        lambda *a, _f=sdpa._per_sequence: (calls.append(1), _f(*a))[1])
    _run("paged16", "chunked", 8, 2, torch.float32, "auto")
    _run("slots", "chunked", 8, 2, torch.float32, "auto")
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(ref, "attention_one_seq_ref",
                        lambda *a, _f=ref.attention_one_seq_ref: (calls.append("ref"), _f(*a))[1])
    _run("paged16", "chunked", 8, 2, torch.float32, "torch")
    _run("slots", "chunked", 8, 2, torch.float32, "torch")
    assert calls == ["ref"] * 12   # 3 sequences x 2 layouts, for the op and for the float64 expected
    # float64 and a q/cache dtype mismatch stay on the reference
    assert ops._pick("auto", CPU, torch.float64, extra=("sdpa",),
                     sdpa_fits=ops._sdpa_fits(torch.zeros(1, dtype=torch.float64),
                                              torch.zeros(1, dtype=torch.float64))) == "torch"
    assert not ops._sdpa_fits(torch.zeros(1), torch.zeros(1, dtype=torch.float16))


def test_sdpa_paged_rejects_mismatched_lists():
    q = torch.zeros(3, 2, 8)
    cache = torch.zeros(4, 4, 2, 8)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="one entry per sequence"):
        sdpa.sdpa_paged_attention(q, cache, cache, table, [3], [3], 1.0)
    with pytest.raises(ValueError, match="query_lens sum"):
        sdpa.sdpa_paged_attention(q, cache, cache, table, [3, 2], [1, 1], 1.0)
