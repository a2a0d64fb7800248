"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) whose attention runs through a KVCache.

Architecture (Touvron et al. 2023, "Llama 2", sec. 2.2; Grattafiori et al. 2024, "The Llama 3 Herd of
Models"): pre-norm decoder layers with RMSNorm (Zhang & Sennrich 2019), rotary position embeddings
(Su et al. 2021, RoFormer, in the "rotate half" form of GPT-NeoX / Hugging Face), grouped-query attention
(Ainslie et al. 2023, GQA) and a SwiGLU MLP (Shazeer 2020).  Weights use fused projections: ``qkv_proj``
(``[q_size + 2 * kv_size, hidden]``) and ``gate_up_proj`` (``[2 * intermediate, hidden]``);
:meth:`LlamaForCausalLM.load_weights` takes Hugging Face tensor names and fills the fused shards.

Per step, the engine calls ``kv_cache.prepare`` once; every layer then calls
``kv_cache.write_kv(layer, k, v, meta)`` and ``kv_cache.attention(layer, q, meta)``.

Tensor parallelism (``tp=TensorParallel(rank, size)``, :mod:`vmkv.model.parallel`): the model holds
this rank's shard (its query and KV heads, its part of the intermediate size and of the vocabulary);
``o_proj``/``down_proj`` and the embedding all-reduce, the LM head all-gathers the logits.  The KV
cache then holds ``num_kv_heads / size`` heads.

The small ops between the matmuls run fused (:mod:`vmkv.kernels.fused_ops`: Triton on CUDA, the torch
references elsewhere, so the CPU path computes what the eager code did): the residual stream is carried
through the layers the vLLM way (``hidden, residual = norm(x, residual)``: one kernel adds the sublayer
output into the residual in place and normalises it), RoPE rotates q and k in place inside the qkv
output from ``positions`` and ``inv_freq`` (no per-step cos/sin tensors), and SwiGLU's ``silu(gate) * up``
is one kernel.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vmkv.kernels import fused_ops
# rms_norm(x, weight, eps): eager RMSNorm as Hugging Face Llama computes it (the fused kernel's reference)
from vmkv.kernels.fused_reference import rms_norm_ref as rms_norm
from vmkv.kvcache.base import AttentionMetadata, KVCache
from vmkv.model.config import ModelConfig
from vmkv.model.parallel import SINGLE, ShardLayout, TensorParallel, check_divisible, shard_layout

logger = logging.getLogger(__name__)

__all__ = ["LlamaForCausalLM", "rope_inv_freq", "apply_rope", "rms_norm"]


def _param(*shape: int, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``float32 [head_dim // 2]``: ``theta ** (-2i / head_dim)``, with
    linear scaling (divide by ``factor``) or Llama-3 scaling (Llama 3 paper sec. 3.3.1 / Meta's
    reference ``apply_scaling``: wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``, shorter than ``.../high_freq_factor`` kept, smooth
    interpolation between)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    rope = config.rope_scaling
    if rope is None or rope["rope_type"] == "llama3_freq_factors":
        return inv_freq
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [num_tokens, heads, head_dim]`` by ``cos, sin: [num_tokens, head_dim]``
    (rotate-half form: dims ``i`` and ``i + head_dim/2`` form a pair), out of place.

    The eager form with precomputed cos/sin (Hugging Face's ``apply_rotary_pos_emb``); the model
    runs :func:`vmkv.kernels.fused_ops.rotary_embedding` instead, tests compare the two."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaAttention(nn.Module):
    """GQA self-attention of one layer; K/V stored in and read from the KV cache."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, device, dtype, ops_impl: str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ops_impl = ops_impl
        self.tp = tp        # this rank's heads: num_heads / size query heads, num_kv_heads / size KV heads
        self.num_heads, self.num_kv_heads = tp.local(config.num_heads), tp.local(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.head_dim ** -0.5
        h = config.hidden_size
        self.qkv_proj = nn.Module()
        self.qkv_proj.weight = _param(self.q_size + 2 * self.kv_size, h, device=device, dtype=dtype)
        self.qkv_proj.bias = (_param(self.q_size + 2 * self.kv_size, device=device, dtype=dtype)
                              if config.qkv_bias else None)
        self.o_proj = nn.Module()
        self.o_proj.weight = _param(h, self.q_size, device=device, dtype=dtype)
        self.o_proj.bias = _param(h, device=device, dtype=dtype) if config.o_proj_bias else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """``x: [num_tokens, hidden]`` -> ``[num_tokens, hidden]``; writes this step's K/V (this rank's
        KV heads); under tensor parallelism the output is all-reduced over the ranks.

        ``positions: int64 [num_tokens]``, ``inv_freq: float32 [head_dim // 2]`` (RoPE).  q, k and v
        stay views of the qkv output (``[num_tokens, heads, head_dim]``, token stride
        ``q_size + 2 * kv_size``, ``stride(-1) == 1``); RoPE rotates q and k in place."""
        n = x.shape[0]
        qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        fused_ops.rotary_embedding(positions, q, k, inv_freq, impl=self.ops_impl)
        kv_cache.write_kv(self.layer_idx, k, v, meta)
        out = kv_cache.attention(self.layer_idx, q, meta, scale=self.scale)
        return self.tp.row_parallel_linear(out.reshape(n, self.q_size), self.o_proj.weight, self.o_proj.bias)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, config: ModelConfig, *, device, dtype, ops_impl: str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, i = config.hidden_size, tp.local(config.intermediate_size)
        self.intermediate_size = i      # this rank's part of it
        self.ops_impl = ops_impl
        self.tp = tp
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = _param(2 * i, h, device=device, dtype=dtype)
        self.gate_up_proj.bias = _param(2 * i, device=device, dtype=dtype) if config.mlp_bias else None
        self.down_proj = nn.Module()
        self.down_proj.weight = _param(h, i, device=device, dtype=dtype)
        self.down_proj.bias = _param(h, device=device, dtype=dtype) if config.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        gate_up = F.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        act = fused_ops.silu_and_mul(gate_up, impl=self.ops_impl)
        return self.tp.row_parallel_linear(act, self.down_proj.weight, self.down_proj.bias)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm layer that carries the residual stream beside the hidden states (vLLM's form): the
    input norm adds the previous sublayer's output into the residual, the post-attention norm adds
    the attention output, and the MLP output is left for the next layer (or the final norm) to add."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, device, dtype, ops_impl: str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.ops_impl = ops_impl
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = _param(config.hidden_size, device=device, dtype=dtype)
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = _param(config.hidden_size, device=device, dtype=dtype)
        self.self_attn = LlamaAttention(config, layer_idx, device=device, dtype=dtype, ops_impl=ops_impl, tp=tp)
        self.mlp = LlamaMLP(config, device=device, dtype=dtype, ops_impl=ops_impl, tp=tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                inv_freq: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer.

        Args:
            positions: ``int64 [num_tokens]``; inv_freq: ``float32 [head_dim // 2]``.
            hidden: ``[num_tokens, hidden]``: the previous layer's MLP output (the embeddings for
                the first layer, whose ``residual`` is ``None``).
            residual: ``[num_tokens, hidden]``, the residual stream so far (without ``hidden``);
                updated in place.
        Returns:
            ``(mlp_output, residual)``, both ``[num_tokens, hidden]``; the residual does not yet
            include the MLP output.
        """
        if residual is None:
            residual = hidden
            hidden = fused_ops.rms_norm(hidden, self.input_layernorm.weight, self.eps, impl=self.ops_impl)
        else:
            hidden = fused_ops.fused_add_rms_norm(hidden, residual, self.input_layernorm.weight, self.eps,
                                                  impl=self.ops_impl)
        hidden = self.self_attn(positions, hidden, inv_freq, kv_cache, meta)
        hidden = fused_ops.fused_add_rms_norm(hidden, residual, self.post_attention_layernorm.weight,
                                              self.eps, impl=self.ops_impl)
        return self.mlp(hidden), residual


# Hugging Face name -> (our parameter, shard index in the fused tensor or None)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
          "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
          "mlp.up_proj": ("mlp.gate_up_proj", 1)}
_PLAIN = ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a :class:`~vmkv.kvcache.base.KVCache`.

    Args:
        config: the model shape.
        device: where parameters live; ``dtype``: their dtype (bf16 on CUDA, float32 on CPU usual).
        ops_impl: implementation of the fused small ops (:mod:`vmkv.kernels.fused_ops`): ``"auto"``
            (Triton on CUDA, the torch references elsewhere), ``"triton"`` or ``"torch"`` (tests).
        tp: this process's rank and group (:mod:`vmkv.model.parallel`); the model then holds the
            rank's shard of every split parameter, and its forward joins the group's collectives.
    Parameters are created uninitialized; fill them with :meth:`load_weights` or
    :meth:`init_random_` (both cut this rank's shard from the full tensors).
    Raises:
        ValueError: ``ops_impl`` is not one of ``fused_ops.IMPLS``; ``tp.size`` does not divide the
            heads, KV heads, intermediate size or vocabulary (:func:`~vmkv.model.parallel.check_divisible`).
    """

    def __init__(self, config: ModelConfig, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, ops_impl: str = "auto",
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if ops_impl not in fused_ops.IMPLS:
            raise ValueError(f"ops_impl must be one of {fused_ops.IMPLS}, got {ops_impl!r}")
        check_divisible(config, tp.size)
        self.config = config
        self.ops_impl = ops_impl
        self.tp = tp
        device = torch.device(device)
        vocab, h = tp.local(config.vocab_size), config.hidden_size     # this rank's rows of the vocabulary
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(vocab, h, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, device=device, dtype=dtype, ops_impl=ops_impl, tp=tp)
            for i in range(config.num_layers))
        self.norm = nn.Module()
        self.norm.weight = _param(h, device=device, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Module()
            self.lm_head.weight = _param(vocab, h, device=device, dtype=dtype)
        self.register_buffer("inv_freq", rope_inv_freq(config, device), persistent=False)
        self._loaded: set[tuple[str, int | None]] = set()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                       meta: AttentionMetadata) -> torch.Tensor:
        """Run every layer over the step's tokens; writes their K/V into ``kv_cache``.

        Args:
            input_ids: ``int64 [num_tokens]``, token ids in ``meta``'s token order.
            positions: ``int64 [num_tokens]``, position of each token in its sequence.
            kv_cache: the cache ``meta`` was prepared by (``kv_cache.prepare(batch)``).
            meta: this step's :class:`AttentionMetadata`.
        Returns:
            ``[num_tokens, hidden_size]`` final-norm hidden states in the model dtype.
        Raises:
            ValueError: shapes of ``input_ids``, ``positions`` and ``meta`` disagree.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be [num_tokens], got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens, metadata has {meta.num_tokens}")
        hidden, residual = self.tp.embedding(input_ids, self.embed_tokens.weight), None
        inv_freq = self.inv_freq
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, inv_freq, kv_cache, meta)
        return fused_ops.fused_add_rms_norm(hidden, residual, self.norm.weight, self.config.rms_norm_eps,
                                            impl=self.ops_impl)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [n, hidden_size]`` -> ``float32 [n, vocab_size]`` logits (under tensor parallelism
        each rank's vocabulary rows, all-gathered: every rank gets the full logits)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.tp.all_gather(F.linear(hidden, weight)).float()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """One engine step (prefill chunks and decode tokens of several sequences together).

        Args: as :meth:`forward_hidden`.
        Returns:
            ``float32 [num_seqs, vocab_size]``: logits at each sequence's last new token
            (``meta.last_token_indices``); the LM head runs only on those rows.
        """
        hidden = self.forward_hidden(input_ids, positions, kv_cache, meta)
        return self.compute_logits(hidden[meta.last_token_indices])

    # ------------------------------------------------------------------ weights
    def _target(self, hf_name: str, params: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, str, int | None]:
        """Map a Hugging Face tensor name to ``(our parameter, its name, fused shard index)``."""
        top = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "lm_head.weight"}
        if hf_name in top:
            name, shard = top[hf_name], None
        else:
            m = _LAYER_RE.match(hf_name)
            if m is None or int(m.group(1)) >= self.config.num_layers:
                raise ValueError(f"unexpected tensor {hf_name!r} for a {self.config.num_layers}-layer "
                                 f"{self.config.architecture} model")
            idx, module, kind = m.groups()
            if module in _FUSED:
                module, shard = _FUSED[module]
            elif module in _PLAIN:
                shard = None
            else:
                raise ValueError(f"unexpected tensor {hf_name!r} (module {module!r} is not part of a "
                                 f"Llama-family layer)")
            name = f"layers.{idx}.{module}.{kind}"
        if name not in params:
            raise ValueError(f"tensor {hf_name!r} has no place in this model (config: qkv_bias="
                             f"{self.config.qkv_bias}, o_proj_bias={self.config.o_proj_bias}, "
                             f"mlp_bias={self.config.mlp_bias}, tied={self.config.tie_word_embeddings})")
        return params[name], name, shard

    def _shard_rows(self, name: str, shard: int | None, total: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of this rank's fused parameter ``name`` that fused part ``shard`` fills."""
        if shard is None:
            return 0, total
        sizes = [self.tp.local(n) for n in shard_layout(name, self.config).parts]
        start = sum(sizes[:shard])
        return start, start + sizes[shard]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...) into the
        model, casting to its dtype and device.  ``lm_head.weight`` is ignored when embeddings are
        tied; ``rotary_emb.inv_freq`` buffers of old checkpoints are ignored.  The tensors are the
        full model's; under tensor parallelism each is cut to this rank's shard on the host first.

        Raises:
            ValueError: an unknown tensor name or a shape mismatch (names both shapes).
        """
        params = dict(self.named_parameters())
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue
            param, name, shard = self._target(hf_name, params)
            start, end = self._shard_rows(name, shard, param.shape[0])
            expected = [end - start, *param.shape[1:]]
            layout = shard_layout(name, self.config)
            if layout is not None:          # this tensor is one whole (fused) part, cut by rank
                expected[layout.dim] = layout.parts[shard or 0]
                layout = ShardLayout(layout.dim, (expected[layout.dim],))
            if tuple(tensor.shape) != tuple(expected):
                raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(expected)} for this config")
            param[start:end].copy_(self.tp.shard(tensor, layout).to(device=param.device, dtype=param.dtype))
            self._loaded.add((name, shard))

    def missing_weights(self) -> list[str]:
        """Parameters (or fused shards) not yet filled by :meth:`load_weights`."""
        missing = []
        for name, _ in self.named_parameters():
            shards = [None] if not ("qkv_proj" in name or "gate_up_proj" in name) else (
                [0, 1, 2] if "qkv_proj" in name else [0, 1])
            missing += [f"{name}[{s}]" if s is not None else name
                        for s in shards if (name, s) not in self._loaded]
        return missing

    def set_rope_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the RoPE inverse frequencies by ``factors: float32 [head_dim // 2]`` (llama.cpp's
        ``rope_freqs`` tensor, the form in which GGUF files store Llama-3 rope scaling)."""
        if tuple(factors.shape) != tuple(self.inv_freq.shape):
            raise ValueError(f"rope_freqs has shape {tuple(factors.shape)}, expected "
                             f"{tuple(self.inv_freq.shape)}")
        self.inv_freq = rope_inv_freq(self.config, self.device) / factors.to(self.device, torch.float32)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> None:
        """Fill every parameter with seeded random values that keep activations finite in bf16
        for deep models: linear weights ``N(0, 1/fan_in)``, output projections (``o_proj``,
        ``down_proj``) further scaled by ``1/sqrt(2 * num_layers)`` (GPT-2's residual scaling),
        embeddings ``N(0, 0.02^2)`` (the usual ``initializer_range``), norms 1, biases small.
        Under tensor parallelism each full tensor is drawn as one process draws it and this rank's
        shard cut from it, so every tensor-parallel size gets the same model."""
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        depth_scale = (2 * self.config.num_layers) ** -0.5
        for name, p in self.named_parameters():
            layout = shard_layout(name, self.config) if self.tp.size > 1 else None
            full_shape = list(p.shape)
            if layout is not None:
                full_shape[layout.dim] = sum(layout.parts)
            full = p if layout is None else torch.empty(full_shape, device=p.device, dtype=p.dtype)
            if name.endswith("layernorm.weight") or name == "norm.weight":
                full.fill_(1.0)
            elif name.endswith(".bias"):
                full.normal_(0.0, 0.02, generator=gen)
            elif name == "embed_tokens.weight":
                full.normal_(0.0, 0.02, generator=gen)
            else:
                std = full_shape[1] ** -0.5
                if "o_proj" in name or "down_proj" in name:
                    std *= depth_scale
                full.normal_(0.0, std, generator=gen)
            if layout is not None:
                p.copy_(self.tp.shard(full, layout))
            self._loaded.update((name, s) for s in (None, 0, 1, 2))
