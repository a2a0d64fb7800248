"""CUDA graphs for decode steps, on both KV backends.

At start-up the runner captures one graph of the model's forward per decode batch size (vLLM's
capture sizes: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs``), largest first, all in one
memory pool.  A decode-only step of ``B`` sequences then replays the smallest captured size ``>= B``:
``kv_cache.prepare(batch, pad_to=size, out=buffer)`` writes the step's metadata into the graph's static
buffer in one copy (padding rows read and write nothing), the token ids go into its static input, and
``graph.replay()`` launches every kernel of every layer at once, with no Python per layer.  Prefill and
mixed steps, and decode steps larger than the largest size, run eagerly.

Why a graph stays valid while the KV cache changes under it:
- paged: block tables are values in the static buffer, updated in place each step;
- vmem: each slot is a fixed virtual range, so pages mapped (or released) underneath after capture
  change nothing the graph holds (vAttention, Prabhu et al., ASPLOS'25, section 6: "vAttention is
  compatible with CUDA graphs"); the kernels read only positions below each row's ``seq_len``;
- the decode kernel's grid is sized for ``max_model_len`` and each row divides its own context over it
  (:func:`vmkv.kernels.decode_attention.decode_attention`), so no launch depends on a device value.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vmkv.kvcache.base import AttentionMetadata, KVCache, StepSeq
from vmkv.kvcache.metadata import StepStaging

__all__ = ["CUDAGraphRunner", "build_cuda_graphs", "default_capture_sizes"]

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's decode capture sizes: 1, 2, 4 and every multiple of 8, up to ``max_num_seqs`` (which is
    always included, so every decode step fits a graph)."""
    sizes = {b for b in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if b <= max_num_seqs}
    return tuple(sorted(sizes | {int(max_num_seqs)}))


def build_cuda_graphs(model, kv_cache: KVCache, device: torch.device, *, enforce_eager: bool,
                      sizes: Sequence[int] | None, max_num_seqs: int) -> "CUDAGraphRunner | None":
    """The engine's graph runner, captured, or ``None`` (eager) on CPU, with ``enforce_eager``, or
    when the cache cannot be captured (e.g. vmem with ``attention_impl="sdpa"``; logged).  Sizes
    above ``max_num_seqs`` are dropped; ``sizes=None``: :func:`default_capture_sizes`."""
    device = torch.device(device)
    if enforce_eager or device.type != "cuda":
        return None
    if not kv_cache.supports_cuda_graphs:
        logger.info("CUDA graphs off: the %s KV cache's attention path cannot be captured here",
                    type(kv_cache).__name__)
        return None
    chosen = [b for b in (sizes or default_capture_sizes(max_num_seqs)) if b <= max_num_seqs]
    if not chosen:
        logger.warning("CUDA graphs off: every --cuda-graph-sizes value is above max_num_seqs=%d",
                       max_num_seqs)
        return None
    runner = CUDAGraphRunner(model, kv_cache, device, chosen)
    runner.capture()
    return runner


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    buffer: torch.Tensor           # uint8: the step metadata (KVCache.graph_buffer_bytes)
    input_ids: torch.Tensor        # int64 [size]
    logits: torch.Tensor           # float32 [size, vocab]
    # the captured metadata, and with it the kernels' per-step workspace (decode split-K partials):
    # allocated by the eager forwards before the capture, outside the graph's pool, and written by
    # every replay, so it must live as long as the graph.  Dropped, its memory went back to the
    # caching allocator, which `torch.cuda.graph` empties before each capture: replays then wrote to
    # released or reused memory (the likely cause of the illegal memory access in graph replays seen
    # on the H200, docs/results/h200/issue11/README.md)
    meta: AttentionMetadata


