"""Test tiers: default CPU; ``triton`` (interpreter on CPU, native on GPU); ``gpu`` (needs CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Triton kernels run under the interpreter on CPU-only machines; must be set before triton is imported.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The server tests' tiny random Llama with tokenizer and chat template (``server_helpers.make_tiny_model``),
    made once per session."""
    from server_helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
