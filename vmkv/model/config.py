"""``ModelConfig``: the shape of a Llama-family decoder, read from a Hugging Face ``config.json`` or
from GGUF metadata, plus named random-weight shapes (``SHAPES``) for benchmarks.

Supported: Llama 2/3 (incl. Llama-3 rope scaling), Mistral, Qwen2 (q/k/v bias), SmolLM (Llama shape).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Sequence

import torch

from vmkv.kvcache.base import KVCacheSpec

logger = logging.getLogger(__name__)

__all__ = [
    "ModelConfig",
    "SHAPES",
    "SUPPORTED_HF_MODEL_TYPES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "UnsupportedModelError",
]

#: Hugging Face ``model_type`` values this decoder implements
SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: GGUF ``general.architecture`` values (llama.cpp stores Llama, Mistral and SmolLM as "llama")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
#: ``rope_scaling["rope_type"]`` values; ``None`` means plain RoPE
SUPPORTED_ROPE_TYPES = ("linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented (message says what is)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder (frozen; validated on construction).

    Args:
        vocab_size: rows of the embedding and of the LM head.
        hidden_size: model width.
        intermediate_size: SwiGLU hidden width.
        num_layers: decoder layers.
        num_heads: query heads; a multiple of ``num_kv_heads`` (GQA).
        num_kv_heads: key/value heads.
        head_dim: elements per head (usually ``hidden_size // num_heads``).
        max_position_embeddings: longest context the model was trained for (tokens).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base frequency.
        rope_scaling: ``None`` or ``{"rope_type": "linear", "factor": f}`` or ``{"rope_type": "llama3",
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        bos_token_id: beginning-of-sequence id or ``None``.
        eos_token_ids: every id that ends generation.
        architecture: ``"llama"``, ``"mistral"`` or ``"qwen2"``.
        qkv_bias: q/k/v projections have a bias (Qwen2; Llama with ``attention_bias``).
        o_proj_bias: the output projection has a bias (Llama with ``attention_bias``).
        mlp_bias: gate/up/down projections have a bias (Llama ``mlp_bias``).
    Raises:
        UnsupportedModelError (a ValueError): unknown architecture or rope type.
        ValueError: a size is not positive, or ``num_heads`` is not a multiple of ``num_kv_heads``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps and rope_theta must be > 0, got "
                             f"{self.rms_norm_eps}, {self.rope_theta}")
        if self.architecture not in SUPPORTED_HF_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_HF_MODEL_TYPES)}")
        object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    def __hash__(self) -> int:  # rope_scaling is a dict: hash a frozen copy of it
        rope = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        return hash(tuple(rope if f.name == "rope_scaling" else getattr(self, f.name)
                          for f in fields(self) if f.compare))

    # ------------------------------------------------------------------ derived
    @property
    def q_size(self) -> int:
        """Width of the query projection: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self.vocab_size * h + head + h

    def kv_spec(self, device: str | torch.device, dtype: torch.dtype) -> KVCacheSpec:
        """The :class:`KVCacheSpec` of this model's KV cache on ``device`` in ``dtype``."""
        return KVCacheSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, dtype=dtype, device=str(device))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any],
                       generation_config: Mapping[str, Any] | None = None) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x ``rope_theta`` /
        ``rope_scaling`` or 5.x ``rope_parameters``); EOS ids of ``generation_config.json`` are
        merged in (Llama-3 Instruct lists its end-of-turn ids only there).

        Raises:
            UnsupportedModelError: ``model_type`` not in :data:`SUPPORTED_HF_MODEL_TYPES`, or an
                unsupported rope type.
            ValueError: a required key is missing.
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_HF_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures {cfg.get('architectures')}); "
                f"supported: {', '.join(SUPPORTED_HF_MODEL_TYPES)}")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            intermediate = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope or rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = dict(cfg.get("rope_scaling") or {}) or rope
        if cfg.get("sliding_window") and (model_type == "mistral" or cfg.get("use_sliding_window")):
            logger.warning("sliding_window=%s is ignored: attention is full-context",
                           cfg.get("sliding_window"))
        eos: list[int] = []
        for source in (cfg, generation_config or {}):
            value = source.get("eos_token_id")
            for t in (value if isinstance(value, (list, tuple)) else [value]):
                if t is not None and int(t) not in eos:
                    eos.append(int(t))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos),
            architecture=model_type,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any],
                           tensor_shapes: Mapping[str, Sequence[int]]) -> "ModelConfig":
        """Build from GGUF key/value metadata (scalar values; keys follow llama.cpp's
        ``{arch}.block_count`` etc.) and the file's tensors, ``name -> shape`` in torch order
        (``output.weight`` absent means tied embeddings; ``attn_q.bias`` present means q/k/v bias;
        ``token_embd.weight`` rows give the vocabulary size when ``{arch}.vocab_size`` is absent).

        Raises:
            UnsupportedModelError: ``general.architecture`` not in :data:`SUPPORTED_GGUF_ARCHITECTURES`,
                or an unsupported rope scaling type (e.g. yarn).
            ValueError: a required key is missing.
        """
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; supported: "
                f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Llama 2/3, Mistral, SmolLM, Qwen2)")

        def get(key: str, default: Any = KeyError) -> Any:
            full = f"{arch}.{key}"
            if full in metadata:
                return metadata[full]
            if default is KeyError:
                raise ValueError(f"GGUF metadata lacks required key {full!r}")
            return default

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        names = set(tensor_shapes)
        if f"{arch}.vocab_size" in metadata:
            vocab = int(metadata[f"{arch}.vocab_size"])
        elif "token_embd.weight" in tensor_shapes:
            vocab = int(tensor_shapes["token_embd.weight"][0])
        else:
            raise ValueError(f"GGUF file has neither {arch}.vocab_size nor a token_embd.weight tensor")
        rope: dict | None = None
        scaling_type = get("rope.scaling.type", None)
        if scaling_type not in (None, "none"):
            if scaling_type != "linear":
                raise UnsupportedModelError(
                    f"unsupported GGUF rope scaling type {scaling_type!r}; supported: linear, and "
                    f"Llama-3 scaling stored as the rope_freqs tensor")
            rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif "rope_freqs.weight" in names:
            # llama.cpp bakes Llama-3 scaling into per-frequency divisors; the loader applies them
            rope = {"rope_type": "llama3_freq_factors"}
        eos = [metadata["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in metadata else []
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if key in metadata and int(metadata[key]) not in eos:
                eos.append(int(metadata[key]))
        has_bias = any(n.endswith("attn_q.bias") for n in names)
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads))),
            max_position_embeddings=int(get("context_length", 4096)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=(int(metadata["tokenizer.ggml.bos_token_id"])
                          if "tokenizer.ggml.bos_token_id" in metadata else None),
            eos_token_ids=tuple(int(t) for t in eos),
            architecture="qwen2" if arch == "qwen2" else "llama",
            qkv_bias=has_bias,
            o_proj_bias=any(n.endswith("attn_output.bias") for n in names),
            mlp_bias=any(n.endswith("ffn_up.bias") for n in names),
        )

    def with_overrides(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)


def _normalize_rope_scaling(rope: Mapping[str, Any] | None) -> dict | None:
    """Canonical form: ``None`` for plain RoPE, else a dict with ``rope_type`` and its parameters."""
    if not rope:
        return None
    rope = dict(rope)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None)
    rope.pop("type", None)
    rope.pop("rope_theta", None)
    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3_freq_factors":  # GGUF: factors come as a tensor at load time
        return {"rope_type": rope_type}
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_type {rope_type!r}; supported: default, "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "linear":
        if "factor" not in rope:
            raise ValueError("linear rope scaling needs 'factor'")
        return {"rope_type": "linear", "factor": float(rope["factor"])}
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {missing}; it needs {list(_LLAMA3_KEYS)}")
    return {"rope_type": "llama3", "factor": float(rope["factor"]),
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"])}


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

#: Named random-weight shapes (published configs of the real models; weights are random).
SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), architecture="llama"),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_ids=(151643, 151645), architecture="qwen2", qkv_bias=True),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        architecture="llama"),
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
        architecture="llama"),
}
