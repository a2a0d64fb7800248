"""The host-side bookkeeping imports and runs without torch (DESIGN.md: "the id/page bookkeeping is
host-only and torch-free"): the sequence table, the prefix index, the check-then-apply plan, the
paged block manager and vmem's page table, page pool, slot mapper, placement and layout arithmetic,
in a subprocess where ``import torch`` fails.

The vmem cycles run on :class:`FakeDriver`, an in-memory :class:`~vmkv.vmem.protocol.PageDriver`
(addresses and handles only, no memory), wrapped in the validating
the checked driver (``tests/checked_driver.py``).  This module imports nothing torch-side at module
level, so the subprocess imports it and calls the scenario functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

TORCH_FREE = ["vmkv.kvcache.errors", "vmkv.kvcache.records", "vmkv.kvcache.hashing",
              "vmkv.kvcache.prefix", "vmkv.kvcache.room", "vmkv.kvcache.seqtable",
              "vmkv.paged.block_pool", "vmkv.paged.block_manager",
              "vmkv.vmem.protocol", "vmkv.vmem.page_table", "vmkv.vmem.page_pool", "vmkv.vmem.slots",
              "vmkv.vmem.reclaim", "vmkv.vmem.mapper", "vmkv.vmem.checks", "vmkv.vmem.placement",
              "vmkv.vmem.elastic", "vmkv.vmem.layout", "checked_driver"]


def _run_torch_free(body: str) -> None:
    """Run ``body`` in a fresh interpreter where ``import torch`` raises; it must print ``ok``."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None          # any `import torch` raises ImportError
        sys.path[:0] = [{here!r}, {tests!r}]    # this module, and tests/ (checked_driver)
    """).format(here=os.path.dirname(os.path.abspath(__file__)),
                tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + textwrap.dedent(body) + textwrap.dedent("""
        assert "torch" not in [k for k, v in sys.modules.items() if v is not None]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_bookkeeping_imports_and_runs_without_torch():
    _run_torch_free(f"""
        import importlib
        for name in {TORCH_FREE!r}:
            importlib.import_module(name)
        from vmkv.kvcache.prefix import PrefixIndex
        from vmkv.kvcache.seqtable import SeqState, SeqTable
        from vmkv.paged.block_manager import BlockManager
        seqs = SeqTable(max_num_seqs=2, max_model_len=16)
        m = BlockManager(4, 4, 2, 4, PrefixIndex())
        room = m.plan_allocate(seqs.check_new(1, 6, None), [])
        room.check()
        table, row = m.allocate(room)
        seqs.add(SeqState(1, 6, table, 2, 0, None, row))
        table2, row2 = m.fork(seqs.get(1))
        seqs.add(seqs.get(1).fork(2, table2, row2))
        cow = m.plan_cow([(seqs.get(2), range(1, 2))])
        assert cow.num_needed == 1, cow
        assert m.apply_cow(cow) == [(1, 2)]
        m.check_integrity(seqs)
    """)


def test_vmem_page_bookkeeping_runs_without_torch():
    _run_torch_free("""
        import test_kvcache_torch_free as t
        t.vmem_allocate_grow_share_free_reclaim("megacache")
        t.vmem_allocate_grow_share_free_reclaim("per_layer")
        t.vmem_prefix_hit_and_out_of_memory()
    """)


