"""``vmkv compare step``: the engine's decode step against its bandwidth floor, on every backend in one run.

For each backend of ``--backends`` (each in a fresh ``python -m vmkv.compare.step_worker`` process, so it
starts from an empty device) and each grid point ``(B, L)`` of ``--batch-sizes`` x ``--context-lens``: ``B``
requests of ``L`` random prompt ids run to the end of their prefill, then ``--steps`` decode-only
``engine.step()`` calls are timed back to back, as a serving loop makes them (after ``--warmup-steps``; a
step's time is the interval between two returns of ``engine.step()``, so ``--async-scheduling``'s overlap
counts; every step checked to give each request exactly one token, and the window to carry ``B`` decode
tokens per step and no prompt token: ``step_worker``'s docstring).  Per point: the step time (median, p10, p90), the floor
``(weight bytes + KV bytes read) / read bandwidth`` (the bandwidth measured in the same worker: a ``sum``
over 4 GiB on CUDA, 64 MiB on CPU, best of 10), floor/step, the GPU-busy share (``torch.profiler``, CUDA
activity: kernel time / wall time over ``--profile-steps`` further decode steps; CUDA only) and the output
tokens/s, with vmem/paged tok/s.  Writes ``step_bench.json`` (environment, command, every point and every
timed step) and ``step_bench.md`` under ``--out``; ``raw/`` keeps each worker's config, result and log.

The model has random weights of a named shape (``--model llama3-8b``; ``tiny`` runs on CPU in seconds).
Backend options and ``--enforce-eager`` / ``--cuda-graph-sizes`` go to the engine as in ``vmkv compare
engine``.  The KV budget (``--kv-memory``) defaults to what the largest point needs plus 20%, the same on
every backend.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from vmkv.compare import report
from vmkv.compare.engine_bench import OPTION_FLAGS, backend_knobs, check_backends
from vmkv.compare.shapes import SHAPES, get_shape
from vmkv.compare.step_worker import max_tokens_for
from vmkv.compare.worker_proc import run_worker_process
from vmkv.engine.args import add_graph_args, parse_size
from vmkv.engine.option_args import add_backend_option_args
from vmkv.engine.config import ENGINE_DTYPES
from vmkv.kvcache.registry import option_backends

__all__ = ["add_arguments", "run", "parse_grid", "plan", "render_markdown", "COLUMNS", "DEFAULT_CONTEXT_LENS",
           "default_context_lens"]

#: ``--context-lens`` when none is given (longer than a small model's context: then shortened, see plan)
DEFAULT_CONTEXT_LENS = (1024, 2048)

COLUMNS = ["backend", "B", "L", "step ms (p10-p90)", "floor ms", "floor/step", "GPU-busy %", "tok/s",
           "vmem/paged tok/s"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to measure")
    g.add_argument("--backends", default="paged,vmem", help="comma-separated KV backends (default: %(default)s)")
    g.add_argument("--model", default="llama3-8b", help=f"random-weight shape: {', '.join(SHAPES)} "
                   "(default: %(default)s)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=ENGINE_DTYPES,
                   help="model and KV dtype (default: auto, bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--batch-sizes", default="1,64,256", help="comma-separated B (default: %(default)s)")
    g.add_argument("--context-lens", default=None,
                   help="comma-separated L, prompt tokens (default: "
                        f"{','.join(map(str, DEFAULT_CONTEXT_LENS))}, each shortened to what the model's "
                        "context holds with the decode steps)")
    g.add_argument("--steps", type=int, default=20, help="timed decode steps per point (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=3, help="decode steps before timing (default: %(default)s)")
    g.add_argument("--profile-steps", type=int, default=5,
                   help="CUDA: further decode steps under torch.profiler for the GPU-busy share (0: skip)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="token budget per step (prefill speed only; decode steps carry B tokens)")
    e.add_argument("--kv-memory", type=parse_size, default=None, metavar="SIZE",
                   help="KV budget of every backend (default: the largest point's KV + 20%%)")
    add_backend_option_args(e, flags=OPTION_FLAGS, skip=("enable_prefix_caching",),
                            refused_note="; given to the backends that have the option")
    e.add_argument("--no-prefix-caching", action="store_true")
    add_graph_args(e)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="result directory (default ./vmkv-results/step-<UTC time>)")
    o.add_argument("--timeout-s", type=float, default=1800, help="per backend")
    o.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads in the workers")


def parse_grid(text: str, flag: str) -> list[int]:
    """``"1,64,256"`` -> ``[1, 64, 256]`` (order kept, duplicates dropped).  Raises ValueError naming the
    flag, the value and what is allowed."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not an integer; give positive integers separated by "
                             f"commas, e.g. {flag} 1,64,256") from None
        if value < 1:
            raise ValueError(f"{flag}: {value} must be >= 1")
        if value not in out:
            out.append(value)
    if not out:
        raise ValueError(f"{flag} is empty; give positive integers separated by commas, e.g. {flag} 1,64,256")
    return out


