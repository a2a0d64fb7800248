"""The dependency rule of docs/architecture.md as a test: an ``ast`` walk over every import.

Layers (installed names; ``paged/``, ``kernels/`` and ``compare/`` install as ``vmkv.paged`` ...):

- ``vmkv.kernels`` imports only torch, triton, numpy and the standard library; nothing of vmkv outside it.
- ``vmkv.kvcache`` (interface, registry, shared core) imports only itself; the registry names the
  backends as strings and imports them lazily.
- ``vmkv.paged`` and ``vmkv.vmem`` (the backends) import ``vmkv.kvcache`` and ``vmkv.kernels``, never
  each other, never the model, engine or server.
- ``vmkv.model`` imports ``vmkv.kvcache.base`` (the interface types) and, of ``vmkv.kernels``, only the
  fused small ops (``fused_ops`` and their torch references); attention runs through the KV cache.
- ``vmkv.engine`` imports the interface (``vmkv.kvcache``) and the model, never a backend or a kernel.
- ``vmkv.server`` goes through ``vmkv.engine``.
- ``vmkv.compare`` goes through ``vmkv.engine``, and may use ``vmkv.kvcache`` and ``vmkv.kernels``
  for microbenchmarks, ``vmkv.model.config`` for the named model shapes and the server's wire format
  (``vmkv.server.core_protocol``, which ``compare/ipc_bench.py`` measures); never a backend.
- Only the registry names a backend: no other module outside a backend holds the string
  ``"vmkv.paged"`` / ``"vmkv.vmem"``.
- ``cuda.bindings`` is imported only by the CUDA driver.
- ``vmkv.envs`` (the one reader of ``VMKV_*`` variables) may be imported from anywhere.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: source folder -> installed package name
PACKAGE_DIRS = {"vmkv": "vmkv", "paged": "vmkv.paged", "kernels": "vmkv.kernels", "compare": "vmkv.compare"}

#: layer (a module-name prefix) -> vmkv layers it may import (itself always allowed)
ALLOWED: dict[str, tuple[str, ...]] = {
    "vmkv.kernels": (),
    "vmkv.kvcache": (),
    "vmkv.paged": ("vmkv.kvcache", "vmkv.kernels"),
    "vmkv.vmem": ("vmkv.kvcache", "vmkv.kernels"),
    "vmkv.model": ("vmkv.kvcache.base", "vmkv.kernels.fused_ops", "vmkv.kernels.fused_reference"),
    "vmkv.engine": ("vmkv.kvcache", "vmkv.model"),
    "vmkv.server": ("vmkv.engine",),
    "vmkv.compare": ("vmkv.engine", "vmkv.kvcache", "vmkv.kernels", "vmkv.model.config",
                     "vmkv.server.core_protocol"),
    # the console script and the package root wire the layers together (lazily, inside subcommands)
    "vmkv.cli": ("vmkv.engine", "vmkv.server", "vmkv.compare"),
    "vmkv": ("vmkv.engine", "vmkv.kvcache"),
}
#: imported from anywhere
ANYWHERE = ("vmkv.envs",)
#: third-party roots the kernels may import
KERNEL_THIRD_PARTY = {"torch", "triton", "numpy"}
BACKEND_PACKAGES = ("vmkv.paged", "vmkv.vmem")
#: modules allowed to name a backend package in a string
BACKEND_NAMERS = ("vmkv.kvcache.registry",)
#: the CUDA driver, and the driver-level benchmark (it times compound allocations the driver never makes)
CUDA_BINDINGS_USERS = ("vmkv.vmem.cuda_driver", "vmkv.compare.driver_bench")


@dataclass(frozen=True)
class Import:
    module: str     # the importing module
    target: str     # the imported module (``from a import b`` -> ``a.b`` when ``a.b`` is a module)
    lineno: int


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _modules(root: pathlib.Path, package_dirs: dict[str, str]) -> dict[str, pathlib.Path]:
    out = {}
    for folder, pkg in package_dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            name = ".".join((pkg,) + parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def collect(root: pathlib.Path = ROOT, package_dirs: dict[str, str] = PACKAGE_DIRS):
    """Every import (at any depth, lazy ones included) and every string constant of each module."""
    modules = _modules(root, package_dirs)
    imports: list[Import] = []
    strings: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports += [Import(name, a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    # ``from vmkv import model`` imports the module vmkv.model
                    imports.append(Import(name, sub if sub in modules else base, node.lineno))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.setdefault(name, []).append((node.value, getattr(node, "lineno", 0)))
    return modules, imports, strings


def _layer(module: str) -> str:
    """The most specific layer prefix of ``module``."""
    return max((p for p in ALLOWED if _within(module, p)), key=len)


def violations(root: pathlib.Path = ROOT, package_dirs: dict[str, str] = PACKAGE_DIRS) -> list[str]:
    """Every forbidden edge, as ``module:line -> target (rule)``."""
    modules, imports, strings = collect(root, package_dirs)
    out = []
    for imp in imports:
        src, dst = imp.module, imp.target
        where = f"{src}:{imp.lineno} -> {dst}"
        root_name = dst.split(".")[0]
        if root_name == "cuda" and not any(_within(src, m) for m in CUDA_BINDINGS_USERS):
            out.append(f"{where} (cuda.bindings only inside the CUDA driver)")
        if _within(src, "vmkv.kernels") and root_name != "vmkv":
            if root_name not in KERNEL_THIRD_PARTY and root_name not in sys.stdlib_module_names:
                out.append(f"{where} (kernels import only torch/triton/numpy and the standard library)")
        if not _within(dst, "vmkv"):
            continue
        layer = _layer(src)
        if _within(dst, layer) and layer != "vmkv":
            continue
        if layer == "vmkv" and not any(_within(src, p) for p in ALLOWED if p != "vmkv") and dst == "vmkv":
            continue
        allowed = ALLOWED[layer] + ANYWHERE
        if not any(_within(dst, a) for a in allowed):
            out.append(f"{where} (layer {layer} may import {', '.join(allowed) or 'nothing of vmkv'})")
    for module, consts in strings.items():
        if any(_within(module, b) for b in BACKEND_PACKAGES + BACKEND_NAMERS):
            continue
        for value, lineno in consts:
            if any(b in value for b in BACKEND_PACKAGES):
                out.append(f"{module}:{lineno} names a backend module ({value!r}); only the registry does")
    return out


def test_layering_rule_holds():
    bad = violations()
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_every_module_has_a_layer():
    modules, _, _ = collect()
    assert len(modules) > 50
    for name in modules:
        assert _layer(name) in ALLOWED


@pytest.mark.parametrize("folder,source,needle", [
    ("vmkv/engine", "from vmkv.paged.cache import PagedKVCache\n", "vmkv.paged.cache"),
    ("vmkv/engine", "def f():\n    import vmkv.vmem.cache\n", "vmkv.vmem.cache"),
    ("vmkv/model", "from vmkv.engine import LLMEngine\n", "vmkv.engine"),
    ("vmkv/model", "from vmkv.kernels.ops import paged_attention\n", "vmkv.kernels.ops"),
    ("vmkv/server", "from vmkv.kvcache.registry import create_kv_cache\n", "vmkv.kvcache.registry"),
    ("kernels", "import requests\n", "requests"),
    ("kernels", "from vmkv.kvcache import base\n", "vmkv.kvcache.base"),
    ("paged", "from ..vmem import cache\n", "vmkv.vmem.cache"),
    ("compare", "import importlib\nM = 'vmkv.vmem.cache'\n", "names a backend"),
    ("vmkv/engine", "from cuda.bindings import driver\n", "cuda.bindings"),
])
def test_layering_check_catches_a_forbidden_import(tmp_path, folder, source, needle):
    """Copy the tree, add one forbidden import, and the check reports exactly that edge."""
    for src_folder in PACKAGE_DIRS:
        for path in (ROOT / src_folder).rglob("*.py"):
            dst = tmp_path / path.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(path.read_text())
    (tmp_path / folder / "zz_forbidden.py").write_text(source)
    bad = violations(tmp_path)
    assert bad, "the forbidden import went unnoticed"
    assert all("zz_forbidden" in b for b in bad), bad
    assert any(needle in b for b in bad), bad
