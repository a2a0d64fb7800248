"""``prepare()`` called with a bad ``pad_to`` / ``out`` raises ValueError before it changes anything
(copy-on-write included): the interface promises "a method that raises leaves the cache unchanged"
(vmkv/kvcache/base.py).  Found by an adversarial pass: the checks used to run after copy-on-write."""

from __future__ import annotations

import pytest
import torch

from kvcache_cases import CASE_IDS, CASES, rand_kv
from vmkv.kvcache.base import StepSeq


def _forked(case):
    c = case.make()
    g = torch.Generator().manual_seed(0)
    c.allocate(1, 6)
    for layer in range(2):
        k, v = rand_kv(g, 6)
        c.write(1, layer, 0, k, v)
    c.extend(1, 1)
    c.fork(1, 2)            # seq 2 shares seq 1's last unit: writing position 6 needs a copy
    c.allocate(3, 3)
    return c


@pytest.mark.parametrize("bad", ["pad_to_zero", "prefill_with_pad_to", "out_wrong_dtype", "out_too_small"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prepare_that_raises_leaves_cache_unchanged(case, bad):
    c = _forked(case)
    try:
        batch = [StepSeq(1, 6, 1), StepSeq(2, 6, 1)]
        kw = {"pad_to": 4}
        if bad == "pad_to_zero":
            kw["pad_to"] = 0
        elif bad == "prefill_with_pad_to":
            batch = [StepSeq(1, 6, 1), StepSeq(3, 0, 3)]
        elif bad == "out_wrong_dtype":
            kw["out"] = torch.zeros(c.graph_buffer_bytes(4), dtype=torch.float32)
        else:
            kw["out"] = torch.zeros(8, dtype=torch.uint8)
        before = c.usage()
        with pytest.raises(ValueError):
            c.prepare(batch, **kw)
        after = c.usage()
        assert after == before, f"a prepare() that raised changed the cache: {before} -> {after}"
    finally:
        c.close()