# ---------------------------------------------------------------------------- in-memory driver
class FakeDriver:
    """An in-memory :class:`~vmkv.vmem.protocol.PageDriver`: reservations are address ranges, pages
    are handles; nothing is backed.  ``max_pages`` makes ``create_page`` fail with ``ENOMEM`` past
    that many live pages (a full device)."""

    name = "fake"
    calls = {"create_page": "create", "map": "map", "unmap": "unmap"}
    invalid_code = "EINVAL"

    def __init__(self, page_size_bytes: int, max_pages: int | None = None) -> None:
        self.page_size_bytes = page_size_bytes
        self.max_pages = max_pages
        self._next_va = 1 << 32
        self._next_handle = 1
        self.live_pages: set[int] = set()
        self.num_fences = 0

    def reserve(self, nbytes: int) -> int:
        va = self._next_va
        self._next_va += nbytes + (1 << 30)       # a gap between reservations
        return va

    def free_reservation(self, va: int, nbytes: int) -> None:
        pass

    def create_page(self) -> int:
        from vmkv.vmem.protocol import VMMError
        if self.max_pages is not None and len(self.live_pages) >= self.max_pages:
            raise VMMError("create", "ENOMEM", "fake device full")
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.live_pages.add(handle)
        return handle

    def release(self, handle: int) -> None:
        self.live_pages.remove(handle)

    def map(self, va: int, handle: int, *, set_access: bool = True) -> None:
        pass

    def set_access(self, va: int, nbytes: int) -> None:
        pass

    def unmap(self, va: int) -> None:
        pass

    def map_guard(self, va: int) -> None:
        pass

    def record_fence(self) -> object:
        self.num_fences += 1
        return self.num_fences

    def fence_done(self, fence: object) -> bool:
        return True

    def wait_fence(self, fence: object) -> None:
        pass

    def close(self) -> None:
        pass


def fake_spec(num_layers: int = 2, num_kv_heads: int = 1, head_dim: int = 4, dtype_bytes: int = 4):
    """The byte arithmetic of a ``KVCacheSpec`` (which imports torch) for the layouts."""
    head_bytes = head_dim * dtype_bytes
    return SimpleNamespace(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           dtype_bytes=dtype_bytes, head_bytes=head_bytes,
                           bytes_per_token=2 * num_layers * num_kv_heads * head_bytes)


def make_mapper(layout_name: str, max_pages: int, max_num_seqs: int = 3, max_model_len: int = 16,
                device_pages: int | None = None):
    """A slot mapper over a checked :class:`FakeDriver` with 4 tokens per page (every layout)."""
    from vmkv.kvcache.prefix import PrefixIndex
    from checked_driver import CheckedDriver
    from vmkv.vmem.layout import LAYOUTS, make_layout
    from vmkv.vmem.mapper import SlotMapper
    from vmkv.vmem.page_pool import PagePool

    spec = fake_spec()
    page_size_bytes = 4 * LAYOUTS[layout_name].token_bytes_in_row(spec)
    layout = make_layout(layout_name, spec, max_num_seqs, max_model_len, page_size_bytes)
    assert layout.unit_tokens == 4
    drv = CheckedDriver(FakeDriver(layout.page_size_bytes, device_pages))
    prefix = PrefixIndex()
    pool = PagePool(drv, max_pages * layout.pages_per_unit, False, prefix)
    mapper = SlotMapper(drv, layout, pool, prefix)
    layout.map_guards(drv, mapper.bases)
    return mapper, drv


