"""Host block-table array of the paged backend: one preallocated numpy row per live sequence.

``PagedKVCache`` keeps each sequence's block table as a Python list (cheap scalar edits) and
mirrors it here, in a numpy ``int32 [max_num_seqs, max_blocks_per_seq]`` array updated in place on
every change (allocate, extend, fork, free, copy-on-write).  A step's ``[num_seqs, width]`` block
tables are then one fancy index of the scheduled rows instead of a Python rebuild of every table
(vLLM v1 keeps such a persistent ``BlockTable`` array in its input batch for the same reason).
Entries past a sequence's last block are 0, the padding ``AttentionMetadata.block_tables`` uses.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["HostBlockTables"]


class HostBlockTables:
    """``max_num_seqs`` rows of ``max_blocks_per_seq`` block ids (``int32``), zero-padded.

    Args:
        max_num_seqs: rows (live sequences at most), > 0.
        max_blocks_per_seq: columns, ``ceil(max_model_len / block_size)``, > 0.
    Raises:
        ValueError: a non-positive size.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        if max_num_seqs <= 0 or max_blocks_per_seq <= 0:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_blocks_per_seq "
                             f"({max_blocks_per_seq}) must be positive")
        self.array = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # lowest row handed out first

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def new_row(self, blocks: Sequence[int]) -> int:
        """Take a free row holding ``blocks``; raises IndexError when every row is taken (the
        cache checks ``max_num_seqs`` first)."""
        row = self._free_rows.pop()
        self.array[row, :len(blocks)] = blocks
        return row

    def copy_row(self, src: int) -> int:
        """Take a free row holding a copy of row ``src`` (fork)."""
        row = self._free_rows.pop()
        self.array[row] = self.array[src]
        return row

    def append(self, row: int, start: int, blocks: Sequence[int]) -> None:
        """Write ``blocks`` at columns ``start..start+len(blocks)-1`` of ``row`` (extend)."""
        self.array[row, start:start + len(blocks)] = blocks

    def set(self, row: int, index: int, block: int) -> None:
        """Column ``index`` of ``row`` becomes ``block`` (copy-on-write)."""
        self.array[row, index] = block

    def release(self, row: int, num_blocks: int) -> None:
        """Zero the first ``num_blocks`` columns of ``row`` and return it to the free rows."""
        self.array[row, :num_blocks] = 0
        self._free_rows.append(row)

    def gather(self, rows: Iterable[int], num_rows: int, width: int) -> np.ndarray:
        """The step's block tables: ``int32 [num_rows, width]`` (a C-contiguous copy) of the first
        ``width`` columns of ``rows`` (``num_rows`` of them), in order."""
        idx = np.fromiter(rows, dtype=np.int64, count=num_rows)
        return np.ascontiguousarray(self.array[idx, :width])

    def reset(self) -> None:
        """Every row free and zero."""
        self.array.fill(0)
        self._free_rows = list(range(self.array.shape[0] - 1, -1, -1))

    def check(self, tables: dict) -> None:
        """Raise ``AssertionError`` naming the numbers unless ``tables`` (``seq_id -> (row,
        block_table list)`` of every live sequence) matches the rows exactly, rows are distinct,
        and every free row is zero."""
        rows = [r for r, _ in tables.values()]
        if len(set(rows)) != len(rows) or set(rows) & set(self._free_rows):
            raise AssertionError(f"block-table rows reused: live {sorted(rows)}, free "
                                 f"{sorted(self._free_rows)}")
        if len(rows) + len(self._free_rows) != self.array.shape[0]:
            raise AssertionError(f"{len(rows)} live + {len(self._free_rows)} free block-table rows "
                                 f"!= {self.array.shape[0]} rows")
        for sid, (r, table) in tables.items():
            line = self.array[r]
            n = len(table)
            if line[:n].tolist() != list(table) or line[n:].any():
                raise AssertionError(f"sequence {sid}: host block-table row {r} "
                                     f"{line[:n + 1].tolist()} != block table {list(table)} "
                                     f"padded with 0")
        if self._free_rows and self.array[self._free_rows].any():
            raise AssertionError("a free host block-table row holds nonzero block ids")
