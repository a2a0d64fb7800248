"""Engine configuration: a chain of frozen dataclasses validated in ``__post_init__``.

``EngineConfig`` holds a ``CacheConfig`` (which KV backend and how much memory) and a
``SchedulerConfig`` (token budget per step, sequences per step, context length).  Nothing mutates
a config after construction; derived values live on the engine.  The CLI reads its defaults from
these classes (``vmkv generate --help``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vmkv.engine.reservation import check_reservation
from vmkv.kvcache.dtypes import AUTO_DTYPE, MODEL_DTYPES, dtype_names
from vmkv.kvcache.options import BackendOptions
from vmkv.kvcache.registry import BACKENDS, backend_options_class, option_backends, option_names, option_owner

__all__ = ["CacheConfig", "SchedulerConfig", "EngineConfig", "DEFAULT_CPU_KV_MEMORY_BYTES",
           "DEFAULT_MAX_MODEL_LEN", "DEFAULT_CUDA_PREFETCH_TOKENS", "ENGINE_DTYPES"]

#: KV budget on CPU when ``memory_bytes`` is not given (a fixed, modest amount)
DEFAULT_CPU_KV_MEMORY_BYTES = 256 * 1024 * 1024
#: context length when ``max_model_len`` is not given: ``min(model context, this)``
DEFAULT_MAX_MODEL_LEN = 4096
#: ``CacheConfig.prefetch_tokens`` on CUDA when not given
DEFAULT_CUDA_PREFETCH_TOKENS = 16

#: ``EngineConfig.dtype`` values (the ``--dtype`` choices): the names of the dtypes a model runs in
#: (:mod:`vmkv.kvcache.dtypes`, the one name list) and ``"auto"``
ENGINE_DTYPES = dtype_names(MODEL_DTYPES) + (AUTO_DTYPE,)


def _positive_int(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        none = " or None" if allow_none else ""
        raise ValueError(f"{owner}.{name} must be a positive int{none}, got {value!r}")


def _option_default(name: str):
    """The default of backend option ``name``, read from the options class that declares it."""
    return option_owner(name).field_default(name)


#: CacheConfig fields that are backend options: one per field of the backends' options classes
#: (:func:`vmkv.kvcache.registry.option_names`), which own their types, defaults, ranges and name lists
BACKEND_OPTION_FIELDS = option_names()


def _with_backend_options(cls: type) -> type:
    """Add one field per backend option (its annotation and default from the options class that
    declares it) to ``cls`` before ``@dataclass`` makes the fields."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for name in BACKEND_OPTION_FIELDS:
        annotations[name] = option_owner(name).field_type(name)
        setattr(cls, name, _option_default(name))
    cls.__annotations__ = annotations
    return cls


