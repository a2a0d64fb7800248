"""HostDriver: the real mmap/memfd mechanism of the vmem backend, on CPU.  Argument validation is
CheckedDriver's (the drivers are thin), so most tests drive a CheckedDriver around a HostDriver."""

import mmap
import subprocess
import sys

import pytest
import torch

from checked_driver import CheckedDriver
from vmkv.vmem.backing import get_driver
from vmkv.vmem.host_driver import HostDriver
from vmkv.vmem.protocol import VMMError

PAGE = 4096


@pytest.fixture
def drv():
    d = CheckedDriver(HostDriver("cpu", PAGE))
    yield d
    d.close()


def _perms(va: int) -> str:
    """Permissions of the mapping that contains ``va``, from /proc/self/maps (never touches it)."""
    with open("/proc/self/maps") as f:
        for line in f:
            rng, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            if lo <= va < hi:
                return perms
    return ""


def test_two_mappings_of_one_page_share_memory(drv):
    va = drv.reserve(4 * PAGE)
    page = drv.create_page()
    drv.map(va, page)
    drv.map(va + 2 * PAGE, page)
    t = drv.as_tensor(va, 4 * PAGE)
    pattern = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
    t[:PAGE] = pattern
    assert torch.equal(t[2 * PAGE:3 * PAGE], pattern)
    # a typed view over the second mapping sees the same bytes
    f = drv.as_tensor(va + 2 * PAGE, PAGE, torch.float32)
    assert f.dtype == torch.float32 and f.numel() == PAGE // 4 and f.data_ptr() == va + 2 * PAGE
    f[0] = 1.5
    assert drv.as_tensor(va, 4, torch.float32)[0].item() == 1.5
    assert drv.num_mappings == 2 and drv.num_pages == 1
    assert _perms(va) == "rw-s" and _perms(va + 2 * PAGE) == "rw-s"
    assert _perms(va + PAGE) == "---p"


def test_unmap_leaves_range_reserved_and_inaccessible(drv):
    va = drv.reserve(2 * PAGE)
    page = drv.create_page()
    drv.map(va, page)
    drv.as_tensor(va, PAGE).fill_(7)
    drv.unmap(va)
    assert _perms(va) == "---p"          # PROT_NONE again, still reserved (not unmapped from the process)
    assert drv.num_mappings == 0 and drv.num_reservations == 1
    # the page keeps its content and can be mapped again, at another address of the range
    drv.map(va + PAGE, page)
    assert int(drv.as_tensor(va + PAGE, PAGE).sum()) == 7 * PAGE
    drv.unmap(va + PAGE)
    drv.release(page)


def test_released_page_offset_is_reused_and_zeroed(drv):
    va = drv.reserve(PAGE)
    a = drv.create_page()
    b = drv.create_page()
    assert {a, b} == {0, PAGE} and drv.file_pages == 2
    drv.map(va, a)
    drv.as_tensor(va, PAGE).fill_(9)
    drv.unmap(va)
    drv.release(a)
    c = drv.create_page()
    assert c == a and drv.file_pages == 2        # free list, the file did not grow
    drv.map(va, c)
    assert int(drv.as_tensor(va, PAGE).sum()) == 0   # hole punched: memory went back to the OS
    drv.unmap(va)


def test_copy_page(drv):
    va = drv.reserve(2 * PAGE)
    p, q = drv.create_page(), drv.create_page()
    drv.map(va, p)
    drv.map(va + PAGE, q)
    src = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
    drv.as_tensor(va, PAGE).copy_(src)
    drv.copy_page(va + PAGE, va)
    assert torch.equal(drv.as_tensor(va + PAGE, PAGE), src)
    drv.unmap(va + PAGE)
    with pytest.raises(VMMError, match="not mapped"):
        drv.copy_page(va + PAGE, va)


def test_errors_name_the_call(drv):
    va = drv.reserve(2 * PAGE)
    page = drv.create_page()
    with pytest.raises(VMMError, match=r"^mmap failed: EINVAL .*not on a page boundary") as e:
        drv.map(va + 8, page)
    assert e.value.call == "mmap" and e.value.code == "EINVAL"
    with pytest.raises(VMMError, match="not inside a reservation"):
        drv.map(va + 2 * PAGE, page)
    drv.map(va, page)
    with pytest.raises(VMMError, match="already mapped"):
        drv.map(va, page)
    with pytest.raises(VMMError, match=r"^fallocate failed: EINVAL .*still mapped"):
        drv.release(page)
    with pytest.raises(VMMError, match=r"^munmap failed: .*still mapped"):
        drv.free_reservation(va, 2 * PAGE)
    drv.unmap(va)
    with pytest.raises(VMMError, match="nothing is mapped"):
        drv.unmap(va)
    with pytest.raises(VMMError, match="multiple of page_size_bytes"):
        drv.reserve(PAGE + 1)
    drv.release(page)
    with pytest.raises(VMMError, match="released"):
        drv.map(va, page)


