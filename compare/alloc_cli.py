"""``vmkv compare alloc``: the allocator simulation (:mod:`vmkv.compare.alloc_sim`) from the command line.

Draws ``--num-seqs`` final sequence lengths (prompt + output, or ``--seq-len``) from seeded distributions,
then prints, for the model shape, KV bytes per token and every scheme's blocks/pages, waste and
concurrency in a memory budget; optionally writes JSON, markdown and a waste-vs-unit-size plot.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from vmkv.compare import alloc_sim, report
from vmkv.compare.shapes import SHAPES, get_shape
from vmkv.compare.workloads import LengthDist
from vmkv.engine.args import parse_size
from vmkv.kvcache.dtypes import MODEL_DTYPES, dtype_names

logger = logging.getLogger(__name__)

COLUMNS = ["scheme", "unit", "tokens/unit", "units/seq", "waste %", "mean waste (tok)", "max waste (tok)",
           "KiB/used tok", "seqs in budget"]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _size_list(text: str) -> list[int]:
    """Comma-separated sizes (``4K,64K,2MiB``) in bytes; raises argparse.ArgumentTypeError."""
    return [parse_size(x) for x in text.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES), help="model shape")
    p.add_argument("--dtype", default=None, choices=dtype_names(MODEL_DTYPES),
                   help="KV dtype; default: the shape's")
    p.add_argument("--input-len", default="sharegpt-in", help="prompt length distribution (N, A..B, "
                   "lognormal:MEDIAN,SIGMA[,MIN,MAX], sharegpt-in)")
    p.add_argument("--output-len", default="sharegpt-out", help="output length distribution")
    p.add_argument("--seq-len", default=None, help="final length distribution (overrides input+output)")
    p.add_argument("--num-seqs", type=int, default=10000, help="sequences to draw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-sizes", type=_int_list, default=list(alloc_sim.DEFAULT_BLOCK_SIZES),
                   help="paged block sizes in tokens")
    p.add_argument("--page-sizes", type=_size_list, default=list(alloc_sim.DEFAULT_PAGE_SIZES),
                   help="vmem page sizes (4K,64K,2M)")
    p.add_argument("--layouts", default=",".join(alloc_sim.LAYOUTS),
                   help=f"vmem layouts, comma-separated, of {', '.join(alloc_sim.LAYOUTS)} (default: all)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="reservation baseline length M (capped at the model context); lengths are clipped to it")
    p.add_argument("--memory-gib", type=float, default=40.0, help="KV budget for 'seqs in budget'")
    p.add_argument("--out", default=None, help="directory for alloc.json, alloc.md, alloc_waste.png")


def draw_lengths(args) -> tuple[np.ndarray, int]:
    """Final lengths ``int64 [num_seqs]`` and how many were clipped to the maximum length."""
    rng = np.random.default_rng(args.seed)
    if args.seq_len:
        lengths = LengthDist.parse(args.seq_len).sample(rng, args.num_seqs)
    else:
        lengths = (LengthDist.parse(args.input_len).sample(rng, args.num_seqs)
                   + LengthDist.parse(args.output_len).sample(rng, args.num_seqs))
    clipped = int((lengths > args.max_model_len).sum())
    return np.minimum(lengths, args.max_model_len), clipped


def _unit(r: dict) -> str:
    if r["scheme"] == "paged":
        return f"block {r['block_size']}"
    if r["scheme"] == "reservation":
        return f"M={int(r['tokens_per_unit'])}"
    return f"page {report.fmt_size(r['page_size_bytes'])}"


def rows(results: list[dict]) -> list[list[str]]:
    return [[r["scheme"], _unit(r), f"{r['tokens_per_unit']:g}", report.fmt_num(r["units_per_seq_mean"], 1),
             report.fmt_num(r["waste_pct"]), report.fmt_num(r["mean_tail_waste_tokens"], 1),
             report.fmt_num(r["max_tail_waste_tokens"], 0), report.fmt_num(r["bytes_per_used_token"] / 1024, 1),
             str(r["seqs_in_budget"])] for r in results]


def run(args) -> int:
    console = report.console()
    if args.num_seqs <= 0:
        raise SystemExit(f"--num-seqs must be > 0, got {args.num_seqs}")
    shape = get_shape(args.model)
    spec = shape.spec(args.dtype)
    args.max_model_len = min(args.max_model_len, shape.max_model_len)
    lengths, clipped = draw_lengths(args)
    memory_bytes = int(args.memory_gib * (1 << 30))
    layouts = [x for x in args.layouts.split(",") if x]
    results = [r.to_dict() for r in alloc_sim.sweep(
        lengths, spec, block_sizes=args.block_sizes, page_sizes=args.page_sizes, layouts=layouts,
        max_model_len=args.max_model_len, memory_bytes=memory_bytes)]
    dist = args.seq_len or f"input {args.input_len} + output {args.output_len}"
    title = (f"{shape.name} ({spec.num_layers} layers, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}, "
             f"{str(spec.dtype).removeprefix('torch.')}): {report.fmt_bytes(spec.bytes_per_token)} KV per token; "
             f"{args.num_seqs} seqs, lengths {dist} (mean {lengths.mean():.1f}, clipped to "
             f"{args.max_model_len}: {clipped}), seed {args.seed}, budget {args.memory_gib:g} GiB")
    console.print(report.make_table(title, COLUMNS, rows(results)))
    if args.out:
        out = Path(args.out)
        env = report.environment(seed=args.seed)
        payload = {"kind": "alloc", "environment": env, "args": vars(args), "model_shape": shape.__dict__,
                   "bytes_per_token": spec.bytes_per_token, "num_clipped": clipped,
                   "length_stats": {"mean": float(lengths.mean()), "min": int(lengths.min()),
                                    "max": int(lengths.max()), "p50": float(np.median(lengths))},
                   "results": results, "lengths": lengths.tolist()}
        report.write_json(out / "alloc.json", payload)
        md = [f"# Allocator simulation: {shape.name}", "", f"Command: `{env['command']}`", "", title, "",
              report.markdown_table(COLUMNS, rows(results)), "",
              "waste % = (allocated - used) / allocated; mean waste in token-equivalents per sequence; "
              "seqs in budget = floor(budget / mean allocated bytes per sequence)."]
        (out / "alloc.md").write_text("\n".join(md) + "\n")
        report.plot_waste_vs_unit(results, out / "alloc_waste.png", title=f"{shape.name}: {dist}")
        console.print(f"wrote {out}/alloc.json, alloc.md, alloc_waste.png")
    return 0