def vmem_allocate_grow_share_free_reclaim(layout_name: str) -> None:
    """Exact page counts through allocate, grow, fork, copy-on-write, free, a refused and an admitted
    allocation that reclaims a kept page, and the final reclaim of everything (counts per unit:
    one page per unit on megacache, ``2 * num_layers`` on per_layer)."""
    from vmkv.vmem.placement import pick_fork_slot, pick_slot

    m, drv = make_mapper(layout_name, max_pages=6)
    k = m.layout.pages_per_unit
    pool, table = m.pool, m.table

    def counts():
        m.check_integrity()
        return (pool.num_in_use // k, m.num_allocated_pages() // k, drv.num_mappings // k,
                m.available_pages() // k)

    # allocate 8 tokens = 2 units in the lowest empty slot
    s0 = pick_slot(m, 2, [])
    assert s0.index == 0 and m.plan_occupy(s0, 2, []) == (2 * k, 6 * k)
    m.occupy(s0, 1, 2, [])
    assert counts() == (2, 2, 2, 4)
    # grow to 3 units
    assert m.plan_grow(s0, 3, []) == (k, 4 * k)
    assert m.grow(s0, 3, [], copy_below_bytes=8 * m.layout.row_token_bytes) == []
    assert counts() == (3, 3, 3, 3)
    # fork: the child maps the parent's 3 units, no new page
    s1 = pick_fork_slot(m, s0, 3)
    assert s1.index == 1
    m.share(s1, s0, 2, 3)
    assert counts() == (3, 3, 6, 3) and all(m.refcount(p) == 2 for p in s0.units[2])
    assert m.any_shared(s1, [2]) and not m.any_shared(s1, [])
    # copy-on-write of the child's last unit: one fresh page per reservation, one copy each
    res = range(m.num_res)
    assert m.plan_writable(s1, [2], res) == k
    pairs = m.make_writable(s1, [2], res)
    assert len(pairs) == k and all(drv.mapped_handle(dst) is not None for _, dst, *_ in pairs)
    m.copied(pairs)
    assert counts() == (4, 4, 6, 2) and not m.any_shared(s1, [2])
    # free the parent: its pages stay mapped (kept); unit 2 is its own, so reclaimable
    m.vacate(s0)
    assert counts() == (4, 3, 6, 3) and m.num_reclaimable_pages() == k
    # 4 units do not fit (3 obtainable); 3 do, by reclaiming the parent's kept unit 2
    s2 = pick_slot(m, 4, [])
    assert s2.index == 2 and m.plan_occupy(s2, 4, []) == (4 * k, 3 * k)
    s2 = pick_slot(m, 3, [])
    assert s2.index == 2 and m.plan_occupy(s2, 3, []) == (3 * k, 3 * k)
    m.occupy(s2, 3, 3, [])
    assert counts() == (6, 6, 8, 0) and m.num_reclaimed_pages == k
    assert drv.num_pages == 6 * k and pool.num_created == 6 * k
    # free everything; all pages are kept until reclaimed
    m.vacate(s1)
    m.vacate(s2)
    assert counts() == (6, 0, 8, 6)
    assert m.reclaim(6 * k) == 6 * k
    assert counts() == (0, 0, 0, 6) and pool.num_plain_available == 6 * k
    m.close()
    assert drv.num_mappings == 0 and drv.num_pages == 0 and drv.num_reservations == 0


def vmem_prefix_hit_and_out_of_memory() -> None:
    """A registered full unit is mapped again by a later occupant (no fresh page); a device that
    cannot create a page is a ``KVCacheFullError`` that leaves the mapper unchanged; reclaiming
    evicts the cached page only after the kept pages without a prefix entry."""
    from vmkv.kvcache.errors import KVCacheFullError
    from vmkv.kvcache.hashing import unit_keys
    from vmkv.vmem.page_pool import out_of_memory_is_full
    from vmkv.vmem.placement import pick_slot

    m, drv = make_mapper("megacache", max_pages=4, device_pages=3)
    s0 = pick_slot(m, 2, [])
    m.occupy(s0, 1, 2, [])
    key = unit_keys(list(range(8)), 4, None)[0]
    m.prefix.register(key, None, tuple(s0.units[0]))
    hit = [tuple(s0.units[0])]
    s1 = pick_slot(m, 2, hit)
    assert m.plan_occupy(s1, 2, hit) == (1, 2)
    m.occupy(s1, 2, 2, hit)
    m.check_integrity()
    assert m.pool.num_in_use == 3 and m.refcount(hit[0][0]) == 2 and drv.num_pages == 3
    # the device is full at 3 pages although the pool allows 4: growth fails, nothing changes
    before = (m.pool.num_in_use, m.num_allocated_pages(), drv.num_mappings, s1.claimed)
    try:
        with out_of_memory_is_full(drv, 4):
            m.grow(s1, 3, [], copy_below_bytes=8 * m.layout.row_token_bytes)
    except KVCacheFullError:
        pass
    else:
        raise AssertionError("growth past the device's pages did not raise KVCacheFullError")
    m.check_integrity()
    assert (m.pool.num_in_use, m.num_allocated_pages(), drv.num_mappings, s1.claimed) == before
    # both go; reclaiming takes the kept pages without a prefix entry first, the cached one last
    m.vacate(s0)
    m.vacate(s1)
    assert m.reclaim(2) == 2
    m.check_integrity()
    assert m.prefix.is_cached(hit[0][0]) and m.refcount(hit[0][0]) == 2 and m.num_prefix_evictions == 0
    assert m.reclaim(1) == 1
    m.check_integrity()
    assert not m.prefix.is_cached(hit[0][0]) and m.num_prefix_evictions == 1 and drv.num_mappings == 0
    m.close()
    assert drv.num_pages == 0
