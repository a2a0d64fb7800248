"""``vmkv compare engine``: the same engine and seeded workload on both KV backends, head to head.

Every (scenario, backend) pair runs in a fresh ``python -m vmkv.compare.engine_worker`` process so its
memory is measured from an empty device; scenarios are the offline run (``--request-rate inf``, all
requests at t=0) and one online run per finite rate (Poisson, or gamma with ``--burstiness``).  A
rate written ``0.5x`` is a fraction of the offline request throughput of the first backend (measured
in the same invocation, or read from ``--reference results.json``).  Backends alternate within a
scenario so drift hits both alike.  Output: rich tables (absolute figures and vmem/paged ratios),
``results.json`` (environment, arguments, every run's summary), ``raw/<scenario>-<backend>.json``
(every request's token times and every step's KV sample), ``summary.md`` and PNG plots.

``--memory-gib 2,8,32`` (or ``--kv-memory 2GiB,8GiB``) sweeps the KV budget in the same invocation: every
design runs at every budget and every rate (budgets outermost), each run records its budget
(``kv_budget_bytes``, ``budget``; scenarios are named ``offline-2GiB``, ``rate-4-2GiB`` when there are several
budgets), and ``results["budget_table"]`` (:func:`engine_report.budget_table`) gives per budget and design
the offline output tok/s and the sustained rate as ratios to ``--reference-design``, each static design
against its backend without a reservation, and the measured reason where static >= paged.

With finite rates the comparison is an online sweep (``results["sweep"]``, :func:`engine_report.sweep`):
per design and rate the normalized latency (the PagedAttention paper's Fig. 12), TTFT/TPOT p50/p99,
goodput and SLO attainment, the highest rate each design sustains within ``--slo`` and its ratio to
``--reference-design``; plots of normalized latency vs rate, batch size over time (Fig. 13) and the KV
memory breakdown over time (Fig. 2) per design.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from vmkv.compare import report
from vmkv.compare.engine_report import budget_label
from vmkv.compare.metrics import NORM_LATENCY_BOUND_FACTOR, SLO_ATTAINMENT_MIN
from vmkv.compare.shapes import SHAPES
from vmkv.compare.worker_proc import run_worker_process
from vmkv.compare.workloads import WORKLOAD_KINDS, LengthDist, WorkloadSpec, generate, trace_note, trace_rows

from vmkv.engine.args import add_graph_args, add_parallel_args, parse_size
from vmkv.engine.config import DEFAULT_MAX_MODEL_LEN, ENGINE_DTYPES, CacheConfig
from vmkv.engine.option_args import add_backend_option_args, backend_option_values, option_flag
from vmkv.engine.reservation import check_reservation, design_label, design_options, parse_design
from vmkv.kvcache.registry import backend_choices, backend_options_class, option_backends, option_names

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "run", "parse_rates", "parse_budgets", "scenario_name", "backend_knobs", "check_backends", "worker_config",
           "Plan", "plan", "resolve_rate"]


def add_arguments(p: argparse.ArgumentParser, sweep: bool = True) -> None:
    """The comparison's flags (``sweep``: with the online sweep's ``--slo-attainment`` and
    ``--reference-design``, which ``vmkv compare serve`` does not report)."""
    g = p.add_argument_group("what to compare")
    g.add_argument("--backends", default="paged,vmem",
                   help="comma-separated KV designs: a backend (paged, vmem) or a backend with a static "
                        "reservation policy, e.g. paged+max (Orca Max on paged blocks), vmem+oracle; a variant "
                        "sets backend options of its own after @, e.g. vmem@kv_shrink_grace_s=inf")
    g.add_argument("--kv-reservations", default="none",
                   help="comma-separated static KV reservation policies (none, oracle, pow2, max: serve's "
                        "--kv-reservation) each --backends entry without a +policy runs with, e.g. "
                        "--backends paged,vmem --kv-reservations none,oracle,max: every design in one run "
                        "(default: none)")
    g.add_argument("--model", default=None, help="checkpoint path (HF dir or .gguf), or a random-weight shape "
                   f"({', '.join(SHAPES)}); default: the default model (SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=ENGINE_DTYPES,
                   help="model and KV dtype (default: auto, bf16 on CUDA, fp32 on CPU)")
    w = p.add_argument_group("workload (seeded; identical on every backend)")
    w.add_argument("--workload", "--trace", default="random", choices=WORKLOAD_KINDS,
                   help="random, shared-prefix, parallel: synthetic (--input-len/--output-len, Poisson/gamma "
                        "arrivals); azure-conv, azure-code: the Azure LLM inference trace 2023 replayed, its "
                        "first --num-requests rows (lengths and arrival times from the trace; --input-len, "
                        "--output-len and --burstiness unused; rows capped to prompt + output <= "
                        "--max-model-len)")
    w.add_argument("--num-requests", type=int, default=16, help="requests (a trace: its first N rows)")
    w.add_argument("--input-len", default="128", help="N, A..B (uniform), lognormal:MEDIAN,SIGMA[,MIN,MAX], sharegpt-in")
    w.add_argument("--output-len", default="64", help="same forms as --input-len (exact: ignore_eos)")
    w.add_argument("--request-rate", default="inf", help="comma-separated req/s; inf = offline; 0.5x = fraction "
                   "of the first backend's offline req/s (e.g. inf,0.3x,0.6x,0.9x); a trace workload: its "
                   "timestamps time-scaled so the rows' mean rate is R req/s (inf: every row at t=0)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    w.add_argument("--shared-prefix-len", type=int, default=0, help="shared-prefix: tokens of each system prompt")
    w.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts")
    w.add_argument("--n", type=int, default=1, help="parallel: samples per request")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=1.0)
    w.add_argument("--warmup-requests", type=int, default=2, help="requests run before measuring (JIT, first touch)")
    w.add_argument("--warmup-fill-budget", action="store_true",
                   help="the warm-up's first prompts are as long as the longest measured one and as many as "
                        "fill one step's --max-num-batched-tokens (vLLM's start-up profile run also runs the "
                        "full token budget): activation memory and GEMM configurations at that size are "
                        "paid before the measured run")
    w.add_argument("--slo", default=None, help="goodput SLO in ms, e.g. ttft:1000,tpot:100")
    if sweep:
        w.add_argument("--slo-attainment", type=float, default=SLO_ATTAINMENT_MIN,
                       help="an online sweep's sustained rate: the highest swept rate (every lower one too) at "
                            "which at least this fraction of the requests meets --slo and the normalized latency "
                            f"stays within {NORM_LATENCY_BOUND_FACTOR:g}x the design's lowest (default "
                            f"{SLO_ATTAINMENT_MIN})")
        w.add_argument("--reference-design", default=None, metavar="DESIGN",
                       help="the design the sweep's sustained rates are divided by (default: the first +max "
                            "design, e.g. paged+max, else the first design)")
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=None,
                   help="default: the workload's longest prompt + output, rounded up to 256 (a trace: at "
                        "most the model shape's context, or 4096 for a checkpoint; longer rows are capped)")
    budget = e.add_mutually_exclusive_group()
    budget.add_argument("--memory-gib", default=None, metavar="GIB[,GIB...]",
                        help="KV budget in GiB (same for every backend); comma-separated, e.g. 2,8,32: every "
                             "design runs at every budget (and every --request-rate) in this invocation, and "
                             "summary.md's budget table compares them per budget")
    budget.add_argument("--kv-memory", default=None, metavar="SIZE[,SIZE...]",
                        help="the KV budget as a size, e.g. 64GiB (serve's flag; the same as --memory-gib), "
                             "comma-separated to sweep it (2GiB,8GiB)")
    e.add_argument("--gpu-memory-utilization", type=float, default=None)
    # backend options (choices, help and defaults from the backends' options classes): each backend
    # gets the ones its options have; a value but the default that no listed backend takes is an error
    add_backend_option_args(e, flags=OPTION_FLAGS, skip=("enable_prefix_caching",),
                            refused_note="; given to the backends that have the option")
    e.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="prefix caching off on every backend (serve's --no-enable-prefix-caching)")
    add_graph_args(e)
    add_parallel_args(e)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="result directory (default ./vmkv-results/engine-<UTC time>)")
    o.add_argument("--reference", default=None, help="results.json whose offline run defines 'x' rates")
    o.add_argument("--timeout-s", type=float, default=1800, help="per run")
    o.add_argument("--torch-threads", "--threads", type=int, default=None,
                   help="torch CPU threads in the workers (serve's --threads)")


def parse_rates(text: str) -> list[str]:
    """``"inf,2,0.5x"`` -> ``["inf", "2", "0.5x"]`` (validated).  Raises ValueError."""
    rates = [r.strip().lower() for r in str(text).split(",") if r.strip()]
    if not rates:
        raise ValueError("--request-rate needs at least one value (inf for offline)")
    for r in rates:
        try:
            value = float(r[:-1] if r.endswith("x") else r)
        except ValueError:
            raise ValueError(f"request rate {r!r} must be a number, inf, or a fraction like 0.5x") from None
        if not value > 0:
            raise ValueError(f"request rate must be > 0, got {r!r}")
    return rates


def scenario_name(rate: float, budget: str = "") -> str:
    """``offline`` / ``rate-4``; with ``budget`` (a budget sweep's label): ``offline-2GiB``, ``rate-4-2GiB``."""
    name = "offline" if math.isinf(rate) else f"rate-{rate:g}"
    return f"{name}-{budget}" if budget else name


def parse_budgets(args) -> list[int | None]:
    """The KV budgets of ``--memory-gib`` (GiB) or ``--kv-memory`` (sizes), in bytes, in the order given:
    ``"2,8,32"`` -> ``[2 GiB, 8 GiB, 32 GiB]``; ``[None]`` when neither is set (the engine's default
    budget).  A single number (not text) is taken as one budget.

    Raises:
        ValueError: a value that is not a positive number or size, or a budget given twice.
    """
    gib, size = getattr(args, "memory_gib", None), getattr(args, "kv_memory", None)
    if gib is None and size is None:
        return [None]
    flag, text = ("--memory-gib", gib) if gib is not None else ("--kv-memory", size)
    items = [text] if isinstance(text, (int, float)) else [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{flag} needs at least one budget")
    out = []
    for item in items:
        try:
            n = int(float(item) * (1 << 30)) if flag == "--memory-gib" else int(parse_size(item))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise ValueError(f"{flag}: {item!r} is not a {'number of GiB' if flag == '--memory-gib' else 'size'}") from None
        if n <= 0:
            raise ValueError(f"{flag}: a KV budget must be > 0, got {item!r}")
        if n in out:
            raise ValueError(f"{flag}: budget {item!r} is given twice")
        out.append(n)
    return out


_FIRST_BUDGET = object()    # worker_config's default: the command line's (first) budget


#: backend option -> this harness's flag for it where that is not serve's (the other options' flags,
#: parsers, help and defaults come from their options fields: vmkv.engine.option_args)
OPTION_FLAGS = {"page_size_bytes": "--page-size"}


def backend_knobs(args) -> dict[str, object]:
    """The backend options of the command line, by option name (``--no-prefix-caching`` ->
    ``enable_prefix_caching=False``)."""
    out = backend_option_values(args, [n for n in option_names() if n != "enable_prefix_caching"])
    out["enable_prefix_caching"] = not args.no_prefix_caching
    return out


def designs(backends_text: str, reservations_text: str = "none") -> list[str]:
    """The KV designs a comparison runs, in order: each ``--backends`` entry, crossed with
    ``--kv-reservations`` unless it names its policy (``"paged+max"``); labels as
    :func:`vmkv.engine.reservation.design_label` writes them (``"paged"``, ``"paged+max"``).

    Raises:
        ValueError: an unknown reservation policy (the message lists the choices).
    """
    policies = [check_reservation(p.strip(), "--kv-reservations entry") for p in str(reservations_text).split(",")
                if p.strip()] or ["none"]
    out = []
    for entry in (b.strip() for b in str(backends_text).split(",") if b.strip()):
        backend, policy = parse_design(entry)
        base = entry.partition("@")[0].strip()
        variant = "".join(f"@{k}={v}" for k, v in design_options(entry).items())
        for pol in ([policy] if "+" in base else policies):
            label = design_label(backend, pol) + variant
            if label in out:
                raise ValueError(f"design {label!r} is listed twice (--backends crossed with --kv-reservations)")
            if backend in backend_choices():
                variant_knobs(label)    # a bad variant fails here, before anything runs
            out.append(label)
    return out


def _option_value(backend: str, name: str, text: str) -> object:
    """A design variant's option value (``design_options``) from its text, parsed as the option's CLI
    flag parses it (a size, a number of seconds, a name, ``true``/``false`` for a switch).
    Raises ValueError: the text does not parse."""
    check = backend_options_class(backend).field_check(name)
    if check.is_flag:
        low = text.lower()
        if low not in ("true", "false"):
            raise ValueError(f"{name} takes true or false, got {text!r}")
        return low == "true"
    if check.parse is None:
        return text
    try:
        return check.parse(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{name}: {exc}") from None


def variant_knobs(design: str) -> dict[str, object]:
    """The backend options a design variant sets (``"vmem@kv_shrink_grace_s=inf"``), checked against the
    backend's options class.  Raises ValueError: an option its backend does not have, or a bad value."""
    backend, _ = parse_design(design)
    out = {}
    for name, text in design_options(design).items():
        if backend not in option_backends(name):
            raise ValueError(f"design {design!r}: {name!r} is not an option of the {backend} backend; its "
                             f"options are {list(backend_options_class(backend).field_names())}")
        try:
            value = _option_value(backend, name, text)
            backend_options_class(backend).check_field(name, value, owner=backend)
        except ValueError as exc:
            raise ValueError(f"design {design!r}: {exc}") from None
        out[name] = value
    return out


def check_backends(args, backends: list[str]) -> None:
    """Raise ValueError for an unknown backend, or a backend option set to a value but its default that
    no listed backend takes (e.g. ``--attention-impl sdpa --backends paged``): it would change nothing
    that is measured."""
    for b in backends:
        if b not in backend_choices():
            raise ValueError(f"unknown KV backend {b!r} in --backends; choose from {list(backend_choices())}")
    defaults = CacheConfig()
    for opt, value in backend_knobs(args).items():
        owners = option_backends(opt)
        if value != getattr(defaults, opt) and not set(owners) & set(backends):
            flag = option_flag(opt, OPTION_FLAGS)
            raise ValueError(f"{flag} is an option of the {'/'.join(owners)} backend, and --backends "
                             f"{','.join(backends)} lists none of them; add {owners[0]} to --backends or drop {flag}")


def _knobs(args, max_model_len: int, design: str, memory_bytes=_FIRST_BUDGET) -> dict:
    """``LLMEngine.from_args`` knobs of one run of ``design`` (``"paged+max"``): the engine limits, its
    reservation policy, the KV budget (``memory_bytes``; default: the first of :func:`parse_budgets`),
    and the backend options that its backend's options class has."""
    backend, policy = parse_design(design)
    knobs = {"kv_reservation": policy,"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
             "max_model_len": max_model_len, "seed": args.seed, "enforce_eager": args.enforce_eager,
             "async_scheduling": args.async_scheduling,
             "cuda_graph_sizes": args.cuda_graph_sizes, "tensor_parallel_size": args.tensor_parallel_size}
    if args.model in SHAPES:
        knobs["random_weights"] = args.model
    if memory_bytes is _FIRST_BUDGET:
        memory_bytes = parse_budgets(args)[0]
    if memory_bytes is not None:
        knobs["memory_bytes"] = int(memory_bytes)
    if args.gpu_memory_utilization is not None:
        knobs["gpu_memory_utilization"] = args.gpu_memory_utilization
    knobs.update({k: v for k, v in backend_knobs(args).items() if backend in option_backends(k)})
    knobs.update(variant_knobs(design))
    return knobs


def _spec(args, rate: float) -> WorkloadSpec:
    return WorkloadSpec(kind=args.workload, num_requests=args.num_requests, input_len=args.input_len,
                        output_len=args.output_len, request_rate=rate, burstiness=args.burstiness,
                        shared_prefix_len=args.shared_prefix_len, num_prefixes=args.num_prefixes, n=args.n,
                        seed=args.seed)


def worker_config(args, backend: str, rate_text: str, spec: WorkloadSpec, max_model_len: int,
                  memory_bytes=_FIRST_BUDGET, budget: str = "") -> dict:
    """The configuration of one (scenario, backend) run of :mod:`vmkv.compare.engine_worker` (JSON):
    model, device, dtype, the engine knobs of ``backend`` (:func:`_knobs`), the workload, warm-up,
    temperature and SLO.  ``vmkv compare serve`` starts ``vmkv serve`` from the same dict.  A trace
    workload is capped at ``max_model_len`` here (its rows' prompt + output).  ``memory_bytes``: the KV
    budget of the run (default: the command line's first); ``budget``: its label in the scenario's name
    (a budget sweep)."""
    if spec.is_trace and spec.max_model_len != max_model_len:
        spec = replace(spec, max_model_len=max_model_len)
    kv_backend, policy = parse_design(backend)     # backend: a design label (designs())
    return {"backend": backend, "kv_backend": kv_backend, "kv_reservation": policy,
            "scenario": scenario_name(spec.request_rate, budget), "rate_spec": rate_text,
            "model": None if args.model in SHAPES else args.model, "device": args.device,
            "dtype": args.dtype, "knobs": _knobs(args, max_model_len, backend, memory_bytes),
            "workload": spec.to_dict(),
            "warmup_requests": args.warmup_requests, "temperature": args.temperature,
            "warmup_fill_budget": args.warmup_fill_budget,
            "slo": args.slo, "torch_threads": args.torch_threads}


def _default_max_model_len(spec: WorkloadSpec, model: str | None = None) -> int:
    if spec.is_trace:   # the rows uncapped; at most the model's context (the engine's default for a checkpoint)
        ctx, gen, _, _ = trace_rows(replace(spec, max_model_len=0))
        limit = SHAPES[model].max_model_len if model in SHAPES else DEFAULT_MAX_MODEL_LEN
        return min(int(math.ceil((int((ctx + gen).max()) + 1) / 256) * 256), limit)
    # lengths do not depend on the vocabulary (separate random streams), so any vocab gives them
    reqs = generate(spec, 1000)
    longest = max(r.prompt_len + r.output_len for r in reqs)
    return int(math.ceil((longest + 1) / 256) * 256)


def _run_worker(cfg: dict, out_dir: Path, prog, task, timeout_s: float, threads: int | None) -> dict:
    name = f"{cfg['scenario']}-{cfg['backend']}"
    raw = out_dir / "raw"
    if (raw / f"{name}.json").exists():  # the same backend listed twice (an A/A check)
        name += f"-{sum(1 for _ in raw.glob(name + '*.config.json'))}"

    def on_event(ev: dict) -> None:
        if ev.get("event") == "loaded":
            prog.update(task, total=ev["total"], completed=0,
                        description=f"{name} (loaded in {ev['load_s']:.1f}s)")
        elif ev.get("event") == "progress":
            prog.update(task, completed=ev["done"])

    return run_worker_process("vmkv.compare.engine_worker", cfg, out_dir, name, timeout_s, threads, on_event,
                              {"backend": cfg["backend"], "scenario": cfg["scenario"]})


def _reference_rate(path: str | None, runs: list[dict], backend: str) -> float | None:
    pool = runs
    if path:
        pool = json.loads(Path(path).read_text())["runs"]
    for r in pool:     # the offline run (named offline-<budget> in a budget sweep)
        if ((r.get("scenario") == "offline" or r.get("rate_spec") == "inf") and r.get("backend") == backend
                and "serving" in r):
            return r["serving"]["request_throughput"]
    return None


@dataclass(frozen=True)
class Plan:
    """What a comparison runs, resolved from the command line (:func:`plan`): the backends in order,
    the rates (offline first: relative rates need its throughput), the workload at t=0 and the
    ``max_model_len`` every run gets; ``note``: what a trace workload replays (rows, clipped rows), or "";
    ``budgets``: the KV budgets in bytes (:func:`parse_budgets`; ``[None]``: the engine's default)."""

    backends: list[str]
    rates: list[str]
    base_spec: WorkloadSpec
    max_model_len: int
    note: str = ""
    budgets: tuple = (None,)


def plan(args) -> Plan:
    """Validate the comparison's arguments (shared by ``vmkv compare engine`` and ``vmkv compare serve``).

    Raises:
        ValueError: a bad rate, length distribution, workload field or backend option (the message
            names it).
    """
    backends = designs(args.backends, getattr(args, "kv_reservations", "none"))
    rates = parse_rates(args.request_rate)
    budgets = parse_budgets(args)
    base_spec = _spec(args, math.inf)
    for text in (args.input_len, args.output_len):
        LengthDist.parse(text)
    check_backends(args, list(dict.fromkeys(parse_design(b)[0] for b in backends)))
    rates.sort(key=lambda r: (r != "inf", r.endswith("x")))
    max_model_len = args.max_model_len or _default_max_model_len(base_spec, args.model)
    if base_spec.is_trace:
        base_spec = replace(base_spec, max_model_len=max_model_len)
    return Plan(backends, rates, base_spec, max_model_len, trace_note(base_spec), tuple(budgets))


def resolve_rate(rate_text: str, args, runs: list[dict], backend: str) -> float:
    """The request rate of ``rate_text`` (req/s); ``0.5x`` is a fraction of ``backend``'s offline request
    throughput in ``runs`` (or in ``--reference``).

    Raises:
        ValueError: a relative rate without an offline run of ``backend`` to scale.
    """
    if not rate_text.endswith("x"):
        return float(rate_text)
    ref = _reference_rate(args.reference, runs, backend)
    if ref is None:
        raise ValueError(f"rate {rate_text} needs an offline run of {backend} "
                         "(add inf to --request-rate or pass --reference results.json)")
    return float(rate_text[:-1]) * ref


def run(args) -> int:
    from vmkv.compare import engine_report

    console = report.console()
    try:
        p = plan(args)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    backends, base_spec, max_model_len = p.backends, p.base_spec, p.max_model_len
    try:
        engine_report.reference_design(backends, args.reference_design)
        if not 0 < args.slo_attainment <= 1:
            raise ValueError(f"--slo-attainment must be in (0, 1], got {args.slo_attainment}")
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    if p.note:
        console.print(p.note)
    out_dir = report.results_dir(args.out, "engine")
    env = report.environment(seed=args.seed)
    runs: list[dict] = []
    labels = [budget_label(b) for b in p.budgets]
    several = len(p.budgets) > 1
    with report.progress(console) as prog:
        for budget, label in zip(p.budgets, labels):     # every design at every budget and rate
            at_budget: list[dict] = []
            for rate_text in p.rates:
                try:   # a relative rate scales the first design's offline run at this budget
                    rate = resolve_rate(rate_text, args, at_budget, backends[0])
                except ValueError as exc:
                    console.print(f"[red]error:[/red] {exc}")
                    return 2
                spec = _spec(args, rate)
                for backend in backends:
                    cfg = worker_config(args, backend, rate_text, spec, max_model_len, budget,
                                        label if several else "")
                    task = prog.add_task(f"{cfg['scenario']}-{backend} (loading)", total=spec.num_requests)
                    res = _run_worker(cfg, out_dir, prog, task, args.timeout_s, args.torch_threads)
                    res.update(rate_spec=rate_text, kv_budget_bytes=budget, budget=label)
                    if "error" in res:      # the sweep counts a failed (e.g. timed-out) rate as not sustained
                        res["request_rate"] = rate
                    runs.append(res)
                    at_budget.append(res)
                    if "error" in res:
                        console.print(f"[red]{cfg['scenario']}-{backend} failed:[/red] {res['error']}")
    summary_runs = [{k: v for k, v in r.items() if k != "raw"} for r in runs]
    sweeps = {label: engine_report.sweep([r for r in runs if r["budget"] == label], args.slo, args.reference_design,
                                         args.slo_attainment) for label in labels}
    results = {"kind": "engine", "environment": env, "args": vars(args), "max_model_len": max_model_len,
               "workload": base_spec.to_dict(),
               "budgets": [{"budget": label, "kv_budget_bytes": b} for b, label in zip(p.budgets, labels)],
               "runs": summary_runs,
               # one budget: its sweep (as before budgets were swept); several: None, each in "sweeps"
               "sweep": None if several else sweeps[labels[0]], "sweeps": sweeps,
               "budget_table": engine_report.budget_table(runs, sweeps, args.reference_design)}
    report.write_json(out_dir / "results.json", results)
    engine_report.render(results, runs, out_dir, console)
    return 1 if any("error" in r for r in runs) else 0
