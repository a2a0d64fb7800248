"""Configuration resolved once: the limits the engine runs with, decided by pure functions.

:func:`resolve_config` turns what the user asked for (:class:`~vmkv.engine.config.EngineConfig`),
what the model allows (``model_config.max_position_embeddings``) and how much memory is free into a
frozen :class:`ResolvedConfig`: ``max_model_len`` (given, or ``min(model context, 4096)`` lowered to
what the KV budget holds), the KV memory budget in bytes, the prefetch look-ahead.  All byte
arithmetic goes through :class:`~vmkv.kvcache.KVCacheSpec`.

A backend rounds its budget down to whole units (blocks, pages), which the engine cannot know
without naming a backend.  :meth:`ResolvedConfig.fit_to_capacity` is the second, equally pure step:
given the free tokens of the cache built from the first resolution, it returns the final frozen
config (a default ``max_model_len`` lowered to what the units hold; an explicit one that does not
fit raises).  The engine builds the cache once, fits, and only then builds its scheduler; nothing
is lowered by assignment and no cache is closed and rebuilt (STYLE.md rule 16).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from vmkv.engine.config import (
    DEFAULT_CPU_KV_MEMORY_BYTES,
    DEFAULT_CUDA_PREFETCH_TOKENS,
    DEFAULT_MAX_MODEL_LEN,
    EngineConfig,
)
from vmkv.kvcache.base import KVCacheSpec

__all__ = ["ResolvedConfig", "resolve_config", "MIN_MODEL_LEN"]

logger = logging.getLogger(__name__)

#: the shortest usable context: one prompt token and one output token
MIN_MODEL_LEN = 2
#: how to choose instead, in the log line of a lowered default ``max_model_len``: the engine's field names
#: and the ``vmkv serve`` / ``generate`` flags (a user who gave ``--kv-memory`` chose the memory, not this)
_CHOOSE_LEN = ("set max_model_len, --max-model-len, to choose the length; a longer one needs more KV memory: "
               "memory_bytes, --kv-memory, or --gpu-memory-utilization")


@dataclass(frozen=True)
class ResolvedConfig:
    """The limits an engine runs with (made by :func:`resolve_config`, never mutated).

    Attributes:
        max_model_len: positions per sequence (prompt + output), in ``[2, model context]``.
        max_model_len_is_default: ``max_model_len`` was not given, so :meth:`fit_to_capacity` may
            lower it to what the built cache holds.
        kv_memory_bytes: physical KV budget passed to the backend.
        kv_bytes_per_token: K + V bytes of one token over all layers (``KVCacheSpec.bytes_per_token``).
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill: the scheduler's limits.
        enable_prefix_caching: the cache shares identical prompt prefixes.
        prefetch_tokens: positions backed ahead of each sampling sequence per step (0: none).
    Raises:
        ValueError: a field out of range (names the field, the value and the range).
    """

    max_model_len: int
    kv_memory_bytes: int
    kv_bytes_per_token: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefetch_tokens: int = 0
    max_model_len_is_default: bool = False

    def __post_init__(self) -> None:
        for name, low in (("max_model_len", MIN_MODEL_LEN), ("kv_memory_bytes", 1), ("kv_bytes_per_token", 1),
                          ("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("prefetch_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ResolvedConfig.{name} must be an int >= {low}, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"ResolvedConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off")

    @property
    def kv_capacity_tokens(self) -> int:
        """Whole tokens the KV budget holds by byte arithmetic (a backend may hold a unit less)."""
        return self.kv_memory_bytes // self.kv_bytes_per_token

    def fit_to_capacity(self, free_tokens: int, capacity_bytes: int | None = None) -> "ResolvedConfig":
        """The config for a cache built from this one that can back ``free_tokens`` positions.

        Args:
            free_tokens: ``kv_cache.usage().free_tokens`` of the freshly built, empty cache.
            capacity_bytes: its ``usage().capacity_bytes`` (for the error message only).
        Returns:
            ``self`` when one sequence of ``max_model_len`` fits; else, for a default
            ``max_model_len``, a copy with ``max_model_len = free_tokens``.
        Raises:
            ValueError: an explicit ``max_model_len`` above ``free_tokens``, or fewer than 2 free
                tokens (the message says what to change).
        """
        if free_tokens >= self.max_model_len:
            return self
        if self.max_model_len_is_default and free_tokens >= MIN_MODEL_LEN:
            logger.warning("the KV cache holds %d tokens after unit rounding; lowering max_model_len from %d "
                           "to %d to fit (%s)", free_tokens, self.max_model_len, free_tokens, _CHOOSE_LEN)
            return dataclasses.replace(self, max_model_len=free_tokens)
        cap = self.kv_memory_bytes if capacity_bytes is None else capacity_bytes
        raise ValueError(
            f"the KV cache ({cap} bytes, {free_tokens} tokens) cannot hold one sequence of "
            f"max_model_len={self.max_model_len} tokens ({self.max_model_len * self.kv_bytes_per_token} "
            f"bytes); raise memory_bytes / gpu_memory_utilization or lower max_model_len to at most "
            f"{free_tokens}")


def resolve_config(config: EngineConfig, model_config, kv_spec: KVCacheSpec, *, device_type: str = "cpu",
                   free_memory_bytes: int | None = None) -> ResolvedConfig:
    """Decide the engine's limits once (pure: no model, no tensors, no allocation).

    Args:
        config: what was asked for.
        model_config: anything with ``max_position_embeddings`` (the model's context in tokens).
        kv_spec: the model's KV shape and dtype (all byte arithmetic).
        device_type: ``"cuda"`` or ``"cpu"`` (the default of ``prefetch_tokens``).
        free_memory_bytes: free device memory after the weights are loaded (CUDA:
            ``torch.cuda.mem_get_info``); the budget is ``gpu_memory_utilization`` of it, times
            ``tensor_parallel_size`` (each rank's GPU gives its share; ``kv_spec`` is the whole
            model's, every rank holding ``1 / tensor_parallel_size`` of each token).  ``None``:
            :data:`~vmkv.engine.config.DEFAULT_CPU_KV_MEMORY_BYTES`.  Ignored when
            ``config.cache.memory_bytes`` is given.
    Returns:
        :class:`ResolvedConfig`.  A default ``max_model_len`` is ``min(model context, 4096)``,
        lowered to ``max_num_batched_tokens`` when chunked prefill is off and to what the KV budget
        holds; a default budget is capped at what ``max_num_seqs`` full sequences use.
    Raises:
        ValueError: an explicit ``max_model_len`` above the model's context, above
            ``max_num_batched_tokens`` with chunked prefill off, or above what the KV budget holds;
            a budget below 2 tokens.  Each message names the field, the value and the range.
    """
    sc, cc = config.scheduler, config.cache
    ctx = int(model_config.max_position_embeddings)
    explicit = sc.max_model_len
    if explicit is not None:
        if not MIN_MODEL_LEN <= explicit <= ctx:
            what = (f"exceeds the model's context of {ctx} tokens" if explicit > ctx
                    else "leaves no room for an output token")
            raise ValueError(f"max_model_len={explicit} {what}; use a value in [{MIN_MODEL_LEN}, {ctx}]")
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < explicit:
            raise ValueError(f"max_num_batched_tokens={sc.max_num_batched_tokens} must be >= "
                             f"max_model_len={explicit} when chunked prefill is off")
        max_model_len = explicit
    else:
        max_model_len = min(ctx, DEFAULT_MAX_MODEL_LEN)
        if not sc.enable_chunked_prefill:
            max_model_len = min(max_model_len, sc.max_num_batched_tokens)
    memory_bytes = _kv_memory_bytes(config, kv_spec, max_model_len, free_memory_bytes)
    fits = kv_spec.max_tokens_for_bytes(memory_bytes)
    if fits < max_model_len:
        if explicit is not None or fits < MIN_MODEL_LEN:
            low = "" if fits < MIN_MODEL_LEN else f"lower max_model_len to at most {fits}, or "
            raise ValueError(
                f"the KV budget ({memory_bytes} bytes, {fits} tokens of {kv_spec.bytes_per_token} bytes) "
                f"cannot hold one sequence of max_model_len={max_model_len} tokens "
                f"({kv_spec.kv_bytes(max_model_len)} bytes; at least {MIN_MODEL_LEN} tokens are needed); "
                f"{low}raise memory_bytes / gpu_memory_utilization")
        logger.warning("KV budget of %d bytes holds %d tokens; lowering max_model_len from %d to %d to fit (%s)",
                       memory_bytes, fits, max_model_len, fits, _CHOOSE_LEN)
        max_model_len = fits
    prefetch = cc.prefetch_tokens
    if prefetch is None:
        prefetch = DEFAULT_CUDA_PREFETCH_TOKENS if device_type == "cuda" else 0
    return ResolvedConfig(
        max_model_len=max_model_len, kv_memory_bytes=memory_bytes, kv_bytes_per_token=kv_spec.bytes_per_token,
        max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
        enable_chunked_prefill=sc.enable_chunked_prefill, enable_prefix_caching=cc.enable_prefix_caching,
        prefetch_tokens=prefetch, max_model_len_is_default=explicit is None)


def _kv_memory_bytes(config: EngineConfig, kv_spec: KVCacheSpec, max_model_len: int,
                     free_memory_bytes: int | None) -> int:
    """``memory_bytes`` when given; else the device's share, at most what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can use."""
    cc = config.cache
    if cc.memory_bytes is not None:
        return cc.memory_bytes
    if free_memory_bytes is None:
        budget = DEFAULT_CPU_KV_MEMORY_BYTES
    else:
        budget = int(free_memory_bytes * cc.gpu_memory_utilization) * config.tensor_parallel_size
    most_useful = kv_spec.kv_bytes(config.scheduler.max_num_seqs * max_model_len)
    return max(1, min(budget, most_useful))
