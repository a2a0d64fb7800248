"""The dtype names live once (vmkv/kvcache/dtypes.py, torch-free): the KV spec, the model loader, the
engine config, the CLIs and the benchmarks read them from there."""

from __future__ import annotations

import argparse
import ast
import importlib
import pathlib
import subprocess
import sys

import pytest
import torch

from vmkv.kvcache.dtypes import AUTO_DTYPE, DTYPE_NAMES, MODEL_DTYPES, canonical_dtype, dtype_names
from vmkv.kvcache.spec import TORCH_DTYPES, KVCacheSpec, torch_dtype

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE_NAMES = dtype_names(MODEL_DTYPES) + (AUTO_DTYPE,)


def test_the_table_maps_names_to_torch_dtypes():
    assert set(DTYPE_NAMES.values()) == {"float32", "float16", "bfloat16", "float64"}
    assert set(MODEL_DTYPES) <= set(DTYPE_NAMES.values())
    for name, canon in DTYPE_NAMES.items():
        assert DTYPE_NAMES[canon] == canon                  # every canonical name is itself a name
        assert TORCH_DTYPES[name] is getattr(torch, canon) is torch_dtype(name) is torch_dtype(name.upper())
    assert set(TORCH_DTYPES) == set(DTYPE_NAMES)
    assert dtype_names() == tuple(DTYPE_NAMES)
    assert canonical_dtype("torch.bfloat16") == canonical_dtype("BF16") == "bfloat16"
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; use one of \['float32'"):
        canonical_dtype("int8")
    with pytest.raises(ValueError, match=r"unknown dtype 'float64'; use one of .*'bf16'\]$"):
        torch_dtype("float64", MODEL_DTYPES)


def test_the_names_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import vmkv.kvcache.dtypes as d; "
            "print(d.canonical_dtype('bf16'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "bfloat16", out.stderr


def test_every_consumer_accepts_exactly_the_listed_names():
    from vmkv.compare.shapes import parse_dtype
    from vmkv.engine.config import ENGINE_DTYPES, EngineConfig
    from vmkv.model.loader import resolve_dtype

    cpu = torch.device("cpu")
    assert ENGINE_DTYPES == ENGINE_NAMES
    for name in DTYPE_NAMES:
        assert KVCacheSpec(1, 1, 8, dtype=name).dtype is TORCH_DTYPES[name]
    for name in dtype_names(MODEL_DTYPES):
        assert resolve_dtype(name, cpu) is parse_dtype(name) is TORCH_DTYPES[name]
        assert EngineConfig(dtype=name).dtype == name
    assert resolve_dtype(AUTO_DTYPE, cpu) is torch.float32
    # float64 is a KV-cache test dtype, not one a model runs in
    for reject in (lambda: resolve_dtype("float64", cpu), lambda: parse_dtype("float64"),
                   lambda: EngineConfig(dtype="float64"), lambda: resolve_dtype(torch.float64, cpu),
                   lambda: KVCacheSpec(1, 1, 8, dtype="int8")):
        with pytest.raises(ValueError):
            reject()


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple:
    return tuple(next(a for a in parser._actions if flag in a.option_strings).choices)


@pytest.mark.parametrize("module, sub, want", [
    ("vmkv.server.cli", None, ENGINE_NAMES),
    ("vmkv.engine.cli", None, ENGINE_NAMES),
    ("vmkv.compare.cli", "engine", ENGINE_NAMES),
    ("vmkv.compare.cli", "alloc", dtype_names(MODEL_DTYPES)),
])
def test_cli_dtype_choices_are_the_name_list(module, sub, want):
    p = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(p)
    if sub:
        p = p._subparsers._group_actions[0].choices[sub]
    assert _choices(p, "--dtype") == want


def test_kernel_bench_dtypes_are_a_subset_of_the_list():
    from vmkv.compare import kernel_bench

    assert kernel_bench.DTYPES and set(kernel_bench.DTYPES) <= set(DTYPE_NAMES)
    assert all(kernel_bench.DTYPES[n] is TORCH_DTYPES[n] for n in kernel_bench.DTYPES)


def test_no_other_module_holds_a_copy_of_the_list():
    """No source file but vmkv/kvcache/dtypes.py has a literal collection of three or more dtype
    names (a deliberate subset such as kernel_bench's two half-precision names stays below that)."""
    names = set(DTYPE_NAMES)
    home = ROOT / "vmkv" / "kvcache" / "dtypes.py"
    copies = []
    for folder in ("vmkv", "paged", "kernels", "compare"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == home:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                    elts = node.keys if isinstance(node, ast.Dict) else node.elts
                    found = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
                    if len(found) >= 3:
                        copies.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(found)}")
    assert not copies, copies
