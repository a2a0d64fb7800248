"""The ``vmkv`` console script.  Subcommands live in their own modules and are imported only when
run, so ``vmkv --help`` is instant and never touches CUDA (STYLE.md rule 11).

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help)
SUBCOMMANDS = {
    "serve": ("vmkv.server.cli", "OpenAI-compatible HTTP server on the engine"),
    "generate": ("vmkv.engine.cli", "generate text offline from a prompt"),
    "compare": ("vmkv.compare.cli", "head-to-head comparisons of the paged and vmem backends"),
    "bench": ("vmkv.compare.bench_cli", "load-test an OpenAI-compatible server (bench serve)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vmkv", description="vmkv: paged vs virtual-memory KV caches behind one serving engine.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    # import only the module of the subcommand being run (help lists all without importing)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
