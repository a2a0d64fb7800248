"""Exact byte and page arithmetic of the two vmem layouts on tiny shapes."""

from fractions import Fraction

import pytest
import torch

from vmem_helpers import checked_drivers, check_launch_pointers, random_kv  # noqa: F401 - checked_drivers is an autouse fixture
from vmkv.kernels import _checks, ops
from vmkv.kernels.reference import attention_one_seq_ref
from vmkv.kvcache.base import KVCacheSpec, StepSeq
from vmkv.vmem.cache import VMemKVCache, default_host_page_size
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
    assert lay.guard_bytes == PAGE and lay.guard_offsets() == [0]
    assert lay.pages_per_slot == 2 and lay.reservation_bytes == PAGE + 3 * 8192   # guard page first
    assert lay.num_reservations == 1 and lay.pages_per_unit == 1
    assert lay.tokens_per_page == 32 and lay.unit_tokens == 32
    assert [lay.num_units(n) for n in (0, 1, 32, 33, 40)] == [0, 1, 1, 2, 2]
    assert lay.pages_for(1, 33) == [(0, 3), (0, 4)]                # page 0 is the guard
    assert lay.pages_for(2, 1) == [(0, 5)]
    assert lay.unit_offset(2, 1) == PAGE + 2 * 8192 + 4096
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
            assert view.storage_offset() == PAGE // 4 + (2 * layer + kind) * 8   # after the guard
    flat = bases[0].view(torch.float32)
    s, t, h, d = 2, 37, 1, 3
    values[1][s, t, h, d] = 5.0
    # guard page, then slot rows [token][layer][K/V][head][dim]
    index = PAGE // 4 + s * 2048 + t * 32 + (2 * 1 + 1) * 8 + h * 4 + d
    assert flat[index].item() == 5.0 and int((flat != 0).sum()) == 1


