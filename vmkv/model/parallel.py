"""Tensor parallelism of the Llama layers (Megatron-LM, Shoeybi et al. 2019, sec. 3): which parameters
are split over the ``size`` ranks, along which dimension, and the collectives the forward needs.

- **column-parallel** (the output rows split): the fused ``qkv_proj`` (its q, k and v parts each split,
  so a rank holds ``num_heads / size`` query heads and ``num_kv_heads / size`` KV heads) and the fused
  ``gate_up_proj`` (gate and up each split), with their biases.  No communication: attention and the
  SwiGLU activation are per head / per intermediate column.
- **row-parallel** (the input columns split): ``o_proj`` and ``down_proj``.  Each rank's partial
  product is summed over the ranks (``all_reduce``); the bias is added once, after the sum.
- **vocab-parallel**: the rows of ``embed_tokens`` and ``lm_head``.  The embedding looks up the ids in
  the rank's range (zero rows elsewhere) and all-reduces (a sum of one row and zeros: exact); the LM
  head's logits are all-gathered into the full vocabulary.
- **replicated**: the norms, the row-parallel biases, the RoPE frequencies.

Every rank's shard is cut from the same full tensor (:meth:`TensorParallel.shard`), so ``size`` ranks
compute what one process computes, up to the order of the all-reduce's additions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["TensorParallel", "ShardLayout", "check_divisible", "shard_layout", "SINGLE"]


@dataclass(frozen=True)
class ShardLayout:
    """How a parameter is split: along ``dim``, each fused part (full sizes ``parts`` along ``dim``)
    cut into ``size`` equal pieces, a rank's pieces concatenated in part order."""

    dim: int
    parts: tuple[int, ...]


def check_divisible(config, size: int) -> None:
    """Raise ``ValueError`` unless ``config``'s query heads, KV heads, intermediate size and vocabulary
    divide by ``size`` (the message names the field, the value and the tensor-parallel sizes that work).

    Args:
        config: a :class:`~vmkv.model.config.ModelConfig`.
        size: ranks (``tensor_parallel_size``), an int >= 1.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, name)
        if value % size:
            ok = [n for n in range(1, min(value, 64) + 1)
                  if all(getattr(config, f) % n == 0
                         for f in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"))]
            raise ValueError(
                f"tensor_parallel_size={size} does not divide ModelConfig.{name}={value} (each rank "
                f"holds an equal share of the query heads, KV heads, intermediate size and vocabulary); "
                f"this model runs with a tensor_parallel_size in {ok}")


def shard_layout(name: str, config) -> ShardLayout | None:
    """The :class:`ShardLayout` of the parameter ``name`` (a ``LlamaForCausalLM.named_parameters`` name)
    of a model of shape ``config``, or ``None`` when it is replicated on every rank."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return ShardLayout(0, (config.vocab_size,))
    if ".qkv_proj." in name:
        return ShardLayout(0, (config.q_size, config.kv_size, config.kv_size))
    if ".gate_up_proj." in name:
        return ShardLayout(0, (config.intermediate_size, config.intermediate_size))
    if name.endswith("o_proj.weight"):
        return ShardLayout(1, (config.q_size,))
    if name.endswith("down_proj.weight"):
        return ShardLayout(1, (config.intermediate_size,))
    return None


class TensorParallel:
    """This process's place in a tensor-parallel group and the collectives over it.

    Args:
        rank: this process's rank in ``[0, size)``.
        size: ranks in the group (1: no parallelism, no communication).
        group: the ``torch.distributed`` process group (``None``: the default group).
    Raises:
        ValueError: ``size < 1`` or ``rank`` outside ``[0, size)``.
    """

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor-parallel size must be an int >= 1, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank must be an int in [0, {size}), got {rank!r}")
        self.rank, self.size, self.group = rank, size, group

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"

    def local(self, n: int) -> int:
        """This rank's share of ``n`` (``n`` divides by ``size``: :func:`check_divisible`)."""
        assert n % self.size == 0, f"{n} does not divide by tensor-parallel size {self.size}"
        return n // self.size

    def shard(self, full: torch.Tensor, layout: ShardLayout | None) -> torch.Tensor:
        """This rank's piece of ``full`` (the whole model's tensor): for each fused part along
        ``layout.dim``, the ``rank``-th of ``size`` equal slices, concatenated; ``full`` itself when
        ``layout`` is ``None`` or ``size == 1``.  A view when there is one part."""
        if layout is None or self.size == 1:
            return full
        if full.shape[layout.dim] != sum(layout.parts):
            raise ValueError(f"tensor of shape {tuple(full.shape)} has {full.shape[layout.dim]} along dim "
                             f"{layout.dim}, the layout expects {sum(layout.parts)} (parts {layout.parts})")
        pieces = [part.narrow(layout.dim, self.rank * self.local(n), self.local(n))
                  for part, n in zip(full.split(list(layout.parts), layout.dim), layout.parts)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, layout.dim)

    def row_parallel_linear(self, x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel linear layer: this rank's input columns ``x: [num_tokens, in / size]`` times
        its ``weight: [out, in / size]``, summed over the ranks, plus the replicated ``bias: [out]``
        once.  Returns ``[num_tokens, out]`` (every rank the same)."""
        if self.size == 1:
            return F.linear(x, weight, bias)
        out = self.all_reduce(F.linear(x, weight))
        return out if bias is None else out.add_(bias)

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A vocab-parallel embedding: ``input_ids: int64 [num_tokens]`` (full-vocabulary ids),
        ``weight: [vocab_size / size, hidden]`` (this rank's rows) -> ``[num_tokens, hidden]``.  A rank
        looks up the ids in its rows and zeroes the others; the sum over the ranks is the full lookup."""
        if self.size == 1:
            return F.embedding(input_ids, weight)
        local = input_ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (every rank gets the sum); returns ``x``."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [n, m]`` on every rank -> ``[n, size * m]``: the ranks' pieces side by side, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(pieces, x, group=self.group)
        return torch.cat(pieces, dim=-1)


#: the single-process group (no parallelism)
SINGLE = TensorParallel()
