"""Exact byte and page arithmetic of the two vmem layouts on tiny shapes."""

from fractions import Fraction

import pytest
import torch

from vmkv.kvcache.base import KVCacheSpec
from vmkv.vmem.cache import default_host_page_size
from vmkv.vmem.layout import MegacacheLayout, PerLayerLayout, make_layout

PAGE = 4096
# 2 layers, 2 KV heads, head_dim 4, fp32: 32 B per token per K (or V) row, 128 B per token
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def _bases(layout):
    return [torch.zeros(layout.reservation_bytes, dtype=torch.uint8) for _ in range(layout.num_reservations)]


def test_megacache_arithmetic():
    lay = make_layout("megacache", SPEC, max_num_seqs=3, max_model_len=40, page_size_bytes=PAGE)
    assert isinstance(lay, MegacacheLayout)
    assert lay.row_token_bytes == 128
    assert lay.slot_stride_bytes == 8192            # 40 * 128 = 5120 rounded up to 2 pages
    assert lay.pages_per_slot == 2 and lay.reservation_bytes == 3 * 8192
    assert lay.num_reservations == 1 and lay.pages_per_unit == 1
    assert lay.tokens_per_page == 32 and lay.unit_tokens == 32
    assert [lay.num_units(n) for n in (0, 1, 32, 33, 40)] == [0, 1, 1, 2, 2]
    assert lay.pages_for(1, 33) == [(0, 2), (0, 3)]
    assert lay.pages_for(2, 1) == [(0, 4)]
    assert lay.unit_offset(2, 1) == 2 * 8192 + 4096
    assert list(lay.units_overlapping(31, 33)) == [0, 1]
    assert list(lay.units_overlapping(32, 40)) == [1]
    assert list(lay.units_overlapping(5, 5)) == []
    assert lay.unit_used_bytes(33, 0) == PAGE and lay.unit_used_bytes(33, 1) == 128
    assert lay.unit_used_bytes(10, 1) == 0
    assert lay.max_tokens_for_units(1) == 32 and lay.max_tokens_for_units(5) == 40
    assert lay.reservations_for_layer(1) == (0,)


def test_megacache_views_are_strided_into_one_reservation():
    lay = make_layout("megacache", SPEC, max_num_seqs=3, max_model_len=40, page_size_bytes=PAGE)
    bases = _bases(lay)
    keys, values = lay.kv_views(bases)
    assert len(keys) == len(values) == 2
    for layer in range(2):
        for kind, view in ((0, keys[layer]), (1, values[layer])):
            assert view.shape == (3, 40, 2, 4) and view.dtype == torch.float32
            assert view.stride() == (2048, 32, 4, 1)                 # slot stride 8192 B / 4
            assert view.storage_offset() == (2 * layer + kind) * 8
    flat = bases[0].view(torch.float32)
    s, t, h, d = 2, 37, 1, 3
    values[1][s, t, h, d] = 5.0
    # slot row [token][layer][K/V][head][dim]
    index = s * 2048 + t * 32 + (2 * 1 + 1) * 8 + h * 4 + d
    assert flat[index].item() == 5.0 and int((flat != 0).sum()) == 1


def test_per_layer_arithmetic_and_views():
    lay = make_layout("per_layer", SPEC, max_num_seqs=2, max_model_len=200, page_size_bytes=PAGE)
    assert isinstance(lay, PerLayerLayout)
    assert lay.num_reservations == 4 and lay.pages_per_unit == 4
    assert lay.row_token_bytes == 32 and lay.tokens_per_page == 128 and lay.unit_tokens == 128
    assert lay.slot_stride_bytes == 8192 and lay.pages_per_slot == 2   # 6400 B rounded up
    assert lay.reservation_bytes == 2 * 8192
    assert lay.pages_for(1, 129) == [(0, 2), (1, 2), (2, 2), (3, 2), (0, 3), (1, 3), (2, 3), (3, 3)]
    assert lay.pages_for(0, 128) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert lay.reservations_for_layer(0) == (0, 1) and lay.reservations_for_layer(1) == (2, 3)
    assert lay.unit_used_bytes(129, 1) == 32
    bases = _bases(lay)
    keys, values = lay.kv_views(bases)
    for view in keys + values:
        assert view.shape == (2, 200, 2, 4) and view.stride() == (2048, 8, 4, 1)
        assert view.storage_offset() == 0
    assert lay.key_view(bases, 1).data_ptr() == bases[2].data_ptr()
    assert lay.value_view(bases, 0).data_ptr() == bases[1].data_ptr()
    values[0][1, 150, 0, 2] = 3.0          # V of layer 0 is reservation 1
    flat = bases[1].view(torch.float32)
    assert flat[1 * 2048 + 150 * 8 + 0 * 4 + 2].item() == 3.0
    assert all(int(b.count_nonzero()) == 0 for i, b in enumerate(bases) if i != 1)


def test_fractional_tokens_per_page():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=3, head_dim=4, dtype=torch.float32)   # 96 B/token
    lay = make_layout("megacache", spec, max_num_seqs=1, max_model_len=100, page_size_bytes=PAGE)
    assert lay.tokens_per_page == Fraction(4096, 96) and lay.unit_tokens == 0
    assert lay.num_units(42) == 1 and lay.num_units(43) == 2
    assert list(lay.units_overlapping(42, 43)) == [0, 1]   # token 42 straddles the page boundary
    assert lay.max_tokens_for_units(1) == 42


def test_layout_validation():
    with pytest.raises(ValueError, match="unknown vmem layout"):
        make_layout("paged", SPEC, 1, 8, PAGE)
    with pytest.raises(ValueError, match="multiple of the element size"):
        make_layout("megacache", SPEC, 1, 8, 4098)


def test_default_host_page_size():
    llama3 = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert default_host_page_size("megacache", llama3, 8192) == 128 * 1024       # one token
    assert default_host_page_size("per_layer", llama3, 8192) == 64 * 1024        # 32 tokens
    smollm = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert default_host_page_size("megacache", smollm, 8192) == 184320           # 46080 * 4 tokens
    assert default_host_page_size("per_layer", smollm, 8192) == 73728            # 768 B * 96 tokens
    # capped by one slot row: a 16-token row of 256 B tokens needs one OS page
    tiny = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert default_host_page_size("megacache", tiny, 16) == 4096
    # lcm beyond 2 MiB: fall back to 64 KiB (fractional tokens per page)
    odd = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1025, dtype=torch.float32)
    assert default_host_page_size("megacache", odd, 1024) == 64 * 1024
