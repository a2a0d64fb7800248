"""Warm admission into a parked slot, alone: ``allocate(X, 2048)`` right after a 2048-token sequence was
freed (its slot parked, its 128 pages still mapped), then ``free(X)``, with ``release_idle`` between as
the engine makes it, while 63 background sequences of 64..640 tokens are live.  Llama-3-8B KV, 2 MiB
pages, megacache layout, host driver, prefix caching off.  Prints p50/p90 (us) of the allocate and the
free over ``--reps`` repetitions after a warm-up.

    PYTHONPATH=$PWD python docs/results/cpu/alloc_warm/warm_bench.py [--reps 2000] [--profile]
"""

import argparse
import random
import time

from vmkv.compare.shapes import get_shape
from vmkv.kvcache import backend_options_class, create_kv_cache


def build():
    spec = get_shape("llama3-8b").spec(None, "cpu")
    opts = backend_options_class("vmem")(layout="megacache", driver="host", page_size_bytes=2 << 20,
                                                      enable_prefix_caching=False)
    cache = create_kv_cache("vmem", spec, max_num_seqs=65, max_model_len=2048, memory_bytes=6 << 30,
                            options=opts)
    rng = random.Random(0)
    for i in range(63):
        cache.allocate(i, rng.randint(64, 640))
    return cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cache = build()
    seq = 10_000
    cache.allocate(seq, 2048)
    cache.free(seq)
    cache.release_idle(now=time.monotonic())
    alloc, free = [], []

    def rep(record: bool) -> None:
        nonlocal seq
        seq += 1
        t0 = time.perf_counter_ns()
        cache.allocate(seq, 2048)
        t1 = time.perf_counter_ns()
        cache.release_idle(now=time.monotonic())    # the engine's call between steps
        t2 = time.perf_counter_ns()
        cache.free(seq)
        t3 = time.perf_counter_ns()
        cache.release_idle(now=time.monotonic())
        if record:
            alloc.append((t1 - t0) / 1e3)
            free.append((t3 - t2) / 1e3)

    for _ in range(args.warmup):
        rep(False)
    if args.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.reps):
            rep(False)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        return
    for _ in range(args.reps):
        rep(True)
    st = cache.backend_stats()
    assert st["num_adoptions"] >= args.reps, st.get("num_adoptions")

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    print(f"warm allocate p50 {pct(alloc, .5):.2f} us p90 {pct(alloc, .9):.2f} us | "
          f"free p50 {pct(free, .5):.2f} us p90 {pct(free, .9):.2f} us  ({args.reps} reps)")
    cache.close()


if __name__ == "__main__":
    main()