class CUDAGraphRunner:
    """Captures and replays decode steps (module docstring).

    Args:
        model: ``forward(input_ids, positions, kv_cache, meta) -> float32 [rows, vocab]``.
        kv_cache: a cache with ``supports_cuda_graphs``.
        device: a CUDA device.
        sizes: batch sizes to capture (ascending, each >= 1).
    Attributes:
        capture_time_s: seconds :meth:`capture` took; graph_memory_bytes: device memory it took
            (``torch.cuda.mem_get_info`` before and after).
        num_replays: decode steps replayed so far; num_captures: graphs captured (once each).
    Raises:
        ValueError: the cache cannot be captured or ``sizes`` is empty / not positive.
    """

    def __init__(self, model, kv_cache: KVCache, device: torch.device, sizes: Sequence[int]) -> None:
        if not kv_cache.supports_cuda_graphs:
            raise ValueError(f"{type(kv_cache).__name__} cannot be captured in CUDA graphs here "
                             f"(needs CUDA and the Triton attention path)")
        if not sizes or any(int(b) < 1 for b in sizes):
            raise ValueError(f"capture sizes must be ints >= 1, got {list(sizes)!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.sizes = tuple(sorted({int(b) for b in sizes}))
        self.max_size = self.sizes[-1]
        self._graphs: dict[int, _Captured] = {}
        self._staging = StepStaging(self.device)
        self.capture_time_s = 0.0
        self.graph_memory_bytes = 0
        self.num_replays = 0
        self.num_captures = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first, one shared memory pool); each forward runs twice
        eagerly on the capture stream first (Triton compiles, cuBLAS picks its kernels)."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            buffer = torch.zeros(self.kv_cache.graph_buffer_bytes(size), dtype=torch.uint8,
                                 device=self.device)
            input_ids = torch.zeros(size, dtype=torch.int64, device=self.device)
            meta = self.kv_cache.capture_metadata(size, buffer)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model.forward(input_ids, meta.positions, self.kv_cache, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self.model.forward(input_ids, meta.positions, self.kv_cache, meta)
            self._graphs[size] = _Captured(graph, buffer, input_ids, logits, meta)
            self.num_captures += 1
        torch.cuda.synchronize(self.device)
        self.capture_time_s = time.perf_counter() - t0
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("captured %d CUDA graphs (decode batch sizes %s) in %.2f s, %.2f GiB",
                    len(self._graphs), _ranges(self.sizes), self.capture_time_s,
                    self.graph_memory_bytes / (1 << 30))

    def size_for(self, batch: Sequence[StepSeq]) -> int | None:
        """The captured size a step replays (the smallest ``>= len(batch)``), or ``None`` when it
        runs eagerly (a prefill or mixed step, or more sequences than the largest size)."""
        n = len(batch)
        if not self._graphs or n > self.max_size or any(e.num_new_tokens != 1 for e in batch):
            return None
        return next(b for b in self.sizes if b >= n)

    def run(self, batch: Sequence[StepSeq], input_ids: Sequence[int] | torch.Tensor,
            size: int) -> torch.Tensor:
        """Replay the graph of ``size`` for a decode ``batch`` (from :meth:`size_for`).

        Args:
            input_ids: the step's token ids, one per sequence, in batch order (host ints, or an
                ``int64`` device tensor: the previous step's sampled tokens).
        Returns:
            ``float32 [len(batch), vocab]`` logits: a view of the graph's static output, valid until
            the next replay of the same size.
        Raises:
            whatever ``kv_cache.prepare`` raises (nothing has been replayed then).
        """
        g = self._graphs[size]
        n = len(batch)
        self.kv_cache.prepare(batch, pad_to=size, out=g.buffer)
        if n < size:                # padding rows read token 0, whatever an earlier replay left there
            g.input_ids[n:].zero_()
        if isinstance(input_ids, torch.Tensor):       # already on the device (scheduled ahead)
            g.input_ids[:n].copy_(input_ids)
        else:
            host, handle = self._staging.host(8 * n)
            host[:8 * n].view(np.int64)[:] = input_ids
            self._staging.upload(host, handle, 8 * n, out=g.input_ids.view(torch.uint8))
        g.graph.replay()
        self.num_replays += 1
        return g.logits[:n]


def _ranges(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
