"""Cost of each virtual-memory driver call vmem makes, one call at a time (the floor under vmem's
allocation latencies in ``vmkv.compare.alloc_peers``).  It gets vmem's driver through the registry
(``vmkv.kvcache.registry.vmm_driver``: the compare layer never imports a backend); like every benchmark
it times, it asserts nothing.

    python3 -m vmkv.compare.driver_bench --out DIR [--device cuda|cpu] [--num-pages 128] [--reps 3] [--page-size-mib N]

Through vmem's own driver (``vmm_driver``, so cuda-python's per-call overhead and
the context check of every call are counted, as vmem pays them), on one reservation of ``--num-pages``
pages, each figure the p50 / p99 over the pages of ``--reps`` rounds, in microseconds:

* ``create``: ``create_page`` (cuMemCreate of one page; host: a memfd offset, no syscall until map);
* ``map``: ``map(va, h, set_access=False)`` (cuMemMap; host: mmap PROT_NONE);
* ``set_access_1``: ``set_access`` of one mapped page (cuMemSetAccess; host: mprotect);
* ``map_with_access``: ``map(va, h)``: map and access of one page (what a page-boundary grow pays);
* ``set_access_run``: one ``set_access`` over all ``--num-pages`` adjacent mapped pages (one sample
  per round; what an admission pays once);
* ``unmap``, ``release``: cuMemUnmap / cuMemRelease of one page.

On CUDA also, with cuda-python directly: ``compound_<n>``: create, map and set access of one allocation
of ``n`` pages (one call each), and its unmap + release, per page (kvcached's compound pages);
``map_prefix_of_allocation``: the result code of mapping only the first page of a 2-page allocation
(may an allocation be mapped in part, e.g. to share one page of it?); and
``threaded_create``: pages created on a second thread while this one maps (does cuMemCreate run
beside cuMemMap, or do the two serialize in the driver?), as the wall time of both against each alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


__all__ = ["measure_driver", "measure_compound", "main"]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _environment() -> dict:
    import platform

    import torch

    return {"command": " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i) for i in
                                                       range(torch.cuda.device_count())],
            "git_commit": os.environ.get("VMKV_GIT_COMMIT") or _git("rev-parse", "--short", "HEAD"),
            "git_status": _git("status", "--porcelain", "--untracked-files=normal"),
            "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _stats(us: list[float]) -> dict:
    a = np.asarray(us, dtype=np.float64)
    return {"n": int(a.size), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean())}


def _timed(fn, *args) -> float:
    t0 = time.perf_counter_ns()
    fn(*args)
    return (time.perf_counter_ns() - t0) / 1e3


def measure_driver(drv, num_pages: int, reps: int) -> dict:
    """Per-call latencies (module docstring) of ``drv`` (a vmem page driver)."""
    page = drv.page_size_bytes
    nbytes = num_pages * page
    va = drv.reserve(nbytes)
    out: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access_1", "map_with_access",
                                                  "set_access_run", "unmap", "release")}
    try:
        for _ in range(reps):
            handles = []
            for _ in range(num_pages):
                t0 = time.perf_counter_ns()
                handles.append(drv.create_page())
                out["create"].append((time.perf_counter_ns() - t0) / 1e3)
            # map without access, then one access call over the run
            for i, h in enumerate(handles):
                out["map"].append(_timed(lambda: drv.map(va + i * page, h, set_access=False)))
            out["set_access_run"].append(_timed(drv.set_access, va, nbytes))
            for i in range(num_pages):
                out["unmap"].append(_timed(drv.unmap, va + i * page))
            # map then access page by page
            for i, h in enumerate(handles):
                out["map"].append(_timed(lambda: drv.map(va + i * page, h, set_access=False)))
                out["set_access_1"].append(_timed(drv.set_access, va + i * page, page))
            for i in range(num_pages):
                drv.unmap(va + i * page)
            for i, h in enumerate(handles):
                out["map_with_access"].append(_timed(lambda: drv.map(va + i * page, h)))
            for i in range(num_pages):
                out["unmap"].append(_timed(drv.unmap, va + i * page))
            for h in handles:
                out["release"].append(_timed(drv.release, h))
    finally:
        drv.free_reservation(va, nbytes)
    return {k: _stats(v) for k, v in out.items()}


def measure_compound(device_index: int, page: int, num_pages: int, sizes: list[int], reps: int) -> dict:
    """CUDA only: one allocation of ``n`` pages per call (``compound_<n>``, per page) and a creation
    thread beside mapping (``threaded_create``); see the module docstring."""
    from cuda.bindings import driver as cu  # noqa: PLC0415

    def check(res):
        err, *vals = res if isinstance(res, tuple) else (res,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(err))
        return vals[0] if len(vals) == 1 else vals

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device_index
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    nbytes = num_pages * page
    va = int(check(cu.cuMemAddressReserve(nbytes, page, 0, 0)))
    res: dict = {}
    try:
        for n in sizes:
            if num_pages % n:
                continue
            rows = {"create": [], "map": [], "set_access": [], "unmap": [], "release": []}
            for _ in range(reps):
                hs = []
                for j in range(num_pages // n):
                    t0 = time.perf_counter_ns()
                    h = check(cu.cuMemCreate(n * page, prop, 0))
                    t1 = time.perf_counter_ns()
                    check(cu.cuMemMap(va + j * n * page, n * page, 0, h, 0))
                    t2 = time.perf_counter_ns()
                    check(cu.cuMemSetAccess(va + j * n * page, n * page, [access], 1))
                    t3 = time.perf_counter_ns()
                    hs.append(h)
                    for k, a, b in (("create", t0, t1), ("map", t1, t2), ("set_access", t2, t3)):
                        rows[k].append((b - a) / 1e3 / n)
                for j, h in enumerate(hs):
                    t0 = time.perf_counter_ns()
                    check(cu.cuMemUnmap(va + j * n * page, n * page))
                    t1 = time.perf_counter_ns()
                    check(cu.cuMemRelease(h))
                    t2 = time.perf_counter_ns()
                    rows["unmap"].append((t1 - t0) / 1e3 / n)
                    rows["release"].append((t2 - t1) / 1e3 / n)
            res[f"compound_{n}"] = {k: _stats(v) for k, v in rows.items()}
        # may a mapping cover only the start of a larger allocation?
        h = check(cu.cuMemCreate(2 * page, prop, 0))
        err = cu.cuMemMap(va, page, 0, h, 0)
        err = err[0] if isinstance(err, tuple) else err
        res["map_prefix_of_allocation"] = getattr(err, "name", str(err))
        if err == cu.CUresult.CUDA_SUCCESS:
            check(cu.cuMemUnmap(va, page))
        check(cu.cuMemRelease(h))

        # creation on a second thread while this one maps pre-created pages
        pre = [check(cu.cuMemCreate(page, prop, 0)) for _ in range(num_pages)]

        def map_all() -> None:
            for i, h in enumerate(pre):
                check(cu.cuMemMap(va + i * page, page, 0, h, 0))
                check(cu.cuMemSetAccess(va + i * page, page, [access], 1))
            for i in range(num_pages):
                check(cu.cuMemUnmap(va + i * page, page))

        made: list = []
        ctx = check(cu.cuCtxGetCurrent())

        def create_all() -> None:
            check(cu.cuCtxSetCurrent(ctx))
            for _ in range(num_pages):
                made.append(check(cu.cuMemCreate(page, prop, 0)))

        t0 = time.perf_counter_ns()
        map_all()
        alone_map = (time.perf_counter_ns() - t0) / 1e3
        t0 = time.perf_counter_ns()
        create_all()
        alone_create = (time.perf_counter_ns() - t0) / 1e3
        for h in made:
            check(cu.cuMemRelease(h))
        made.clear()
        th = threading.Thread(target=create_all)
        t0 = time.perf_counter_ns()
        th.start()
        map_all()
        map_done = (time.perf_counter_ns() - t0) / 1e3
        th.join()
        both = (time.perf_counter_ns() - t0) / 1e3
        for h in made + pre:
            check(cu.cuMemRelease(h))
        res["threaded_create"] = {"pages": num_pages, "map_alone_us": alone_map, "create_alone_us": alone_create,
                                  "map_beside_create_us": map_done, "both_us": both,
                                  "serial_sum_us": alone_map + alone_create}
    finally:
        check(cu.cuMemAddressFree(va, nbytes))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m vmkv.compare.driver_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--num-pages", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--page-size-mib", type=int, default=None, help="page size in MiB (default: the driver's)")
    p.add_argument("--compound-sizes", default="1,2,4,16,64", help="pages per allocation (CUDA)")
    a = p.parse_args(argv)
    import torch

    from vmkv.kvcache.registry import vmm_driver

    drv = vmm_driver("cuda" if a.device == "cuda" else "host", a.device,
                     a.page_size_mib << 20 if a.page_size_mib else None)
    payload = {"kind": "driver_calls", "device": a.device, "page_size_bytes": drv.page_size_bytes,
               "num_pages": a.num_pages, "reps": a.reps,
               "environment": _environment()}
    payload["driver"] = measure_driver(drv, a.num_pages, a.reps)
    if a.device == "cuda":
        index = torch.cuda.current_device()
        payload["cuda"] = measure_compound(index, drv.page_size_bytes, a.num_pages,
                                           [int(x) for x in a.compound_sizes.split(",")], a.reps)
    drv.close()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "driver_calls.json").write_text(json.dumps(payload, indent=1))
    lines = [f"| call | p50 us | p99 us | n |", "|---|---|---|---|"]
    for k, v in payload["driver"].items():
        lines.append(f"| {k} | {v['p50_us']:.1f} | {v['p99_us']:.1f} | {v['n']} |")
    for name, rows in payload.get("cuda", {}).items():
        if name.startswith("compound_"):
            for k, v in rows.items():
                lines.append(f"| {name} {k} (per page) | {v['p50_us']:.2f} | {v['p99_us']:.2f} | {v['n']} |")
    extra = {k: v for k, v in payload.get("cuda", {}).items() if not k.startswith("compound_")}
    text = "\n".join(lines) + "\n" + ("\n" + json.dumps(extra, indent=1) + "\n" if extra else "")
    (a.out / "driver_calls.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