def test_per_layer_arithmetic_and_views():
    lay = make_layout("per_layer", SPEC, max_num_seqs=2, max_model_len=200, page_size_bytes=PAGE)
    assert isinstance(lay, PerLayerLayout)
    assert lay.num_reservations == 4 and lay.pages_per_unit == 4
    assert lay.row_token_bytes == 32 and lay.tokens_per_page == 128 and lay.unit_tokens == 128
    assert lay.slot_stride_bytes == 8192 and lay.pages_per_slot == 2   # 6400 B rounded up
    assert lay.reservation_bytes == PAGE + 2 * 8192
    assert lay.pages_for(1, 129) == [(0, 3), (1, 3), (2, 3), (3, 3), (0, 4), (1, 4), (2, 4), (3, 4)]
    assert lay.pages_for(0, 128) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert lay.reservations_for_layer(0) == (0, 1) and lay.reservations_for_layer(1) == (2, 3)
    assert lay.unit_used_bytes(129, 1) == 32
    bases = _bases(lay)
    keys, values = lay.kv_views(bases)
    for view in keys + values:
        assert view.shape == (2, 200, 2, 4) and view.stride() == (2048, 8, 4, 1)
        assert view.storage_offset() == PAGE // 4
    assert lay.key_view(bases, 1).data_ptr() == bases[2].data_ptr() + PAGE
    assert lay.value_view(bases, 0).data_ptr() == bases[1].data_ptr() + PAGE
    values[0][1, 150, 0, 2] = 3.0          # V of layer 0 is reservation 1
    flat = bases[1].view(torch.float32)
    assert flat[PAGE // 4 + 1 * 2048 + 150 * 8 + 0 * 4 + 2].item() == 3.0
    assert all(int(b.count_nonzero()) == 0 for i, b in enumerate(bases) if i != 1)


@pytest.mark.parametrize("name", ["megacache", "per_layer"])
def test_anchors_are_the_guard_page_at_or_below_every_view(name):
    """Every K/V view's launch pointer is the guard page of its own reservation, a whole number of
    elements below the view (what ``vmkv.kernels._checks.launch_base`` turns into the kernel offset)."""
    lay = make_layout(name, SPEC, max_num_seqs=2, max_model_len=200, page_size_bytes=PAGE)
    bases = _bases(lay)
    keys, values = lay.kv_views(bases)
    k_anchors, v_anchors = lay.kv_anchors(bases)
    for views, anchors in ((keys, k_anchors), (values, v_anchors)):
        for view, anchor in zip(views, anchors):
            assert anchor.dtype == view.dtype and anchor.numel() == 1
            owner = [b for b in bases if b.data_ptr() <= view.data_ptr() < b.data_ptr() + b.numel()]
            assert len(owner) == 1 and anchor.data_ptr() == owner[0].data_ptr()   # the guard page
            delta = view.data_ptr() - anchor.data_ptr()
            assert PAGE <= delta < PAGE + lay.row_token_bytes and delta % 4 == 0   # slot 0 follows it


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


# ---------------------------------------------------------------------------- launch pointers
needs_triton = pytest.mark.skipif(not _checks.triton_can_run(torch.device("cpu")),
                                  reason="Triton cannot run here (no triton, or TRITON_INTERPRET unset)")


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("name", ["megacache", "per_layer"])
def test_kernel_launches_get_backed_pointers_while_slot0_is_unmapped(monkeypatch, name):
    """Issue 9: slot 0's pages are reclaimed for the sequence in slot 1, so the K/V views' first
    element (slot 0, position 0) is reserved but unmapped.  Every pointer the write, prefill and decode
    launches receive must still be backed (Triton's launcher refuses it otherwise: "Pointer argument
    (at 2) cannot be accessed from Triton"), and the results must match the reference."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    probe = make_layout(name, spec, 1, 256, PAGE)
    c = VMemKVCache(spec, max_num_seqs=3, max_model_len=256, memory_bytes=3 * probe.bytes_per_unit,
                    driver="host", layout=name, page_size_bytes=PAGE, enable_prefix_caching=False)
    launches = check_launch_pointers(monkeypatch, c.driver)
    ut = c.unit_tokens                                   # 16 (megacache) or 64 (per_layer) tokens
    c.allocate("a", ut)
    c.allocate("b", ut)
    assert (c.slot_of("a"), c.slot_of("b")) == (0, 1)
    c.free("a")                                          # slot 0 keeps its unit mapped ...
    c.extend("b", 2 * ut - 1)                            # ... until b's growth reclaims it
    assert c.vmm_stats()["num_reclaimed_pages"] == c.layout.pages_per_unit
    states = [c.driver.page_state(view.data_ptr()) for layer in range(spec.num_layers)
              for view in (c.key_view(layer), c.value_view(layer))]
    assert states == ["unmapped"] * 2 * spec.num_layers   # the view bases: what crashed on the H200
    c.check_integrity()                                  # includes: every launch anchor is backed
    # (a failure is reported without a traceback: pytest would print the frames' tensor arguments,
    # and reading a view over unmapped pages is a segfault on the host driver)
    error = _prefill_then_decode(c, spec, ut)
    if error:
        pytest.fail(error, pytrace=False)
    kernels = {k for k, _, _ in launches}
    assert {"_write_kv_kernel", "_prefill_kernel", "_decode_split_kernel"} <= kernels
    assert {s for _, _, s in launches} <= {"outside", "mapped", "guard"}
    assert any(s == "guard" for _, _, s in launches)
    c.check_integrity()
    c.close()


def _prefill_then_decode(c, spec, ut) -> str | None:
    """A prefill of ``3 * ut - 1`` tokens then one decode of sequence "b", every layer, checked against
    the reference; returns what went wrong, or None."""
    scale = spec.head_dim ** -0.5
    written = {}
    try:
        for e, grow in [(StepSeq("b", 0, 3 * ut - 1), 0), (StepSeq("b", 3 * ut - 1, 1), 1)]:
            if grow:
                c.extend("b", grow)
            meta = c.prepare([e])
            for layer in range(spec.num_layers):
                k, v = random_kv(spec, e.num_new_tokens, seed=10 * e.num_computed_tokens + layer)
                q = torch.randn(e.num_new_tokens, 4, spec.head_dim)
                c.write_kv(layer, k, v, meta)
                out = c.attention(layer, q, meta)
                ok, ov = written.get(layer, (k[:0], v[:0]))
                written[layer] = ok, ov = torch.cat([ok, k]), torch.cat([ov, v])
                ref = attention_one_seq_ref(q, ok, ov, e.num_computed_tokens, scale)
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        for layer, (ok, ov) in written.items():
            gk, gv = c.gather("b", layer)
            if not (torch.equal(gk, ok) and torch.equal(gv, ov)):
                return f"layer {layer}: gathered K/V differ from what was written"
    except (ValueError, AssertionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_guard_pages_are_mapped_once_and_released_with_the_cache():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    for name, num_reservations in (("megacache", 1), ("per_layer", 4)):
        c = VMemKVCache(spec, max_num_seqs=2, max_model_len=64, memory_bytes=1 << 20, driver="host",
                        layout=name, page_size_bytes=PAGE)
        drv = c.driver
        assert drv.num_guards == num_reservations and drv.num_mappings == 0 and drv.num_pages == 0
        k_anchors, v_anchors = c.layout.kv_anchors(c.base_tensors)
        assert all(drv.page_state(a.data_ptr()) == "guard" for a in k_anchors + v_anchors)
        c.allocate(1, 20)
        c.free(1)
        assert drv.num_guards == num_reservations
        c.close()
        assert drv.num_guards == 0 and drv.num_reservations == 0


@pytest.mark.triton
@needs_triton
def test_anchored_launch_writes_the_same_places():
    """``write_kv`` with an anchor below the views writes exactly what it writes without one."""
    storage = torch.zeros(64 + 2 * 3 * 5 * 2 * 4, dtype=torch.float32)
    anchor = storage[:1]
    caches = storage[64:].view(2, 3, 5, 2, 4)            # [K/V][dim0][dim1][H][D]
    k, v = torch.randn(4, 2, 4), torch.randn(4, 2, 4)
    slots = torch.tensor([0, 7, 9, 14])
    ops.write_kv(caches[0], caches[1], k, v, slots, impl="triton", key_anchor=anchor, value_anchor=anchor)
    want_k, want_v = torch.zeros(3, 5, 2, 4), torch.zeros(3, 5, 2, 4)
    ops.write_kv(want_k, want_v, k, v, slots, impl="torch")
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)
    assert int(storage[:64].count_nonzero()) == 0        # nothing written through the anchor itself
    with pytest.raises(ValueError, match="anchor must lie at or below"):
        _checks.launch_base("key_cache", caches[0], storage[100:101])
    with pytest.raises(ValueError, match="must match the cache"):
        _checks.launch_base("key_cache", caches[0], anchor.double())
