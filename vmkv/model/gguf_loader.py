"""Reading llama.cpp GGUF files: metadata, dequantized tensors, tokenizer.

Tensors are dequantized on load with ``gguf.quants.dequantize`` (F32/F16/BF16, Q4_0, Q4_1, Q8_0,
K-quants ...), renamed to Hugging Face names and handed to
:meth:`vmkv.model.llama.LlamaForCausalLM.load_weights`.  llama.cpp's converter permutes the rows of
``attn_q`` / ``attn_k`` of ``llama``-architecture files (``LlamaModel.permute`` in
``convert_hf_to_gguf.py``: per head, interleaved rotary pairs instead of halves); we undo it exactly
as transformers' GGUF integration does (``LlamaTensorProcessor._reverse_permute_weights``).  Qwen2
files are not permuted.  The tokenizer and chat template come from the GGUF metadata through
``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=name)``; the converted tokenizer is cached
under ``$VMKV_CACHE_DIR/tokenizers`` (building it takes ~10 s for a 49k vocabulary).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from vmkv import envs
from vmkv.model.config import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["read_gguf", "gguf_weights", "load_gguf_tokenizer", "unpermute_rope_rows", "GGUFFile"]

# arrays longer than this (token lists, merges, scores) are not read into the metadata dict
_MAX_ARRAY_LEN = 256

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFFile:
    """An open GGUF file: ``reader`` (``gguf.GGUFReader``, memory-mapped), ``metadata`` (scalar
    key/values and short arrays), ``tensor_shapes`` (name -> shape in torch order)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from gguf import GGUFReader  # noqa: PLC0415  (heavy import, only when a GGUF is loaded)

        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise ValueError(f"cannot read GGUF file {str(self.path)!r}: {e}") from e
        self.metadata = {name: value for name, field in self.reader.fields.items()
                         if (value := _field_value(field)) is not _SKIP}
        # GGUF lists dims fastest-first; torch order is the reverse
        self.tensor_shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist()))
                              for t in self.reader.tensors}

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def config(self) -> ModelConfig:
        """The :class:`ModelConfig` from this file's metadata (raises UnsupportedModelError)."""
        return ModelConfig.from_gguf_metadata(self.metadata, self.tensor_shapes)

    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.model" in self.metadata


_SKIP = object()


def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType  # noqa: PLC0415

    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if kind == GGUFValueType.ARRAY:
        if len(field.data) > _MAX_ARRAY_LEN:
            return _SKIP
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[field.data[0]].tolist()[0]


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file (memory-mapped; tensors are read lazily).

    Raises:
        ValueError: not a readable GGUF file.
    """
    return GGUFFile(path)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp stores ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``; this
    returns the Hugging Face (rotate-half) row order.

    Args:
        w: ``[rows, cols]`` weight or ``[rows]`` bias, ``rows = n_head * head_dim``.
        n_head: query heads for ``attn_q``, KV heads for ``attn_k``.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows over {n_head} heads (needs a multiple of "
                         f"{2 * n_head})")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(gf: GGUFFile, config: ModelConfig,
                 progress: Callable[[int, int], None] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, float32 tensor)`` for every tensor of ``gf``, dequantized and
    with Q/K rows un-permuted for ``llama`` files; ``rope_freqs.weight`` is yielded under its own name.

    Args:
        progress: called as ``progress(done, total)`` after each tensor.
    Raises:
        ValueError: a tensor name outside the Llama-family layout (names the tensor).
    """
    from gguf.quants import dequantize  # noqa: PLC0415

    permuted = gf.architecture == "llama"
    tensors = gf.reader.tensors
    for i, t in enumerate(tensors):
        name = t.name
        if name == "rope_freqs.weight":
            hf_name = name
        elif name in _TOP:
            hf_name = _TOP[name]
        else:
            m = _BLOCK_RE.match(name)
            if m is None or m.group(2) not in _BLOCK:
                raise ValueError(f"GGUF tensor {name!r} is not part of a supported Llama-family "
                                 f"layout (expected token_embd, output_norm, output, rope_freqs, "
                                 f"blk.N.{{{','.join(_BLOCK)}}})")
            hf_name = f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(gf.tensor_shapes[name])
        if permuted and ".attn_q." in name:
            w = unpermute_rope_rows(w, config.num_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_rope_rows(w, config.num_kv_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):  # memory-mapped F32 tensors
            w = np.array(w, dtype=np.float32, order="C")
        yield hf_name, torch.from_numpy(w)
        if progress is not None:
            progress(i + 1, len(tensors))


def _tokenizer_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return envs.cache_dir() / "tokenizers" / f"{path.stem}-{key}"


def _align_special_tokens(tokenizer, metadata) -> None:
    """Make the tokenizer's BOS/EOS tokens the ones the GGUF metadata names by id.

    transformers versions differ in which special token they pick when converting a GGUF vocabulary
    (seen: 5.17 chose ``<|im_start|>`` as EOS where 5.24 chose ``<|im_end|>``); the file's ids win.
    """
    for kind in ("bos", "eos"):
        key = f"tokenizer.ggml.{kind}_token_id"
        if key not in metadata:
            continue
        token_id = int(metadata[key])
        if not 0 <= token_id < len(tokenizer):
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, f"{kind}_token") != token:
            setattr(tokenizer, f"{kind}_token", token)


def load_gguf_tokenizer(gf: GGUFFile):
    """The tokenizer (with chat template when the file has one) of a GGUF file, or ``None`` when the
    file carries no tokenizer metadata.  Converted once through transformers and cached (keyed by
    path, size and mtime) under ``$VMKV_CACHE_DIR/tokenizers``.

    Raises:
        ValueError: the file has tokenizer metadata that transformers cannot convert.
    """
    if not gf.has_tokenizer():
        logger.warning("%s has no tokenizer metadata; tokenizer is None (pass token ids)", gf.path)
        return None
    from transformers import AutoTokenizer  # noqa: PLC0415

    cached = _tokenizer_cache_dir(gf.path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # noqa: BLE001  (corrupt cache: rebuild it below)
            logger.warning("cached tokenizer %s unusable (%s); rebuilding", cached, e)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"transformers could not build the tokenizer of {str(gf.path)!r}: {e}") from e
    _align_special_tokens(tokenizer, gf.metadata)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        if cached.exists():
            shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except OSError as e:  # a read-only cache only costs time next load
        logger.warning("could not cache tokenizer in %s: %s", cached, e)
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
