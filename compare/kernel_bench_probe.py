"""Two follow-up probes of :mod:`vmkv.compare.kernel_bench` results (docs/results/kernels/README.md).

1. Block placement: is the paged kernel's loss at large pools caused by the block-table lookup itself or
   by where the blocks lie?  Times our decode kernel on the same K/V as paged caches with shuffled and
   with in-order physical blocks (block sizes 16 and 256) and as contiguous slots, in interleaved
   rounds so that drift shows up as spread.
2. Launch overhead: for small decode batches the timings are host-bound.  Measures host microseconds
   per call (no sync) and device time from a replayed CUDA graph (L2 flushed by do_bench) for our
   kernels and SDPA.

Run: ``python compare/kernel_bench_probe.py --out DIR`` (CUDA; ``--device cpu`` is a functional smoke run
under TRITON_INTERPRET=1).  Writes ``kernel_bench_probe.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from vmkv.compare.kernel_bench import DTYPES, Timer, _sdpa_flash
from vmkv.compare.report import environment, write_json
from vmkv.kernels.decode_attention import decode_attention


def _paged(k, v, block_size, shuffled, gen):
    b, length, h, d = k.shape
    n = b * length // block_size
    perm = torch.randperm(n, generator=gen).to(k.device) if shuffled else torch.arange(n, device=k.device)
    kc = torch.empty(n, block_size, h, d, dtype=k.dtype, device=k.device)
    vc = torch.empty_like(kc)
    kc[perm] = k.reshape(n, block_size, h, d)
    vc[perm] = v.reshape(n, block_size, h, d)
    return kc, vc, perm.view(b, -1).to(torch.int32)


def placement(args, timer, dev, dtype, gen) -> list[dict]:
    rows = []
    for point in args.points.split(","):
        batch, ctx = (int(x) for x in point.split("x"))
        k = torch.randn(batch, ctx, args.num_kv_heads, args.head_dim, device=dev).to(dtype)
        v = torch.randn_like(k)
        q = torch.randn(batch, args.num_heads, args.head_dim, device=dev).to(dtype)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        nbytes = 2 * k.numel() * k.element_size()
        variants = {"contig_per_layer": (k, v, {"slot_indices": torch.arange(batch, dtype=torch.int32,
                                                                              device=dev)})}
        for bs in (16, 256):
            for shuffled in (True, False):
                kc, vc, table = _paged(k, v, bs, shuffled, gen)
                variants[f"paged_bs{bs}_{'shuffled' if shuffled else 'in_order'}"] = (kc, vc, {"block_tables": table})
        ref = None
        stages_list = [int(x) for x in args.num_stages.split(",")]
        for rnd in range(args.rounds):
            for name, (kc, vc, kw) in variants.items():
                for st in stages_list:
                    fn = lambda: decode_attention(q, kc, vc, sl, max_seq_len=ctx,  # noqa: E731
                                                  scale=args.head_dim ** -0.5, num_stages=st, **kw)
                    out = fn()
                    ref = out if ref is None else ref
                    assert torch.allclose(out.float(), ref.float(), atol=2e-2), name
                    t = timer(fn)
                    label = name if len(stages_list) == 1 else f"{name}_stages{st}"
                    rows.append({"batch": batch, "context": ctx, "variant": label, "round": rnd, **t,
                                 "gbps": nbytes / (t["ms"] * 1e-3) / 1e9})
        del variants, k, v
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def overhead(args, timer, dev, dtype, gen) -> list[dict]:
    rows = []
    batch, ctx = 1, 4096
    k = torch.randn(batch, ctx, args.num_kv_heads, args.head_dim, device=dev).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, args.num_heads, args.head_dim, device=dev).to(dtype)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    kc, vc, table = _paged(k, v, 16, True, gen)
    scale = args.head_dim ** -0.5
    kb, vb = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    fns = {
        "triton_contig": lambda: decode_attention(q, k, v, sl, max_seq_len=ctx, scale=scale,
                                                  slot_indices=torch.zeros(1, dtype=torch.int32, device=dev)),
        "triton_paged_bs16": lambda: decode_attention(q, kc, vc, sl, max_seq_len=ctx, scale=scale,
                                                      block_tables=table),
        "sdpa_contiguous": lambda: _sdpa_flash(q.unsqueeze(2), kb, vb, scale=scale, enable_gqa=True),
    }
    for name, fn in fns.items():
        fn()
        n = 200 if dev.type == "cuda" else 2
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host_us = (time.perf_counter() - t0) / n * 1e6
        row = {"variant": name, "batch": batch, "context": ctx, "host_us_per_call": host_us,
               "eager": timer(fn)}
        if dev.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            row["cuda_graph"] = timer(graph.replay)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="kernel_bench_out")
    p.add_argument("--points", default="64x4096,256x4096,128x8192,256x8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-stages", default="2", help="software-pipelining depths to time (comma list)")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    timer = Timer(dev, 50)
    gen = torch.Generator().manual_seed(0)
    result = {"args": vars(args), "environment": environment(),
              "placement": placement(args, timer, dev, dtype, gen),
              "overhead": overhead(args, timer, dev, dtype, gen)}
    path = write_json(Path(args.out) / "kernel_bench_probe.json", result)
    by = {}
    for r in result["placement"]:
        by.setdefault((r["batch"], r["context"], r["variant"]), []).append(r["ms"])
    for key, ms in by.items():
        print(*key, " ".join(f"{m:.4f}" for m in ms))
    for r in result["overhead"]:
        print(r["variant"], f"host {r['host_us_per_call']:.1f} us/call", f"eager {r['eager']['ms'] * 1e3:.1f} us",
              f"graph {r['cuda_graph']['ms'] * 1e3:.1f} us" if "cuda_graph" in r else "")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
