"""Engine command-line options shared by ``vmkv serve`` and ``vmkv generate``.

    parser = argparse.ArgumentParser()
    add_engine_args(parser)                       # --model, --backend, ..., --seed, --threads
    args = parser.parse_args(argv)
    apply_threads(args)
    engine = LLMEngine.from_args(**engine_kwargs(args))

Flag names follow vLLM's ``EngineArgs`` where the knob exists there (``--max-num-seqs``,
``--max-num-batched-tokens``, ``--max-model-len``, ``--gpu-memory-utilization``, ``--block-size``,
``--enable-prefix-caching/--no-enable-prefix-caching``, ``--enable-chunked-prefill/...``, ``--seed``
as the engine seed).  Defaults are read from the frozen config dataclasses in
:mod:`vmkv.engine.config`, and the backend options' flags are derived from the backends' options
classes (:mod:`vmkv.engine.option_args`), so the CLI and the Python API cannot drift apart; range checks stay in
the dataclasses' ``__post_init__`` (the CLIs report their ``ValueError`` and exit with status 2).

Importing this module imports :mod:`vmkv.engine.config` (and with it the KV-cache registry), so
``vmkv/cli.py`` imports it only for the subcommand being run.
"""

from __future__ import annotations

import argparse
from typing import Any

from vmkv.engine.config import ENGINE_DTYPES, CacheConfig, EngineConfig, SchedulerConfig
from vmkv.engine.option_args import (add_backend_option_args, add_option_arg, backend_option_values,
                                     option_choices, option_help)
from vmkv.engine.reservation import KV_RESERVATIONS
from vmkv.kvcache.registry import backend_choices
from vmkv.kvcache.sizes import parse_size, size_or_zero

__all__ = ["parse_size", "size_or_zero", "add_engine_args", "engine_kwargs", "apply_threads", "option_choices",
           "option_help", "add_backend_option_args"]

def positive_int(text: str) -> int:
    """An integer >= 1, for ``argparse`` ``type=``.  Raises argparse.ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine options to ``parser`` in two groups: "model" (``--model --backend --device
    --dtype --random-weights --seed --threads --enforce-eager --cuda-graph-sizes
    --tensor-parallel-size``) and "KV cache and scheduler" (``--max-num-seqs
    --max-num-batched-tokens --max-model-len --kv-memory (alias --memory-bytes) |
    --gpu-memory-utilization --block-size --page-size-bytes --layout --driver --attention-impl
    --lookahead-tokens --[no-]preallocate --kv-reserve --kv-shrink-grace-s
    --[no-]enable-prefix-caching --[no-]enable-chunked-prefill --kv-reservation``).

    Defaults come from :class:`EngineConfig`, :class:`CacheConfig` and :class:`SchedulerConfig`; the
    backend options' flags (one per field of the backends' options classes: name, parser, choices,
    help, default) from :mod:`vmkv.engine.option_args`.
    ``--no-prefix-caching`` and ``--no-chunked-prefill`` are accepted as hidden aliases of the
    ``--no-enable-...`` flags.  ``--kv-memory`` and ``--gpu-memory-utilization`` are mutually
    exclusive.  ``--kv-memory`` is the documented name of the one KV budget (``memory_bytes``; vLLM-style
    naming): the vmem cap, the paged static pool; ``--memory-bytes`` stays as its alias.  ``--threads`` is no engine field: call :func:`apply_threads` before loading.
    """
    ec, cc, sc = EngineConfig(), CacheConfig(), SchedulerConfig()
    g = parser.add_argument_group("model")
    g.add_argument("--model", "-m", default=ec.model,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--backend", choices=backend_choices(), default=cc.backend,
                   help="KV-cache backend (default: %(default)s)")
    g.add_argument("--device", default=ec.device, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=ec.dtype, choices=ENGINE_DTYPES,
                   help="model and KV dtype (default: auto, bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--random-weights", default=ec.random_weights, metavar="SHAPE",
                   help="seeded random weights of a named shape (tiny, smollm2-135m, llama3-8b, ...) "
                        "instead of a checkpoint; such a model has no tokenizer")
    g.add_argument("--seed", type=int, default=ec.seed,
                   help="engine seed: random weights and the sampler's shared generator "
                        "(default: %(default)s)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op CPU threads (default: torch's own; 1 is fastest on a busy machine)")
    add_graph_args(g)
    add_parallel_args(g)

    g = parser.add_argument_group("KV cache and scheduler")
    g.add_argument("--max-num-seqs", type=int, default=sc.max_num_seqs,
                   help="sequences running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=sc.max_num_batched_tokens,
                   help="token budget per step (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=sc.max_model_len,
                   help="context length, prompt + output (default: min(model context, 4096))")
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--kv-memory", "--memory-bytes", dest="memory_bytes", type=parse_size,
                     default=cc.memory_bytes, metavar="SIZE",
                     help="KV memory, e.g. 512MiB: vmem's cap (pages created on demand up to it, idle "
                          "ones released, see --kv-reserve); paged allocates it all up front as a "
                          "static pool (default: 256 MiB on CPU, --gpu-memory-utilization of free "
                          "memory on CUDA; either capped at what max_num_seqs x max_model_len tokens need)")
    mem.add_argument("--gpu-memory-utilization", type=float, default=cc.gpu_memory_utilization,
                     help="fraction of free GPU memory for KV (default: %(default)s)")
    add_backend_option_args(g, skip=("enable_prefix_caching",))
    add_option_arg(g, "enable_prefix_caching")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=sc.enable_chunked_prefill,
                   help="split long prompts over steps (default: %(default)s)")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_reservation_arg(g)