def test_libc_failure_is_a_vmm_error_with_errno(drv):
    with pytest.raises(VMMError) as e:
        drv.reserve(1 << 62)     # more address space than exists
    assert e.value.call == "mmap" and e.value.code.startswith("ENOMEM")
    assert drv.num_reservations == 0


def test_close_releases_everything_and_counts_balance():
    d = CheckedDriver(HostDriver("cpu", PAGE))
    va = d.reserve(8 * PAGE)
    pages = [d.create_page() for _ in range(5)]
    for i, p in enumerate(pages):
        d.map(va + i * PAGE, p)
    assert (d.num_pages, d.num_mappings, d.num_reservations, d.reserved_bytes) == (5, 5, 1, 8 * PAGE)
    for i, p in enumerate(pages[:2]):
        d.unmap(va + i * PAGE)
        d.release(p)
    assert (d.num_pages, d.num_mappings) == (3, 3)
    d.close()
    assert (d.num_pages, d.num_mappings, d.num_reservations) == (0, 0, 0)
    d.close()  # idempotent
    with pytest.raises(VMMError, match="closed"):
        d.reserve(PAGE)


def test_page_size_validation_and_default():
    with pytest.raises(ValueError, match="multiple of the OS page size"):
        HostDriver("cpu", mmap.PAGESIZE + 512)
    with pytest.raises(ValueError, match="CPU"):
        HostDriver("meta")
    d = HostDriver()
    assert d.page_size_bytes == 64 * 1024
    d.close()


def test_get_driver():
    d = get_driver("auto", "cpu", PAGE)
    assert isinstance(d, HostDriver) and d.page_size_bytes == PAGE
    d.close()
    with pytest.raises(ValueError, match="unknown vmem driver"):
        get_driver("nope", "cpu")
    with pytest.raises(ValueError, match="CPU"):
        get_driver("host", "cuda")
    pytest.importorskip("cuda.bindings")
    with pytest.raises(ValueError, match="CUDA device"):
        get_driver("cuda", "cpu")


@pytest.mark.slow
def test_vmem_imports_without_cuda_bindings():
    # block cuda-python entirely (torch itself may import parts of it when present)
    code = ("import sys; sys.modules['cuda.bindings'] = None; sys.modules['cuda.bindings.driver'] = None; "
            "import vmkv.vmem, vmkv.vmem.cache; from vmkv.vmem import HostDriver; HostDriver().close()")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_map_without_access_then_one_set_access_over_a_run(drv):
    va = drv.reserve(6 * PAGE)
    pages = [drv.create_page() for _ in range(4)]
    for i, p in enumerate(pages):
        drv.map(va + i * PAGE, p, set_access=False)
    # mapped but inaccessible, like a CUDA mapping before cuMemSetAccess
    assert all(_perms(va + i * PAGE) == "---s" for i in range(4))
    assert drv.num_pending_access == 4 and not drv.has_access(va)
    with pytest.raises(VMMError, match=r"^memmove failed: EINVAL .*without access"):
        drv.copy_page(va, va + PAGE)
    drv.set_access(va, 3 * PAGE)
    assert [_perms(va + i * PAGE) for i in range(4)] == ["rw-s", "rw-s", "rw-s", "---s"]
    assert drv.num_pending_access == 1 and drv.has_access(va + 2 * PAGE) and not drv.has_access(va + 3 * PAGE)
    drv.set_access(va + 2 * PAGE, 2 * PAGE)          # overlapping an accessible page is fine
    assert drv.num_pending_access == 0 and _perms(va + 3 * PAGE) == "rw-s"
    t = drv.as_tensor(va, 4 * PAGE)
    t.copy_(torch.arange(4 * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8))
    drv.copy_page(va + 3 * PAGE, va)
    assert torch.equal(t[3 * PAGE:], t[:PAGE])
    # unmapping a page that never got access clears its pending state
    p = drv.create_page()
    drv.map(va + 5 * PAGE, p, set_access=False)
    drv.unmap(va + 5 * PAGE)
    assert drv.num_pending_access == 0 and not drv.has_access(va + 5 * PAGE)


def test_set_access_validates_the_range(drv):
    va = drv.reserve(4 * PAGE)
    p, q = drv.create_page(), drv.create_page()
    drv.map(va, p, set_access=False)
    drv.map(va + 2 * PAGE, q, set_access=False)
    with pytest.raises(VMMError, match=r"^mprotect failed: EINVAL .*1 of 3 pages .* not mapped \(first "
                                       + hex(va + PAGE)) as e:
        drv.set_access(va, 3 * PAGE)                 # a hole in the middle
    assert e.value.call == "mprotect"
    with pytest.raises(VMMError, match="multiple of page_size_bytes"):
        drv.set_access(va, PAGE + 8)
    with pytest.raises(VMMError, match="multiple of page_size_bytes"):
        drv.set_access(va, 0)
    with pytest.raises(VMMError, match="not on a page boundary"):
        drv.set_access(va + 8, PAGE)
    with pytest.raises(VMMError, match="not inside a reservation"):
        drv.set_access(va + 2 * PAGE, 4 * PAGE)
    assert drv.num_pending_access == 2                 # every failure changed nothing
    assert _perms(va) == "---s"
    drv.set_access(va, PAGE)
    drv.set_access(va + 2 * PAGE, PAGE)
    assert drv.num_pending_access == 0
    drv.close()
    with pytest.raises(VMMError, match="closed"):
        drv.set_access(va, PAGE)


