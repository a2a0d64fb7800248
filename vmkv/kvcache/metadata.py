"""Host-side construction of the parts of :class:`AttentionMetadata` common to all backends."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from vmkv.kvcache.base import AttentionMetadata, StepSeq

__all__ = ["build_metadata", "step_token_positions", "step_layout", "StepStaging"]


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


#: byte alignment of every field of the packed step buffer (see :func:`step_layout`)
FIELD_ALIGN = 16


def step_layout(num_tokens: int, num_seqs: int, table_width: int) -> tuple[dict, int]:
    """Byte layout of one step's packed metadata buffer (every field 16-byte aligned).

    16 bytes because Triton specializes a kernel on whether each pointer argument is 16-byte
    aligned: with 8-byte alignment a field's alignment followed the step's token and sequence
    counts, so a step whose fields fell differently could compile new kernel variants in the middle
    of a run (seconds each: the 2 s steps seen on the H200 came from the same effect, tensors sliced
    at a step-dependent row).

    Fields: ``positions``, ``slot_mapping``, ``last_token_indices`` (int64), ``query_start_loc``
    (``num_seqs + 1``), ``seq_lens``, ``context_lens`` and ``table`` (int32): the block tables
    ``[num_seqs, table_width]`` when ``table_width > 0`` (paged), else the slot indices ``[num_seqs]``
    (vmem).  The layout depends only on the three sizes, so a padded decode step of ``num_seqs``
    rows lands at the same addresses as the step a CUDA graph was captured with.

    Returns:
        ``({name: (byte offset, numpy dtype, shape)}, total bytes)``.
    """
    t, s = int(num_tokens), int(num_seqs)
    table_shape = (s, int(table_width)) if table_width > 0 else (s,)
    fields = [("positions", np.int64, (t,)), ("slot_mapping", np.int64, (t,)),
              ("last_token_indices", np.int64, (s,)), ("query_start_loc", np.int32, (s + 1,)),
              ("seq_lens", np.int32, (s,)), ("context_lens", np.int32, (s,)),
              ("table", np.int32, table_shape)]
    layout, off = {}, 0
    for name, dtype, shape in fields:
        layout[name] = (off, dtype, shape)
        off += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // FIELD_ALIGN) * FIELD_ALIGN
    return layout, max(off, FIELD_ALIGN)


class StepStaging:
    """Pinned host staging for the packed step metadata (:func:`step_layout`): the host fills
    numpy views of one buffer, one asynchronous copy moves it to the device (vLLM v1's persistent
    input batch, in one buffer).  Two buffers alternate; before one is refilled, the copy that last
    read it is waited for (a CUDA event), so the host never overwrites bytes in flight.

    Args:
        device: the cache's device; off CUDA every step gets a fresh host buffer and no copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._events: list = [None, None]
        self._turn = 0

    def host(self, nbytes: int) -> tuple[np.ndarray, int]:
        """``(uint8 [>= nbytes] host array to fill, handle for :meth:`upload`)``."""
        if not self._cuda:
            return np.zeros(nbytes, dtype=np.uint8), -1
        self._turn ^= 1
        i = self._turn
        if self._events[i] is not None:
            self._events[i].synchronize()       # the copy that last read this buffer is done
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            size = max(4096, 1 << (int(nbytes) - 1).bit_length())
            buf = self._bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buf.numpy(), i

    def upload(self, host: np.ndarray, handle: int, nbytes: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes ``[0, nbytes)`` of ``host`` on the device: copied into ``out`` (a uint8 device
        buffer of at least ``nbytes``) or into a fresh buffer; one copy, asynchronous on CUDA."""
        src = torch.from_numpy(host[:nbytes]) if handle < 0 else self._bufs[handle][:nbytes]
        if out is not None:
            if out.dtype != torch.uint8 or out.numel() < nbytes or out.device.type != self.device.type:
                raise ValueError(f"out must be a uint8 buffer of >= {nbytes} bytes on {self.device}, "
                                 f"got {out.dtype} [{out.numel()}] on {out.device}")
            dst = out[:nbytes]
            dst.copy_(src, non_blocking=True)
        elif handle < 0:
            dst = src
        else:
            dst = src.to(self.device, non_blocking=True)
        if handle >= 0:
            if self._events[handle] is None:
                self._events[handle] = torch.cuda.Event()
            self._events[handle].record()
        return dst


def build_metadata(batch: Sequence[StepSeq], *, device: torch.device,
                   slot_index: Callable[[StepSeq, int], int] | None = None,
                   block_tables: np.ndarray | torch.Tensor | None = None,
                   slot_indices: Sequence[int] | np.ndarray | torch.Tensor | None = None,
                   slot_mapping: np.ndarray | torch.Tensor | None = None,
                   pad_to: int | None = None, out: torch.Tensor | None = None,
                   staging: StepStaging | None = None,
                   plan: Callable[[int, int], int] | None = None) -> AttentionMetadata:
    """Build step metadata on the host in one packed buffer (:func:`step_layout`), then move it to
    ``device`` in one copy; the tensor fields are views of that device buffer.

    Give the slot mapping either per token (``slot_index``) or precomputed (``slot_mapping``, the
    fast path: no Python call per token).

    Args:
        batch: scheduled sequences, in batch order; ``num_new_tokens >= 1`` each.
        slot_index: ``(entry, position) -> flat write index`` into the backend's
            ``[dim0, dim1, H, D]`` view (see ``AttentionMetadata.slot_mapping``).
        block_tables: paged: ``int32 [num_seqs, width]`` host array (rows padded with 0).
        slot_indices: vmem: the slot of each sequence (host ints).
        slot_mapping: host ``int64 [num_tokens]`` (numpy array or tensor), the flat write index of
            every new token in the order of :func:`step_token_positions`.
        pad_to: decode only: pad the step to this many one-token rows (a CUDA graph's batch size);
            padding rows have ``seq_len 0``, slot ``-1`` (nothing written), table rows 0.  The
            ``*_host`` lists and ``seq_ids`` describe the real rows only.
        out: a uint8 device buffer to copy into (a captured graph's static buffer).
        staging: the cache's :class:`StepStaging` (pinned, double-buffered); default: a fresh one.
        plan: ``plan(rows, longest context) -> num_splits``, the decode split-K plan, called for
            decode steps and for the leading decode rows of a mixed step (``num_decodes``;
            default: 0, the kernel chooses per call).
    Raises:
        ValueError: an empty batch (without ``pad_to``), an entry with no new tokens, not exactly one
            of ``slot_index`` / ``slot_mapping``, a ``slot_mapping`` of the wrong length, ``pad_to``
            below the batch size or with a prefill entry.
    """
    if (slot_index is None) == (slot_mapping is None):
        raise ValueError("give exactly one of slot_index (per-token callable) or slot_mapping "
                         "(precomputed int64 [num_tokens])")
    if pad_to is not None and not batch:
        starts = qlens = np.zeros(0, dtype=np.int64)
    else:
        starts, qlens = _step_arrays(batch)
    seq_index, positions = _token_positions(starts, qlens)
    if slot_mapping is None:
        slots = np.fromiter((slot_index(e, p) for e in batch
                             for p in range(e.num_computed_tokens,
                                            e.num_computed_tokens + e.num_new_tokens)),
                            dtype=np.int64, count=len(positions))
    else:
        slots = (slot_mapping.numpy() if isinstance(slot_mapping, torch.Tensor)
                 else np.asarray(slot_mapping))
        if slots.shape != (len(positions),):
            raise ValueError(f"slot_mapping has shape {tuple(slots.shape)}, the step has "
                             f"{len(positions)} new tokens; pass int64 [{len(positions)}]")
    n, t = len(starts), len(positions)
    rows, tokens = n, t
    if pad_to is not None:
        if pad_to < n or (n and not bool((qlens == 1).all())):
            raise ValueError(f"pad_to={pad_to} needs a decode batch of at most {pad_to} sequences, "
                             f"got {n} sequences and {t} tokens")
        rows = tokens = int(pad_to)
    if isinstance(block_tables, torch.Tensor):
        block_tables = block_tables.numpy()
    width = 0 if block_tables is None else int(block_tables.shape[1])
    layout, nbytes = step_layout(tokens, rows, width)
    staging = staging or StepStaging(device)
    host, handle = staging.host(nbytes)

    def view(name):
        off, dtype, shape = layout[name]
        return host[off:off + int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    qsl = view("query_start_loc")
    qsl[0] = 0
    np.cumsum(qlens, out=qsl[1:n + 1])
    qsl[n + 1:] = qsl[n] + np.arange(1, rows - n + 1)
    seq_lens = starts + qlens
    for name, real, pad in (("positions", positions, 0), ("slot_mapping", slots, -1),
                            ("seq_lens", seq_lens, 0), ("context_lens", starts, 0)):
        v = view(name)
        v[:len(real)] = real
        v[len(real):] = pad
    last = view("last_token_indices")
    last[:] = qsl[1:] - 1
    table = view("table")
    table[n:] = 0
    if block_tables is not None:
        table[:n] = block_tables
    elif slot_indices is not None:
        table[:n] = (slot_indices.numpy() if isinstance(slot_indices, torch.Tensor)
                     else np.asarray(slot_indices, dtype=np.int32))
    dev = staging.upload(host, handle, nbytes, out)

    def tensor(name):
        off, dtype, shape = layout[name]
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return dev[off:off + size].view(torch.int64 if dtype is np.int64 else torch.int32).view(shape)

    qlens_host = qlens.tolist()
    seq_lens_host = seq_lens.tolist()
    is_decode = all(q == 1 for q in qlens_host)
    max_seq_len = max(seq_lens_host, default=1)
    # the leading one-token rows (decodes come first in the scheduler's batch)
    num_decodes = n if is_decode else int(np.argmax(qlens != 1))
    num_splits = 0
    if plan is not None and is_decode:
        num_splits = plan(rows, max_seq_len)
    elif plan is not None and num_decodes:
        num_splits = plan(num_decodes, int(seq_lens[:num_decodes].max()))
    return AttentionMetadata(
        seq_ids=[e.seq_id for e in batch],
        query_start_loc=tensor("query_start_loc"),
        seq_lens=tensor("seq_lens"),
        context_lens=tensor("context_lens"),
        positions=tensor("positions"),
        slot_mapping=tensor("slot_mapping"),
        max_query_len=max(qlens_host, default=1),
        max_seq_len=max_seq_len,
        is_decode=is_decode,
        last_token_indices=tensor("last_token_indices"),
        block_tables=tensor("table") if block_tables is not None else None,
        slot_indices=tensor("table") if block_tables is None and slot_indices is not None else None,
        seq_lens_host=seq_lens_host,
        query_lens_host=qlens_host,
        slot_indices_host=(None if slot_indices is None else
                           slot_indices.tolist() if hasattr(slot_indices, "tolist") else list(slot_indices)),
        num_splits=num_splits,
        num_decodes=num_decodes,
    )
