"""Host-side construction of the parts of :class:`AttentionMetadata` common to all backends."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from vmkv.kvcache.base import AttentionMetadata, StepSeq

__all__ = ["build_metadata", "step_token_positions"]


def _step_arrays(batch: Sequence[StepSeq]) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, query_lens)``, each ``int64 [num_seqs]``, of ``batch`` (entries are checked by
    :class:`StepSeq` itself); raises ValueError on an empty batch."""
    if not batch:
        raise ValueError("prepare() needs at least one scheduled sequence")
    n = len(batch)
    starts = np.fromiter((e.num_computed_tokens for e in batch), dtype=np.int64, count=n)
    qlens = np.fromiter((e.num_new_tokens for e in batch), dtype=np.int64, count=n)
    return starts, qlens


def _token_positions(starts: np.ndarray, qlens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if bool((qlens == 1).all()):  # decode: one token per sequence
        return np.arange(len(starts), dtype=np.int64), starts.copy()
    seq_index = np.repeat(np.arange(len(starts), dtype=np.int64), qlens)
    first = np.cumsum(qlens) - qlens  # token index of each sequence's first new token
    positions = np.arange(int(qlens.sum()), dtype=np.int64) - np.repeat(first - starts, qlens)
    return seq_index, positions


def step_token_positions(batch: Sequence[StepSeq]) -> tuple[np.ndarray, np.ndarray]:
    """Every new token of the step, in batch order, without a per-token Python loop.

    Returns:
        ``(seq_index, positions)``, both ``int64 [num_tokens]``: the batch index of each token's
        sequence and its position ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``.
    Raises:
        ValueError: an empty batch or an entry with no new tokens.
    """
    return _token_positions(*_step_arrays(batch))


def build_metadata(batch: Sequence[StepSeq], *, device: torch.device,
                   slot_index: Callable[[StepSeq, int], int] | None = None,
                   block_tables: torch.Tensor | None = None,
                   slot_indices: torch.Tensor | None = None,
                   slot_mapping: np.ndarray | torch.Tensor | None = None) -> AttentionMetadata:
    """Build step metadata on the host, then move it to ``device`` in one copy per tensor.

    Give the slot mapping either per token (``slot_index``) or precomputed (``slot_mapping``, the
    fast path: no Python call per token).

    Args:
        batch: scheduled sequences, in batch order; ``num_new_tokens >= 1`` each.
        slot_index: ``(entry, position) -> flat write index`` into the backend's
            ``[dim0, dim1, H, D]`` view (see ``AttentionMetadata.slot_mapping``).
        block_tables: paged: ``int32 [num_seqs, max_blocks]`` on the host (pinned memory if
            ``device`` is CUDA, for an asynchronous copy).
        slot_indices: vmem: ``int32 [num_seqs]`` on the host.
        slot_mapping: host ``int64 [num_tokens]`` (numpy array or tensor), the flat write index of
            every new token in the order of :func:`step_token_positions`.
    Raises:
        ValueError: an empty batch, an entry with no new tokens, not exactly one of
            ``slot_index`` / ``slot_mapping``, or a ``slot_mapping`` of the wrong length.
    """
    if (slot_index is None) == (slot_mapping is None):
        raise ValueError("give exactly one of slot_index (per-token callable) or slot_mapping "
                         "(precomputed int64 [num_tokens])")
    starts, qlens = _step_arrays(batch)
    seq_index, positions = _token_positions(starts, qlens)
    if slot_mapping is None:
        slots = np.fromiter((slot_index(e, p) for e in batch
                             for p in range(e.num_computed_tokens,
                                            e.num_computed_tokens + e.num_new_tokens)),
                            dtype=np.int64, count=len(positions))
        slot_t = torch.from_numpy(slots)
    else:
        slot_t = (slot_mapping if isinstance(slot_mapping, torch.Tensor)
                  else torch.from_numpy(np.ascontiguousarray(slot_mapping))).to(torch.int64)
        if slot_t.shape != (len(positions),):
            raise ValueError(f"slot_mapping has shape {tuple(slot_t.shape)}, the step has "
                             f"{len(positions)} new tokens; pass int64 [{len(positions)}]")
    seq_lens = starts + qlens
    qsl = np.zeros(len(batch) + 1, dtype=np.int32)
    np.cumsum(qlens, out=qsl[1:])
    cpu = device.type == "cpu"

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t if cpu else t.to(device, non_blocking=True)

    qlens_host = qlens.tolist()
    seq_lens_host = seq_lens.tolist()
    return AttentionMetadata(
        seq_ids=[e.seq_id for e in batch],
        query_start_loc=dev(torch.from_numpy(qsl)),
        seq_lens=dev(torch.from_numpy(seq_lens.astype(np.int32))),
        context_lens=dev(torch.from_numpy(starts.astype(np.int32))),
        positions=dev(torch.from_numpy(positions)),
        slot_mapping=dev(slot_t),
        max_query_len=max(qlens_host),
        max_seq_len=max(seq_lens_host),
        is_decode=all(q == 1 for q in qlens_host),
        last_token_indices=dev(torch.from_numpy(qsl[1:].astype(np.int64) - 1)),
        block_tables=None if block_tables is None else block_tables.to(device, non_blocking=True),
        slot_indices=None if slot_indices is None else slot_indices.to(device, non_blocking=True),
        seq_lens_host=seq_lens_host,
        query_lens_host=qlens_host,
    )