def add_reservation_arg(g) -> None:
    """``--kv-reservation {none,oracle,pow2,max}`` (serve, generate; :mod:`vmkv.engine.reservation`)."""
    g.add_argument("--kv-reservation", choices=KV_RESERVATIONS, default=SchedulerConfig().kv_reservation,
                   help="static KV reservation at admission, the Orca baselines: reserve min(prompt + "
                        "estimated output, max_model_len) tokens once, never grow, never preempt; the "
                        "estimate is max_tokens (oracle), its next power of two (pow2) or max_model_len "
                        "(max); none grows on demand (default: %(default)s)")


def add_graph_args(g) -> None:
    """``--enforce-eager``, ``--cuda-graph-sizes`` and ``--async-scheduling`` (vLLM's names; serve,
    generate, compare engine, compare step)."""
    g.add_argument("--enforce-eager", action="store_true", default=EngineConfig().enforce_eager,
                   help="never capture CUDA graphs; run every step eagerly (default: decode steps "
                        "replay graphs captured at start-up on CUDA)")
    g.add_argument("--cuda-graph-sizes", type=positive_int, nargs="+", default=None, metavar="B",
                   help="decode batch sizes to capture (default: 1 2 4 8 16 ... up to --max-num-seqs)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=EngineConfig().async_scheduling,
                   help="launch the next decode step before this one's tokens reach the host (host work "
                        "overlaps the device; outputs one step later; default: on, --no-async-scheduling "
                        "turns it off)")


def add_parallel_args(g) -> None:
    """``--tensor-parallel-size`` / ``-tp`` (vLLM's name; serve, generate, compare engine)."""
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int,
                   default=EngineConfig().tensor_parallel_size, metavar="N",
                   help="split the model over N ranks, one process each (gloo on CPU, NCCL on GPUs "
                        "index..index+N-1 of --device); runs eagerly (default: %(default)s)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``LLMEngine.from_args`` / ``EngineConfig.from_args`` from options
    added by :func:`add_engine_args` (``--threads`` is not among them; see :func:`apply_threads`)."""
    return dict(
        model=args.model, kv_backend=args.backend, device=args.device, dtype=args.dtype,
        seed=args.seed, random_weights=args.random_weights, enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes, async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        memory_bytes=args.memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_chunked_prefill=args.enable_chunked_prefill, kv_reservation=args.kv_reservation,
        **backend_option_values(args),     # one per backend option (vmkv.engine.option_args)
    )


def apply_threads(args: argparse.Namespace) -> None:
    """``torch.set_num_threads(args.threads)`` when ``--threads`` was given; otherwise leaves
    torch's thread count as it is."""
    if getattr(args, "threads", None) is not None:
        import torch  # noqa: PLC0415  (heavy; only when the option is used)

        torch.set_num_threads(args.threads)