def test_guard_page_backs_its_address_for_the_reservation_lifetime(drv):
    """map_guard: one physical page shared by every guard, outside num_pages/num_mappings, refused by
    map/unmap, removed (and its page released after the last one) by free_reservation."""
    va = drv.reserve(4 * PAGE)
    other = drv.reserve(2 * PAGE)
    assert [drv.page_state(a) for a in (va, va + 5, va + PAGE)] == ["unmapped"] * 3
    assert not drv.is_backed(va) and drv.page_state(va - 1) == "outside" and drv.is_backed(va - 1)
    drv.map_guard(va)
    drv.map_guard(other)
    assert drv.page_state(va + 17) == "guard" and drv.is_backed(va + PAGE - 1)
    assert drv.page_state(va + PAGE) == "unmapped"
    assert (drv.num_guards, drv.num_mappings, drv.num_pages, drv.file_pages) == (2, 0, 0, 1)
    assert _perms(va) == "rw-s" and _perms(other) == "rw-s"
    drv.as_tensor(va, PAGE).fill_(3)                     # one physical page behind both guards
    assert int(drv.as_tensor(other, PAGE)[7]) == 3
    h = drv.create_page()
    with pytest.raises(VMMError, match="guard page"):
        drv.map(va, h)
    with pytest.raises(VMMError, match="already mapped"):
        drv.map_guard(va)
    with pytest.raises(VMMError, match="guard page is mapped"):
        drv.unmap(va)
    with pytest.raises(VMMError, match="not on a page boundary"):
        drv.map_guard(va + PAGE + 8)
    drv.map(va + PAGE, h, set_access=False)
    assert drv.page_state(va + PAGE) == "no_access" and not drv.is_backed(va + PAGE)
    drv.set_access(va + PAGE, PAGE)
    assert drv.page_state(va + PAGE + 1) == "mapped" and (drv.num_mappings, drv.num_pages) == (1, 1)
    drv.unmap(va + PAGE)
    drv.release(h)
    drv.free_reservation(va, 4 * PAGE)                   # takes its guard with it
    assert drv.num_guards == 1 and drv.page_state(va) == "outside"
    drv.free_reservation(other, 2 * PAGE)
    assert (drv.num_guards, drv.num_pages, drv.num_mappings, drv.num_reservations) == (0, 0, 0, 0)
    assert drv.create_page() == 0                        # the guard's file page was released


def test_close_removes_guards(drv):
    va = drv.reserve(2 * PAGE)
    drv.map_guard(va)
    drv.close()
    assert (drv.num_guards, drv.num_reservations) == (0, 0)


def test_thin_driver_keeps_no_mapping_table():
    """The thin driver passes calls through: it knows its reservations and guards, not what is
    mapped (the cache's page table does); CheckedDriver knows both and refuses misuse."""
    d = HostDriver("cpu", PAGE)
    va = d.reserve(4 * PAGE)
    d.map_guard(va)
    page = d.create_page()
    d.map(va + PAGE, page)
    assert [d.page_state(a) for a in (va, va + PAGE, va + 2 * PAGE, va - 1)] == \
        ["guard", "reserved", "reserved", "outside"]
    assert d.is_backed(va) and not d.is_backed(va + PAGE) and d.is_backed(va - 1)
    assert not hasattr(d, "num_mappings") and not hasattr(d, "mapped_handle")
    d.as_tensor(va + PAGE, PAGE).fill_(7)
    d.unmap(va + PAGE)
    d.release(page)
    d.close()
    assert d.num_reservations == 0
    checked = CheckedDriver(HostDriver("cpu", PAGE))
    va = checked.reserve(2 * PAGE)
    with pytest.raises(VMMError, match="nothing is mapped"):
        checked.unmap(va)
    checked.close()


def test_driver_bench_counts_every_call_on_the_host_driver(tmp_path):
    """``python -m vmkv.compare.driver_bench`` (the per-call cost behind the docs' driver figures) runs on
    the host driver and records one sample per call it makes."""
    import json

    from vmkv.compare import driver_bench

    assert driver_bench.main(["--out", str(tmp_path), "--device", "cpu", "--num-pages", "4", "--reps", "2",
                              "--page-size-mib", "2"]) == 0
    got = json.loads((tmp_path / "driver_calls.json").read_text())
    counts = {k: v["n"] for k, v in got["driver"].items()}
    assert counts == {"create": 8, "map": 16, "set_access_1": 8, "map_with_access": 8, "set_access_run": 2,
                      "unmap": 16, "release": 8}
    assert all(v["p50_us"] > 0 for v in got["driver"].values())
    assert got["page_size_bytes"] == 2 << 20 and "cuda" not in got
