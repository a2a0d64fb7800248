"""Where vmem's page-boundary grow spends its time on the device: the alloc_peers trace (run 4's, 64
sequences, Llama-3-8B KV, 2 MiB pages, 20 GiB cap) on vmem without prefetch, each boundary call split into
its driver calls (CudaDriver._map/_set_access/_create_page/_unmap/_release, timed) and the rest (host
Python), then the same trace under cProfile (grow calls only) for the functions behind the rest.

    python3 docs/results/h200/issue12/alloc_peers/profile/trace_profile.py [--device cuda|cpu] > OUT.txt
"""
import argparse
import cProfile
import pstats
import time

import numpy as np

from vmkv.compare import alloc_peers as ap
from vmkv.compare.alloc_adapters import BenchConfig
from vmkv.compare.alloc_vmem import VMemAdapter

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
args = p.parse_args()
cfg = ap.TraceConfig()
bench = BenchConfig(device=args.device, vmem_page_size_bytes=2 << 20)


def run(profile: cProfile.Profile | None):
    a = VMemAdapter(bench, "megacache")
    inner = getattr(a.cache.driver, "inner", a.cache.driver)
    acc = {"drv": 0, "n": {}}
    for name in ("_map", "_set_access", "_create_page", "_unmap", "_release"):
        f = getattr(inner, name)

        def wrap(*x, f=f, name=name):
            t0 = time.perf_counter_ns()
            r = f(*x)
            acc["drv"] += time.perf_counter_ns() - t0
            acc["n"][name] = acc["n"].get(name, 0) + 1
            return r
        setattr(inner, name, wrap)
    bt, bd, kinds = [], [], {}
    for step in ap.make_trace(cfg):
        for op, seq, n in step:
            if op == ap.GROW:
                before = a.cache.usage().allocated_bytes
                acc["drv"], acc["n"] = 0, {}
                if profile:
                    profile.enable()
                t0 = time.perf_counter_ns()
                a.grow(seq, n)
                dt = (time.perf_counter_ns() - t0) / 1e3
                if profile:
                    profile.disable()
                if a.cache.usage().allocated_bytes > before:
                    bt.append(dt)
                    bd.append(acc["drv"] / 1e3)
                    k = tuple(sorted(acc["n"].items()))
                    kinds[k] = kinds.get(k, 0) + 1
            elif op == ap.ADMIT:
                a.admit(seq, n)
            else:
                a.free(seq)
        a.between_steps()
    a.close()
    return np.array(bt), np.array(bd), kinds


bt, bd, kinds = run(None)
print(f"boundary calls {bt.size}: total p50 {np.percentile(bt, 50):.1f} us, driver p50 {np.percentile(bd, 50):.1f} us, "
      f"rest p50 {np.percentile(bt - bd, 50):.1f} us (p90 {np.percentile(bt - bd, 90):.1f})")
for k, v in sorted(kinds.items(), key=lambda x: -x[1]):
    print(f"  {v} calls made {dict(k)}")
pr = cProfile.Profile()
run(pr)
st = pstats.Stats(pr).stats
print("cProfile of every grow call (profiler overhead included), top 30 by own time:")
for tt, ct, n, k in sorted(((v[2], v[3], v[1], k) for k, v in st.items()), reverse=True)[:30]:
    print(f"  {tt * 1e3:8.1f} ms own {ct * 1e3:8.1f} ms cum {n:7d} calls  {k[0].split('/')[-1]}:{k[1]} {k[2]}")