def plan(args) -> dict:
    """Validate the command line and derive the run: backends, points, ``max_model_len``, KV budget, the
    engine knobs of each backend.  Raises ValueError with a message that names the flag and the fix."""
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        raise ValueError("--backends is empty; e.g. --backends paged,vmem")
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends {args.backends!r} lists a backend twice (each runs once, its raw "
                         f"files named after it); e.g. --backends paged,vmem")
    if not args.timeout_s > 0:
        raise ValueError(f"--timeout-s must be > 0 seconds, got {args.timeout_s}")
    check_backends(args, backends)
    if args.model not in SHAPES:
        raise ValueError(f"--model {args.model!r} is not a random-weight shape; choose one of {sorted(SHAPES)}")
    shape = get_shape(args.model)
    batches = parse_grid(args.batch_sizes, "--batch-sizes")
    contexts = None if args.context_lens is None else parse_grid(args.context_lens, "--context-lens")
    for flag, value, low in (("--steps", args.steps, 1), ("--warmup-steps", args.warmup_steps, 0),
                             ("--profile-steps", args.profile_steps, 0), ("--seed", args.seed, 0)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    budget = args.max_num_batched_tokens
    if budget <= max(batches):
        raise ValueError(f"--max-num-batched-tokens {budget} must exceed the largest batch size {max(batches)} "
                         "(a step holds every decode token and some prefill); raise it")
    num_decode = args.warmup_steps + args.steps + args.profile_steps
    if contexts is None:
        contexts = default_context_lens(shape.max_model_len, batches, budget, num_decode)
    need = {(b, c): c + max_tokens_for(b, c, budget, num_decode) for b in batches for c in contexts}
    max_model_len = int(math.ceil(max(need.values()) / 16) * 16)
    if max_model_len > shape.max_model_len:
        worst = max(need, key=need.get)
        raise ValueError(f"--context-lens {max(contexts)} needs {need[worst]} positions per sequence "
                         f"(prompt + decode steps) at B={worst[0]}, more than {args.model}'s context of "
                         f"{shape.max_model_len}; use context lengths up to "
                         f"{shape.max_model_len - (need[worst] - worst[1]) - 16}")
    spec = shape.spec(_kv_dtype(args))
    kv_need = max(spec.kv_bytes(b * int(math.ceil(n / 16) * 16)) for (b, _), n in need.items())
    memory_bytes = args.kv_memory or int(kv_need * 1.2) + (64 << 20)
    knobs = {}
    for backend in backends:
        k = {"max_num_seqs": max(batches), "max_num_batched_tokens": budget, "max_model_len": max_model_len,
             "seed": args.seed, "random_weights": args.model, "memory_bytes": memory_bytes,
             "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling,
             "cuda_graph_sizes": tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None}
        k.update({o: v for o, v in backend_knobs(args).items() if backend in option_backends(o)})
        knobs[backend] = k
    return {"backends": backends, "batch_sizes": batches, "context_lens": contexts,
            "points": [[b, c] for c in contexts for b in batches], "max_model_len": max_model_len,
            "memory_bytes": memory_bytes, "knobs": knobs}


def default_context_lens(model_len: int, batches: list[int], budget: int, num_decode: int) -> list[int]:
    """:data:`DEFAULT_CONTEXT_LENS`, each one that would not fit a model of ``model_len`` positions with the
    decode steps of its largest batch (``max_tokens_for``) lowered to the longest that does (a multiple of 16,
    within the ``max_model_len`` rounded up to 16 that :func:`plan` derives), duplicates dropped."""
    out: list[int] = []
    for c in DEFAULT_CONTEXT_LENS:
        while c > 16 and int(math.ceil(max(c + max_tokens_for(b, c, budget, num_decode)
                                           for b in batches) / 16) * 16) > model_len:
            c -= 16
        if c not in out:
            out.append(c)
    return out


def _kv_dtype(args) -> str:
    """The dtype the engine will run in (``auto``: bf16 on CUDA, fp32 on CPU), for the KV budget."""
    if args.dtype not in (None, "auto"):
        return args.dtype
    import torch

    cuda = torch.cuda.is_available() if args.device is None else str(args.device).startswith("cuda")
    return "bf16" if cuda else "fp32"


def _run_worker(cfg: dict, out_dir: Path, timeout_s: float, threads: int | None, say) -> dict:
    def on_event(ev: dict) -> None:
        if ev.get("event") == "point":
            say(f"  {cfg['backend']} B={ev['batch']} L={ev['context']}: {ev['step_ms']:.2f} ms/step")
        elif ev.get("event") == "loaded":
            say(f"  {cfg['backend']}: engine built in {ev['load_s']:.1f} s")

    return run_worker_process("vmkv.compare.step_worker", cfg, out_dir, f"step-{cfg['backend']}", timeout_s,
                              threads, on_event, {"backend": cfg["backend"], "points": []})


def _error_line(error: str) -> str:
    """The line of an error that says what went wrong: the exception (a worker's log tail ends with
    it), not the first line of its traceback."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0].split(':')[0]}: {lines[-1]}"


def _ratios(points: list[dict]) -> None:
    """``vmem_over_paged_tok_s`` on each vmem point that has a paged twin."""
    paged = {(p["batch"], p["context"]): p for p in points if p["backend"] == "paged" and "step_ms" in p}
    for p in points:
        twin = paged.get((p["batch"], p["context"]))
        if p["backend"] == "vmem" and twin and "output_tok_s" in p:
            p["vmem_over_paged_tok_s"] = p["output_tok_s"] / twin["output_tok_s"]


def _cells(p: dict) -> list[str]:
    if "error" in p:
        return [p["backend"], str(p["batch"]), str(p["context"]), "error: " + _error_line(p["error"])[:60],
                "-", "-", "-", "-", "-"]
    busy = p.get("gpu_busy_pct")
    ratio = p.get("vmem_over_paged_tok_s")
    return [p["backend"], str(p["batch"]), str(p["context"]),
            f"{p['step_ms']:.2f} ({p['step_ms_p10']:.2f}-{p['step_ms_p90']:.2f})", f"{p['floor_ms']:.2f}",
            f"{p['floor_over_step']:.3f}", "-" if busy is None else f"{busy:.1f}", f"{p['output_tok_s']:,.0f}",
            "-" if ratio is None else f"{ratio:.3f}"]


def render_markdown(result: dict) -> str:
    """``step_bench.md``: the command, the environment, each backend's bandwidth and weights, the table."""
    env = result["environment"]
    lines = ["# vmkv compare step", "", f"Command: `{env['command']}`", "",
             f"Commit {env.get('git_commit')}, torch {env['torch']}, triton {env.get('triton')}, "
             f"device {result.get('device_name') or env.get('cpu')}", ""]
    for b, w in result["workers"].items():
        if "error" in w and not w.get("read_bandwidth"):
            lines.append(f"- {b}: error: {_error_line(w['error'])}")
            continue
        bw = w["read_bandwidth"]
        sizes = w["cuda_graph_sizes"] or "default"
        graphs = "--enforce-eager" if w["enforce_eager"] else f"CUDA graphs allowed (sizes {sizes})"
        lines.append(f"- {b}: read bandwidth {bw['bytes_per_s'] / 1e9:,.1f} GB/s ({bw['method']}, "
                     f"{report.fmt_bytes(bw['buffer_bytes'])}), weights {w['weight_bytes'] / 1e9:.4g} GB, "
                     f"KV {w['kv_bytes_per_token'] / 1024:g} KiB/token, {graphs}, "
                     f"engine built in {w['load_s']:.1f} s")
    lines += ["", "floor = (weight bytes + KV bytes read) / read bandwidth; floor/step = floor / median step; "
              "GPU-busy % = device kernel time / wall time (torch.profiler, CUDA only); vmem/paged on tok/s.", ""]
    lines.append(report.markdown_table(COLUMNS, [_cells(p) for p in result["points"]]))
    return "\n".join(lines) + "\n"


def _write(out_dir: Path, env: dict, args, cfg: dict, workers: dict, points: list[dict]) -> dict:
    """Write ``step_bench.json`` and ``step_bench.md`` for the backends run so far; returns the result."""
    _ratios(points)
    device_name = next((w.get("device_name") for w in workers.values() if w.get("device_name")), None)
    result = {"kind": "step", "environment": env, "command": env["command"], "args": vars(args),
              "device_name": device_name, "plan": cfg, "workers": workers, "points": points}
    report.write_json(out_dir / "step_bench.json", result)
    (out_dir / "step_bench.md").write_text(render_markdown(result))
    return result


def run(args) -> int:
    console = report.console()
    try:
        cfg = plan(args)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    out_dir = report.results_dir(args.out, "step")
    env = report.environment(seed=args.seed)
    workers: dict[str, dict] = {}
    points: list[dict] = []
    for backend in cfg["backends"]:
        console.print(f"{backend}: {len(cfg['points'])} points")
        wcfg = {"backend": backend, "device": args.device, "dtype": args.dtype, "knobs": cfg["knobs"][backend],
                "points": cfg["points"], "seed": args.seed, "steps": args.steps, "warmup_steps": args.warmup_steps,
                "profile_steps": args.profile_steps, "temperature": args.temperature,
                "max_num_batched_tokens": args.max_num_batched_tokens, "torch_threads": args.torch_threads}
        res = _run_worker(wcfg, out_dir, args.timeout_s, args.torch_threads, console.print)
        if "error" in res:
            console.print(f"[red]{backend} failed:[/red] {res['error']}")
        points += [{"backend": backend, **p} for p in res["points"]]
        workers[backend] = {k: v for k, v in res.items() if k != "points"}
        _write(out_dir, env, args, cfg, workers, points)   # after every backend: a cut run keeps its part
    console.print(report.make_table("decode step vs floor", COLUMNS, [_cells(p) for p in points]))
    console.print(f"results in {out_dir}")
    failed = any("error" in w for w in workers.values()) or any("error" in p for p in points)
    return 1 if failed else 0
