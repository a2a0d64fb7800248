"""The README's quick start, as a new user copies it (issue 9): the block is runnable as is on a CPU-only
machine, and CI runs exactly its test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quick_start_lines() -> list[str]:
    """The commands of the first ``bash`` block under "## Quick start", comments stripped."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_quick_start_installs_the_cpu_build_of_torch_first():
    """Copied as is on a CPU-only machine, the block used to install the multi-GB CUDA build of torch
    (the CPU hint came after it)."""
    lines = _quick_start_lines()
    first_pip = next(i for i, line in enumerate(lines) if line.startswith("pip install"))
    assert "torch" in lines[first_pip] and "download.pytorch.org/whl/cpu" in lines[first_pip], lines
    assert any("vmkv serve" in line for line in lines[first_pip + 1:])


def test_ci_runs_exactly_the_readme_test_command():
    test_line = next(line for line in _quick_start_lines() if "pytest" in line)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == test_line, (ci[-1], test_line)
