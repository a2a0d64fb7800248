"""``vmkv compare {alloc,engine,serve,kernels,colocate,step}``: head-to-head comparisons of the paged and vmem backends.

- ``alloc``: allocator simulation without a GPU (:mod:`vmkv.compare.alloc_cli`).
- ``engine``: the engine on both backends, offline and online, each in a fresh process
  (:mod:`vmkv.compare.engine_bench`).
- ``serve``: the same workload through real ``vmkv serve`` processes and in-process, served / in-process
  ratios (:mod:`vmkv.compare.serve_bench`).
- ``kernels``: the kernel microbenchmarks (:mod:`vmkv.compare.kernel_bench`), arguments passed through.
- ``colocate``: two ``vmkv serve`` processes sharing one GPU under alternating bursts
  (:mod:`vmkv.compare.colocate`).
- ``step``: the decode step of the engine against its bandwidth floor, per backend
  (:mod:`vmkv.compare.step_bench`).

Each subcommand's module is imported only when that subcommand runs (STYLE.md rule 11).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "alloc": ("vmkv.compare.alloc_cli", "allocator simulation: waste vs block/page size, no GPU needed"),
    "engine": ("vmkv.compare.engine_bench", "run the engine on both backends (offline and Poisson online)"),
    "serve": ("vmkv.compare.serve_bench", "the same workload through vmkv serve and in-process: served/in-process ratios"),
    "kernels": ("vmkv.compare.kernel_bench", "kernel microbenchmarks (paged vs contiguous attention)"),
    "colocate": ("vmkv.compare.colocate", "two servers on one GPU with alternating bursts (elastic KV memory)"),
    "step": ("vmkv.compare.step_bench", "decode step time vs its bandwidth floor, B x L grid, every backend"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="compare_command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    wanted = next((a for a in sys.argv[1:] if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == "kernels":
            # pass everything through to kernel_bench's own parser, imported only when run
            p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\x01")
            p.add_argument("kernel_args", nargs="*", help="arguments of `vmkv compare kernels --help`")
        else:
            p = sub.add_parser(name, help=help_text, description=help_text)
            if name == wanted or wanted is None:
                importlib.import_module(module).add_arguments(p)
        p.set_defaults(_compare_module=module)


def run(args) -> int:
    module_name = getattr(args, "_compare_module", None)
    if module_name is None:
        print("usage: vmkv compare {" + ",".join(SUBCOMMANDS) + "} ...  (see vmkv compare --help)")
        return 2
    if args.compare_command == "kernels":
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            print("vmkv compare kernels: vmkv.compare.kernel_bench is not installed in this tree yet")
            return 2
        parser = argparse.ArgumentParser(prog="vmkv compare kernels", description=SUBCOMMANDS["kernels"][1])
        module.add_arguments(parser)
        return int(module.run(parser.parse_args(args.kernel_args)) or 0)
    return int(importlib.import_module(module_name).run(args) or 0)
