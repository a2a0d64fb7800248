"""The allocator simulation agrees exactly with the BENCHMARKS.md accounting identities."""

import math

import numpy as np
import pytest
import torch

from vmkv.compare.alloc_sim import (
    simulate_paged,
    simulate_reservation,
    simulate_vmem,
    sweep,
    tail_waste_tokens,
    units_needed,
)
from vmkv.compare.shapes import get_shape
from vmkv.kvcache import KVCacheSpec

LLAMA = KVCacheSpec(32, 8, 128, dtype=torch.bfloat16)


def test_llama3_8b_bytes_per_token():
    assert get_shape("llama3-8b").spec().bytes_per_token == 128 * 1024 == LLAMA.bytes_per_token


@pytest.mark.parametrize("B", [1, 2, 3, 16, 64, 256])
def test_tail_waste_range(B):
    T = np.arange(1, 5 * B + 7)
    w = tail_waste_tokens(T, B)
    assert w.min() >= 0 and w.max() <= B - 1
    assert np.all(w == B * np.ceil(T / B).astype(int) - T)
    assert np.all(units_needed(T, B) * B >= T)


@pytest.mark.parametrize("B,k", [(1, 3), (16, 8), (32, 5), (256, 2)])
def test_mean_tail_waste_uniform_is_half_block(B, k):
    lengths = range(1, B * k + 1)  # every T of 1..B*k once: exactly uniform
    r = simulate_paged(lengths, LLAMA, B)
    assert r.mean_tail_waste_tokens == (B - 1) / 2
    assert r.waste_bytes == (B - 1) / 2 * len(lengths) * LLAMA.bytes_per_token
    assert r.units_total == sum(math.ceil(t / B) for t in lengths)
    assert r.allocated_bytes == r.units_total * B * LLAMA.bytes_per_token


def test_reservation_wastes_m_minus_t():
    lengths = [1, 100, 4096, 8192]
    r = simulate_reservation(lengths, LLAMA, 8192, memory_bytes=80 << 30)
    assert r.waste_bytes == sum(8192 - t for t in lengths) * LLAMA.bytes_per_token
    assert r.max_tail_waste_tokens == 8191
    assert r.seqs_in_budget == (80 << 30) // (8192 * 128 * 1024) == 80
    with pytest.raises(ValueError, match="max_model_len"):
        simulate_reservation([8193], LLAMA, 8192)


def test_megacache_2mib_page_is_a_16_token_block():
    lengths = np.random.default_rng(0).integers(1, 3000, 500)
    mega = simulate_vmem(lengths, LLAMA, 2 << 20, "megacache")
    paged = simulate_paged(lengths, LLAMA, 16)
    assert mega.tokens_per_unit == 16
    assert (mega.allocated_bytes, mega.waste_bytes, mega.units_total) == (
        paged.allocated_bytes, paged.waste_bytes, paged.units_total)


def test_per_layer_2mib_page_holds_1024_tokens_per_reservation():
    r = simulate_vmem([1, 1024, 1025], LLAMA, 2 << 20, "per_layer")
    assert r.tokens_per_unit == 1024
    # pages: 64 reservations x (1, 1, 2)
    assert r.units_total == 64 * 4
    assert r.allocated_bytes == 64 * 4 * (2 << 20)
    assert r.waste_bytes == (4 * 1024 - (1 + 1024 + 1025)) * 64 * 2048  # 2 KiB per token per reservation
    assert r.mean_tail_waste_tokens == pytest.approx((1023 + 0 + 1023) / 3)


def test_fractional_token_pages_megacache():
    # 64 KiB page, 128 KiB token: every token is exactly two pages, no waste
    r = simulate_vmem([3, 5], LLAMA, 64 << 10, "megacache")
    assert r.waste_bytes == 0 and r.units_total == 16 and r.tokens_per_unit == 0.5


def test_sweep_covers_all_schemes_and_waste_pct():
    rs = sweep([10, 20, 30], LLAMA, block_sizes=(16,), page_sizes=(2 << 20,), max_model_len=64)
    assert [r.scheme for r in rs] == ["paged", "vmem-megacache", "vmem-per_layer", "reservation"]
    p = rs[0]
    assert p.waste_pct == pytest.approx(100 * (6 + 12 + 2) / 80)
    assert p.bytes_per_used_token == pytest.approx(80 * LLAMA.bytes_per_token / 60)


def test_errors_name_the_value():
    with pytest.raises(ValueError, match="layout"):
        simulate_vmem([1], LLAMA, 4096, "stacked")
    with pytest.raises(ValueError, match=">= 1"):
        simulate_paged([0, 3], LLAMA, 16)
    with pytest.raises(ValueError, match="unit_tokens"):
        units_needed(4, 0)


def test_page_sizes_use_the_engine_size_parser():
    import argparse

    from vmkv.compare.alloc_cli import _size_list
    assert _size_list("64K,2MiB,4096") == [65536, 2 << 20, 4096] and _size_list("1.5M") == [3 << 19]
    with pytest.raises(argparse.ArgumentTypeError, match="byte count"):
        _size_list("4K,lots")


def test_compare_alloc_cli_writes_consistent_results(tmp_path):
    import json

    from vmkv.cli import main

    rc = main(["compare", "alloc", "--model", "llama3-8b", "--seq-len", "1..256", "--num-seqs", "3000",
               "--block-sizes", "16,32", "--page-sizes", "2M", "--max-model-len", "256", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "alloc.json").read_text())
    assert res["bytes_per_token"] == 128 * 1024
    lengths = np.asarray(res["lengths"])
    by = {(r["scheme"], r["block_size"], r["page_size_bytes"]): r for r in res["results"]}
    paged16 = by[("paged", 16, 0)]
    assert paged16["waste_bytes"] == int(tail_waste_tokens(lengths, 16).sum()) * 128 * 1024
    assert paged16["mean_tail_waste_tokens"] == pytest.approx(7.5, abs=0.3)  # (B-1)/2 for uniform lengths
    assert by[("vmem-megacache", 0, 2 << 20)]["waste_bytes"] == paged16["waste_bytes"]
    assert by[("reservation", 0, 0)]["waste_bytes"] == int((256 - lengths).sum()) * 128 * 1024
    assert (tmp_path / "alloc_waste.png").stat().st_size > 0 and "paged" in (tmp_path / "alloc.md").read_text()
