"""Padding rows (slot -1) write nothing on any path, and ``prepare(pad_to=, out=)`` is refused by a
cache that cannot be captured in CUDA graphs (CPU).  Found by an adversarial pass: the torch reference
``write_kv`` read slot -1 as "the last entry" (paged overwrote another sequence's KV; vmem on the host
driver crashed with SIGSEGV) and CPU caches accepted ``pad_to``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvcache_cases import CASES, rand_kv
from vmkv.kvcache.base import StepSeq

PAGED = next(c for c in CASES if c.name == "paged-b16")   # 256 tokens = 16 blocks of 16


def test_paged_padded_write_kv_does_not_touch_other_sequences():
    c = PAGED.make()
    try:
        g = torch.Generator().manual_seed(0)
        c.allocate(1, 6)
        lens = {2: 64, 3: 64, 4: 64, 5: 48}              # seq 5 ends in the pool's last block
        for sid, n in lens.items():
            c.allocate(sid, n)
        for sid, n in {1: 5, **lens}.items():
            for layer in range(2):
                k, v = rand_kv(g, n)
                c.write(sid, layer, 0, k, v)
        before = c.gather(5, 0)[0].clone()
        try:
            meta = c.prepare([StepSeq(1, 5, 1)], pad_to=4,
                             out=torch.zeros(c.graph_buffer_bytes(4), dtype=torch.uint8))
        except ValueError:
            return                                          # refusing pad_to here is fine too
        k, v = rand_kv(g, 4)
        c.write_kv(0, k, v, meta)                           # rows 1..3 are padding (slot -1)
        after = c.gather(5, 0)[0]
        hit = (before != after).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert not hit, f"a padding row overwrote seq 5's KV at positions {hit}"
    finally:
        c.close()


@pytest.mark.parametrize("name", ["vmem-megacache", "vmem-per_layer"])
def test_vmem_padded_write_kv_does_not_crash(name):
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[1])!r})
        from kvcache_cases import CASES, rand_kv
        from vmkv.kvcache.base import StepSeq
        c = next(x for x in CASES if x.name == {name!r}).make()
        g = torch.Generator().manual_seed(0)
        c.allocate(1, 6)
        k, v = rand_kv(g, 5)
        for layer in range(2):
            c.write(1, layer, 0, k, v)
        try:
            meta = c.prepare([StepSeq(1, 5, 1)], pad_to=4,
                             out=torch.zeros(c.graph_buffer_bytes(4), dtype=torch.uint8))
        except ValueError:
            sys.exit(0)
        k, v = rand_kv(g, 4)
        c.write_kv(0, k, v, meta)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit code {r.returncode} (-11 = SIGSEGV): {r.stderr[-500:]}"
