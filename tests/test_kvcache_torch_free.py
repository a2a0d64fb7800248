"""The host-side bookkeeping imports without torch (DESIGN.md: "the id/page bookkeeping is
host-only and torch-free"): the sequence table, the prefix index, the check-then-apply plan and
the paged block manager, in a subprocess where ``import torch`` fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap

TORCH_FREE = ["vmkv.kvcache.errors", "vmkv.kvcache.records", "vmkv.kvcache.hashing",
              "vmkv.kvcache.prefix", "vmkv.kvcache.room", "vmkv.kvcache.seqtable",
              "vmkv.paged.block_pool", "vmkv.paged.block_manager"]


def test_bookkeeping_imports_and_runs_without_torch():
    code = textwrap.dedent(f"""
        import importlib, sys
        sys.modules["torch"] = None          # any `import torch` raises ImportError
        for name in {TORCH_FREE!r}:
            importlib.import_module(name)
        from vmkv.kvcache.prefix import PrefixIndex
        from vmkv.kvcache.seqtable import SeqState, SeqTable
        from vmkv.paged.block_manager import BlockManager
        seqs = SeqTable(max_num_seqs=2, max_model_len=16)
        m = BlockManager(4, 4, 2, 4, PrefixIndex())
        room = m.plan_allocate(seqs.check_new(1, 6, None), [])
        room.check()
        table, row = m.allocate(room)
        seqs.add(SeqState(1, 6, table, 2, 0, None, row))
        table2, row2 = m.fork(seqs.get(1))
        seqs.add(seqs.get(1).fork(2, table2, row2))
        cow = m.plan_cow([(seqs.get(2), range(1, 2))])
        assert cow.num_needed == 1, cow
        assert m.apply_cow(cow) == [(1, 2)]
        m.check_integrity(seqs)
        assert "torch" not in [k for k, v in sys.modules.items() if v is not None]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
