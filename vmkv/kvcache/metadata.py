"""Host-side construction of the parts of :class:`AttentionMetadata` common to all backends."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from vmkv.kvcache.base import AttentionMetadata, StepSeq


def build_metadata(batch: Sequence[StepSeq], *, device: torch.device,
                   slot_index: Callable[[StepSeq, int], int],
                   block_tables: torch.Tensor | None = None,
                   slot_indices: torch.Tensor | None = None) -> AttentionMetadata:
    """Build step metadata on the host, then move it to ``device`` in one copy per tensor.

    Args:
        batch: scheduled sequences, in batch order; ``num_new_tokens >= 1`` each.
        slot_index: ``(entry, position) -> flat write index`` into the backend's
            ``[dim0, dim1, H, D]`` view (see ``AttentionMetadata.slot_mapping``).
        block_tables: paged: ``int32 [num_seqs, max_blocks]`` on the host.
        slot_indices: vmem: ``int32 [num_seqs]`` on the host.
    Raises:
        ValueError: an empty batch or an entry with no new tokens.
    """
    if not batch:
        raise ValueError("prepare() needs at least one scheduled sequence")
    qsl = [0]
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    ctx: list[int] = []
    qlens: list[int] = []
    for e in batch:
        if e.num_new_tokens < 1 or e.num_computed_tokens < 0:
            raise ValueError(f"bad StepSeq {e}: num_new_tokens must be >= 1, num_computed >= 0")
        start = e.num_computed_tokens
        end = start + e.num_new_tokens
        rng = range(start, end)
        positions.extend(rng)
        slots.extend(slot_index(e, p) for p in rng)
        qsl.append(qsl[-1] + e.num_new_tokens)
        seq_lens.append(end)
        ctx.append(start)
        qlens.append(e.num_new_tokens)

    def dev(data, dtype):
        t = torch.tensor(data, dtype=dtype)
        return t.to(device, non_blocking=True) if device.type != "cpu" else t

    last = [q - 1 for q in qsl[1:]]
    return AttentionMetadata(
        seq_ids=[e.seq_id for e in batch],
        query_start_loc=dev(qsl, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        context_lens=dev(ctx, torch.int32),
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        is_decode=all(q == 1 for q in qlens),
        last_token_indices=dev(last, torch.int64),
        block_tables=None if block_tables is None else block_tables.to(device, non_blocking=True),
        slot_indices=None if slot_indices is None else slot_indices.to(device, non_blocking=True),
        seq_lens_host=seq_lens,
        query_lens_host=qlens,
    )