@dataclass(frozen=True)
@_with_backend_options
class CacheConfig:
    """Which KV backend and how much memory it gets, and the backends' options.

    Args:
        backend: ``"paged"`` (blocks + block tables) or ``"vmem"`` (virtual slot per sequence).
        memory_bytes: physical KV budget in bytes (``--kv-memory``); ``None``: 256 MiB on CPU, on CUDA
            ``gpu_memory_utilization`` of the free memory after the weights are loaded.  The paged
            backend allocates it all up front (a static pool); for vmem it is the cap that growth on
            demand stops at (pages are created when sequences need them and idle ones released).
        gpu_memory_utilization: fraction in (0, 1] of free GPU memory given to the KV cache.
        <option>: one field per backend option (``block_size``, ``page_size_bytes``, ``layout``, ...),
            named, typed and defaulted as the field of the backends' options class that declares it
            (``PagedOptions``, ``VMemOptions``: their docstrings say what each does);
            :data:`BACKEND_OPTION_FIELDS` lists them.
        prefetch_tokens: after enqueuing a step's forward, ask the cache to back this many
            positions past each sampling sequence's length (``KVCache.prefetch``; the vmem backend
            maps pages while the GPU computes); ``None``: 16 on CUDA, 0 on CPU (exact accounting).

    The backend options' defaults, ranges and name lists are the backends' options classes'
    (:func:`vmkv.kvcache.registry.backend_options_class`); :meth:`backend_options` builds the chosen
    backend's options object.  Options of the other backend are ignored, except those declared with
    ``refused_elsewhere`` (``attention_impl``): a value but the default is refused.
    Raises:
        ValueError: a field is out of range (the message names field, value and range).
    """

    backend: str = "paged"
    memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.5
    prefetch_tokens: int | None = None
    # + one field per backend option (_with_backend_options)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"CacheConfig.backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        _positive_int("CacheConfig", "memory_bytes", self.memory_bytes, allow_none=True)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {u!r}")
        for name in BACKEND_OPTION_FIELDS:   # each against the backend that owns it
            value = getattr(self, name)
            owners = option_backends(name)
            owner = self.backend if self.backend in owners else owners[0]
            backend_options_class(owner).check_field(name, value, owner="CacheConfig")
            if (option_owner(name).field_refused_elsewhere(name) and self.backend not in owners
                    and value != _option_default(name)):
                raise ValueError(
                    f"CacheConfig.{name}={value!r} is an option of the {' and '.join(owners)} backend, and "
                    f"the {self.backend} backend has no {name}; choose --backend {owners[0]} or leave "
                    f"{name} at {_option_default(name)!r}")
        p = self.prefetch_tokens
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 0):
            raise ValueError(f"CacheConfig.prefetch_tokens must be an int >= 0 or None, got {p!r}")

    def resolved_prefetch_tokens(self, device_type: str) -> int:
        """``prefetch_tokens``, with ``None`` resolved for a ``"cuda"`` or ``"cpu"`` device."""
        if self.prefetch_tokens is not None:
            return self.prefetch_tokens
        return DEFAULT_CUDA_PREFETCH_TOKENS if device_type == "cuda" else 0

    def backend_options(self) -> BackendOptions:
        """The chosen backend's options object (``PagedOptions``, ``VMemOptions``) for
        ``create_kv_cache(..., options=...)``: the fields it shares with this config, its defaults for
        the rest."""
        cls = backend_options_class(self.backend)
        return cls(**{n: getattr(self, n) for n in cls.field_names() if n in BACKEND_OPTION_FIELDS})


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling limits.

    Args:
        max_num_seqs: sequences running at once at most (also the vmem backend's slot count).
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: positions per sequence (prompt + output); ``None``:
            ``min(model context, 4096)``.
        enable_chunked_prefill: split a prompt longer than the step's remaining budget over steps;
            when off, ``max_num_batched_tokens`` must be ``>= max_model_len``.
        kv_reservation: static KV reservation at admission (:mod:`vmkv.engine.reservation`, the Orca
            baselines): ``"none"`` (grow on demand, preempt when full), ``"oracle"``, ``"pow2"`` or
            ``"max"`` (reserve ``min(prompt + estimated output, max_model_len)`` once, never grow,
            never preempt).
    Raises:
        ValueError: a field is out of range.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    kv_reservation: str = "none"

    def __post_init__(self) -> None:
        check_reservation(self.kv_reservation, "SchedulerConfig.kv_reservation")
        _positive_int("SchedulerConfig", "max_num_seqs", self.max_num_seqs)
        _positive_int("SchedulerConfig", "max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("SchedulerConfig", "max_model_len", self.max_model_len, allow_none=True)
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False; "
                "enable chunked prefill or raise the budget")


@dataclass(frozen=True)
class EngineConfig:
    """Everything :class:`vmkv.engine.llm_engine.LLMEngine` needs.

    Args:
        model: HF model directory or ``.gguf`` path; ``None``: the default model
            (SmolLM2-135M-Instruct Q4_1).  Ignored when ``random_weights`` is set.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; ``None``: CUDA when available, else CPU.
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` (or ``"auto"``/``None``: bf16 on CUDA,
            fp32 on CPU).
        cache, scheduler: see :class:`CacheConfig`, :class:`SchedulerConfig`.
        seed: seeds the sampler's shared generator (requests without their own seed).
        random_weights: a named random-weight shape (``"tiny"``, ``"smollm2-135m"``,
            ``"llama3-8b"``, ...) instead of a checkpoint, for benchmarks.
        enforce_eager: never capture CUDA graphs; every step runs eagerly (vLLM's
            ``--enforce-eager``).  Graphs are captured only on CUDA with the Triton kernels.
        cuda_graph_sizes: decode batch sizes to capture (vLLM's ``--cuda-graph-sizes``); ``None``:
            1, 2, 4 and every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself).
            A decode step of ``B`` sequences replays the smallest captured size ``>= B``; larger
            steps run eagerly.
        async_scheduling: launch the next decode step before this one's sampled tokens reach the host
            (vLLM's ``--async-scheduling``; :mod:`vmkv.engine.async_scheduling`): host work overlaps
            the device; outputs arrive one step later.  On by default (``--no-async-scheduling``).
        tensor_parallel_size: ranks the model is split over (vLLM's ``--tensor-parallel-size``): one
            process per rank (rank 0 is this one), the heads, intermediate size and vocabulary
            sharded, each rank's KV cache holding ``num_kv_heads / N`` heads; gloo on CPU, NCCL on
            CUDA (GPUs ``index .. index + N - 1`` of ``device``).  Steps then run eagerly.
    Raises:
        ValueError: a field is out of range.
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    random_weights: str | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    async_scheduling: bool = True
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _positive_int("EngineConfig", "tensor_parallel_size", self.tensor_parallel_size)
        for name in ("enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if (not isinstance(sizes, (tuple, list)) or not sizes
                    or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes)):
                raise ValueError(f"EngineConfig.cuda_graph_sizes must be a non-empty list of ints >= 1 "
                                 f"or None, got {sizes!r}")
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {list(ENGINE_DTYPES)} or None, "
                             f"got {self.dtype!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"EngineConfig.seed must be an int >= 0, got {self.seed!r}")
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"EngineConfig.cache must be a CacheConfig, got {type(self.cache).__name__}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(
                f"EngineConfig.scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")

    @classmethod
    def from_args(cls, model: str | None = None, kv_backend: str = "paged", device: str | None = None,
                  dtype: str | None = None, **knobs: Any) -> "EngineConfig":
        """Build a config from flat keyword knobs (fields of the three configs).

        Raises:
            TypeError: a knob that is no field of any config (the message lists the valid ones).
            ValueError: a value out of range.
        """
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)} - {"backend"}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
        engine_fields = {"seed", "random_weights", "enforce_eager", "cuda_graph_sizes", "async_scheduling",
                         "tensor_parallel_size"}
        unknown = set(knobs) - cache_fields - sched_fields - engine_fields
        if unknown:
            valid = sorted(cache_fields | sched_fields | engine_fields)
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; valid options: {valid}")
        cache = CacheConfig(backend=kv_backend, **{k: v for k, v in knobs.items() if k in cache_fields})
        sched = SchedulerConfig(**{k: v for k, v in knobs.items() if k in sched_fields})
        extra = {k: v for k, v in knobs.items() if k in engine_fields}
        return cls(model=model, device=device, dtype=dtype, cache=cache, scheduler=sched, **extra)
