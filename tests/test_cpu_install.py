"""A CPU-only install (issue 25): triton and cuda-python are the ``cuda`` extra, not dependencies, and the
CPU path (every module but the Triton kernels themselves, ``vmkv generate`` on both backends) runs without
them; what needs them says which extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = {"triton", "cuda-python", "cuda-bindings"}


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_gpu_only_packages_are_the_cuda_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not _names(project["dependencies"]) & GPU_ONLY, project["dependencies"]
    assert {"pyzmq", "msgspec", "torch"} <= _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert {"triton", "cuda-python"} <= _names(extras["cuda"])
    assert "triton" in _names(extras["test"])       # CI's `pip install -e '.[test]'`: the interpreter tests


# the modules that are Triton programs (imported only once triton is known to import) and GPU-only scripts
TRITON_MODULES = {"vmkv.kernels.decode_attention", "vmkv.kernels.prefill_attention", "vmkv.kernels.write_kv",
                  "vmkv.kernels._tl_utils", "vmkv.compare.kernel_bench_probe"}

CPU_PATH = textwrap.dedent(f"""
    import sys
    for name in ("triton", "triton.language", "cuda", "cuda.bindings", "cuda.bindings.driver"):
        sys.modules[name] = None          # as if not installed: importing them raises ImportError
    import importlib, pkgutil, vmkv
    for mod in pkgutil.walk_packages(vmkv.__path__, "vmkv."):
        if mod.name not in {sorted(TRITON_MODULES)!r}:
            importlib.import_module(mod.name)
    from vmkv.cli import main
    for backend in ("paged", "vmem"):
        rc = main(["generate", "--backend", backend, "--random-weights", "tiny", "--prompt-token-ids", "1,2,3",
                   "--device", "cpu", "--max-tokens", "4", "--threads", "1"])
        assert rc in (0, None), rc
    assert main(["compare", "kernels", "--device", "cpu"]) == 2
    from vmkv.vmem.cuda_driver import CudaDriver
    try:
        CudaDriver("cuda")
    except ImportError as exc:
        print("cuda driver:", exc)
    """)


@pytest.mark.slow
def test_cpu_path_runs_without_triton_and_cuda_python():
    out = subprocess.run([sys.executable, "-c", CPU_PATH], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stderr.count("3 prompt + 4 output tokens") == 2, out.stderr[-3000:]
    assert "vmkv compare kernels: needs triton" in out.stdout and "pip install 'vmkv[cuda]'" in out.stdout
    assert "cuda driver: the vmem backend's CUDA driver needs cuda-python" in out.stdout
