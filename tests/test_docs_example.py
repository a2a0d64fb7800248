"""Executes the runnable example of docs/kvcache.md, so the interface page stays correct."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "kvcache.md"


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_doc_has_one_runnable_example():
    assert len(python_blocks(DOC.read_text())) == 1


@pytest.mark.parametrize("index", range(len(python_blocks(DOC.read_text()))))
def test_kvcache_doc_example_runs(index):
    code = python_blocks(DOC.read_text())[index]
    exec(compile(code, f"{DOC}:python-block-{index}", "exec"), {"__name__": "docs_example"})
