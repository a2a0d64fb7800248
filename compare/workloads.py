"""Seeded benchmark workloads: length distributions, arrival processes, sharing patterns.

Every workload is a pure function of its :class:`WorkloadSpec` (seed included) and the model's vocabulary
size, so both backends get identical requests and a result can name exactly what it ran
(BENCHMARKS.md, "Workloads").  Prompts are random token ids, so any model (including random-weight
shapes without a tokenizer) can run them.

Length distributions (:class:`LengthDist`, parsed from one string):

- ``"512"``: fixed length.
- ``"512..2048"``: uniform integer on [512, 2048], both ends included.
- ``"lognormal:MEDIAN,SIGMA[,MIN,MAX]"``: ``round(exp(N(ln MEDIAN, SIGMA)))`` clipped to [MIN, MAX]
  (defaults 1 and 32768); lognormal is the usual fit of chat traces.
- ``"sharegpt-in"`` / ``"sharegpt-out"``: lognormals whose means equal the ShareGPT means reported in the
  vLLM paper (Kwon et al., SOSP 2023, section 6.1: 161 input and 338 output tokens) with an assumed
  sigma of 1.0 (median = mean / e^0.5); "ShareGPT-like", not the trace itself.

Arrivals: ``request_rate=inf`` puts every request at t=0 (offline).  A finite rate draws gaps from a
gamma distribution with shape ``burstiness`` and mean ``1/rate`` (vLLM ``benchmark_serving``:
burstiness 1 is a Poisson process; < 1 burstier, > 1 more uniform).

Kinds: ``random`` (independent prompts), ``shared-prefix`` (each prompt starts with one of
``num_prefixes`` shared "system prompts" of ``shared_prefix_len`` tokens, then its own random tokens:
prefix caching), ``parallel`` (every request asks for ``n`` samples: fork and copy-on-write).

Traces: ``azure-conv`` and ``azure-code`` replay the Azure LLM inference trace 2023 (Patel et al., "Splitwise",
ISCA 2024; CC-BY 4.0; shipped gzipped in ``compare/data/azure_llm_2023/``, whose README names the source
commit): the first ``num_requests`` rows (19,366 conversation rows, 8,819 code rows; an error above that),
ContextTokens as the prompt length and GeneratedTokens as the output length (``input_len``/``output_len``
and ``burstiness`` are not used), arrivals from the TIMESTAMP column relative to the first row.  A finite
``request_rate`` R scales time so that the rows' mean rate ((rows - 1) / (last - first timestamp)) is R
req/s, keeping the trace's burst pattern; ``inf`` puts every row at t=0.  ``max_model_len`` (> 0) caps
every row at prompt + output <= max_model_len: the output keeps its length (at most max_model_len - 1)
and the prompt is shortened to fit; :func:`trace_info` counts the rows clipped.  Token ids are random
from the seed, as for the synthetic kinds.  ``sharegpt-in``/``sharegpt-out`` above are the synthetic form
(lognormals), the trace kinds are real arrivals and lengths.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

__all__ = ["LengthDist", "WorkloadSpec", "Request", "generate", "arrival_offsets", "WORKLOAD_KINDS",
           "TRACE_KINDS", "Trace", "load_trace", "trace_rows", "trace_info", "trace_note",
           "lengths_and_arrivals"]

#: workloads replayed from a shipped trace (module docstring, "Traces"): kind -> file under data/
TRACE_FILES = {"azure-conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv.gz",
               "azure-code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv.gz"}
TRACE_KINDS = tuple(TRACE_FILES)
WORKLOAD_KINDS = ("random", "shared-prefix", "parallel") + TRACE_KINDS
#: what ``input_len``/``output_len`` read for a trace kind (its lengths come from the trace)
TRACE_INPUT_LEN = "trace:ContextTokens"
TRACE_OUTPUT_LEN = "trace:GeneratedTokens"
_DATA_DIR = Path(__file__).resolve().parent / "data"

_SHAREGPT_MEANS = {"sharegpt-in": 161.0, "sharegpt-out": 338.0}
_SHAREGPT_SIGMA = 1.0


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts.

    Attributes:
        kind: ``"fixed"``, ``"uniform"`` or ``"lognormal"``.
        low, high: fixed: both the length; uniform: inclusive range; lognormal: clip range.
        median, sigma: lognormal parameters (median in tokens, sigma of the underlying normal).
    Raises:
        ValueError: out-of-range fields, naming them.
    """

    kind: str
    low: int
    high: int
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"LengthDist.kind must be fixed, uniform or lognormal, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length range must satisfy 1 <= low <= high, got low={self.low}, high={self.high}")
        if self.kind == "lognormal" and not (self.median > 0 and self.sigma >= 0):
            raise ValueError(f"lognormal needs median > 0 and sigma >= 0, got {self.median}, {self.sigma}")

    @classmethod
    def parse(cls, text: str | int) -> "LengthDist":
        """Parse the string forms listed in the module docstring.

        Raises:
            ValueError: the text matches no form; the message lists the forms.
        """
        s = str(text).strip().lower()
        forms = "N, A..B, lognormal:MEDIAN,SIGMA[,MIN,MAX], sharegpt-in, sharegpt-out"
        try:
            if s in _SHAREGPT_MEANS:
                median = _SHAREGPT_MEANS[s] / math.exp(_SHAREGPT_SIGMA ** 2 / 2)
                return cls("lognormal", 1, 32768, median=median, sigma=_SHAREGPT_SIGMA)
            if s.startswith("lognormal:"):
                parts = [float(p) for p in s.split(":", 1)[1].split(",")]
                if len(parts) not in (2, 4):
                    raise ValueError
                lo, hi = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (1, 32768)
                return cls("lognormal", lo, hi, median=parts[0], sigma=parts[1])
            if ".." in s:
                a, b = s.split("..")
                return cls("uniform", int(a), int(b))
            n = int(s)
            return cls("fixed", n, n)
        except ValueError as exc:
            if "must" in str(exc) or "needs" in str(exc):
                raise
            raise ValueError(f"cannot parse length distribution {text!r}; use one of: {forms}") from None

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` lengths, ``int64 [size]``, every one in [low, high]."""
        if self.kind == "fixed":
            return np.full(size, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=size, dtype=np.int64)
        raw = np.rint(np.exp(rng.normal(math.log(self.median), self.sigma, size=size)))
        return np.clip(raw, self.low, self.high).astype(np.int64)

    @property
    def mean(self) -> float:
        """Expected value (unclipped for lognormal)."""
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma ** 2 / 2)
        return (self.low + self.high) / 2

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"{self.low}..{self.high}"
        return f"lognormal:{self.median:g},{self.sigma:g},{self.low},{self.high}"


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that determines a workload (written into every result).

    Attributes:
        kind: one of :data:`WORKLOAD_KINDS`.
        num_requests: requests (> 0).
        input_len, output_len: length distributions (strings as in :meth:`LengthDist.parse`); for
            ``shared-prefix`` the input length counts the shared prefix too (at least prefix + 1).
        request_rate: requests per second; ``inf`` = all at t=0 (offline).
        burstiness: gamma shape of the inter-arrival gaps (1 = Poisson).
        shared_prefix_len: tokens of each shared system prompt (``shared-prefix``).
        num_prefixes: distinct shared system prompts, assigned round-robin.
        n: samples per request (``parallel``).
        seed: seed of every random draw.
        max_model_len: trace kinds: every row capped at prompt + output <= this (0: no cap); the
            synthetic kinds do not use it.
    """

    kind: str = "random"
    num_requests: int = 16
    input_len: str = "128"
    output_len: str = "64"
    request_rate: float = math.inf
    burstiness: float = 1.0
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    n: int = 1
    seed: int = 0
    max_model_len: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload kind must be one of {WORKLOAD_KINDS}, got {self.kind!r}")
        if self.max_model_len < 0 or self.max_model_len == 1:
            raise ValueError(f"max_model_len must be 0 (no cap) or >= 2, got {self.max_model_len}")
        if self.is_trace:   # lengths and arrivals come from the trace
            object.__setattr__(self, "input_len", TRACE_INPUT_LEN)
            object.__setattr__(self, "output_len", TRACE_OUTPUT_LEN)
            object.__setattr__(self, "burstiness", 1.0)
        if self.num_requests <= 0:
            raise ValueError(f"num_requests must be > 0, got {self.num_requests}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = offline), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.n < 1 or self.num_prefixes < 1 or self.shared_prefix_len < 0:
            raise ValueError(f"need n >= 1, num_prefixes >= 1, shared_prefix_len >= 0; got "
                             f"{self.n}, {self.num_prefixes}, {self.shared_prefix_len}")
        if self.kind == "shared-prefix" and self.shared_prefix_len == 0:
            raise ValueError("shared-prefix workload needs shared_prefix_len > 0 (e.g. --shared-prefix-len 512)")
        if self.kind != "parallel" and self.n != 1:
            raise ValueError(f"n={self.n} needs --workload parallel")
        if self.is_trace:
            rows = len(load_trace(self.kind))
            if self.num_requests > rows:
                raise ValueError(f"the {self.kind} trace has {rows} rows; num_requests={self.num_requests} "
                                 f"asks for more (--num-requests {rows} replays it all)")
            return
        LengthDist.parse(self.input_len)
        LengthDist.parse(self.output_len)

    @property
    def is_offline(self) -> bool:
        return math.isinf(self.request_rate)

    @property
    def is_trace(self) -> bool:
        return self.kind in TRACE_KINDS

    def to_dict(self) -> dict:
        """The fields (``request_rate`` ``"inf"`` when offline); a trace kind adds ``trace``, its
        :func:`trace_info` (rows, clipped rows, time scale: written into every result, ignored by
        :meth:`from_dict`)."""
        d = asdict(self)
        d["request_rate"] = "inf" if self.is_offline else self.request_rate
        if self.is_trace:
            d["trace"] = trace_info(self)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "WorkloadSpec":
        d = {k: v for k, v in d.items() if k != "trace"}
        d["request_rate"] = float(d["request_rate"])
        return cls(**d)


@dataclass
class Request:
    """One benchmark request.

    Attributes:
        request_id: ``"req-<index>"``.
        prompt_token_ids: the prompt (random ids in the vocabulary's middle range).
        output_len: tokens to generate (``max_tokens`` with ``ignore_eos``).
        arrival_s: arrival offset from the start of the run, seconds.
        n: samples to draw.
        prefix_id: index of the shared prefix used, -1 for none.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float = 0.0
    n: int = 1
    prefix_id: int = -1
    meta: dict = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Arrival times in seconds, ``float64 [num_requests]``, ascending, the first at its first gap
    (all zeros when the rate is infinite).  Gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)),
    mean ``1/rate``."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    return np.cumsum(gaps)


@dataclass(frozen=True)
class Trace:
    """A shipped trace's rows, in file order.

    Attributes:
        name: the workload kind (``azure-conv``, ``azure-code``).
        path: the gzipped CSV read.
        timestamps_s: seconds since the first row, ``float64 [rows]``, non-decreasing.
        context_tokens, generated_tokens: ``int64 [rows]``.
        first_timestamp: the first row's TIMESTAMP text, as in the file.
    """

    name: str
    path: Path
    timestamps_s: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray
    first_timestamp: str

    def __len__(self) -> int:
        return int(self.timestamps_s.size)


def _parse_timestamp(text: str) -> tuple[datetime, float]:
    # "2023-11-16 18:15:46.6805900": seven fraction digits, more than datetime parses; whole seconds and
    # the fraction apart keep every digit
    whole, _, frac = text.strip().partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S"), float("0." + frac) if frac else 0.0


@functools.lru_cache(maxsize=None)
def load_trace(kind: str) -> Trace:
    """The rows of trace workload ``kind`` (one of :data:`TRACE_KINDS`), read once per process.

    Raises:
        ValueError: an unknown kind, or a file whose header is not TIMESTAMP,ContextTokens,GeneratedTokens
            or whose row has not three fields / decreasing timestamps (the message names the row).
    """
    if kind not in TRACE_FILES:
        raise ValueError(f"no trace named {kind!r}; choose from {TRACE_KINDS}")
    path = _DATA_DIR / TRACE_FILES[kind]
    with gzip.open(path, "rt", encoding="utf-8-sig", newline="") as f:
        lines = f.read().splitlines()
    if not lines or lines[0].strip() != "TIMESTAMP,ContextTokens,GeneratedTokens":
        raise ValueError(f"{path}: header must be TIMESTAMP,ContextTokens,GeneratedTokens, got {lines[:1]}")
    rows = [ln.split(",") for ln in lines[1:] if ln.strip()]
    bad = next((i for i, r in enumerate(rows) if len(r) != 3), None)
    if bad is not None:
        raise ValueError(f"{path}: data row {bad + 1} has {len(rows[bad])} fields, not 3: {rows[bad]!r}")
    t0, f0 = _parse_timestamp(rows[0][0])
    ts = np.empty(len(rows), dtype=np.float64)
    for i, r in enumerate(rows):
        t, frac = _parse_timestamp(r[0])
        ts[i] = (t - t0).total_seconds() + (frac - f0)
    if np.any(np.diff(ts) < 0):
        i = int(np.argmax(np.diff(ts) < 0)) + 1
        raise ValueError(f"{path}: data row {i + 1}'s timestamp is before the previous row's")
    ctx = np.array([int(r[1]) for r in rows], dtype=np.int64)
    gen = np.array([int(r[2]) for r in rows], dtype=np.int64)
    return Trace(kind, path, ts, ctx, gen, rows[0][0])


def trace_rows(spec: WorkloadSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A trace spec's ``(prompt_lens, output_lens, arrivals_s, clipped)``: its first ``num_requests``
    rows, capped to ``spec.max_model_len`` (module docstring, "Traces"), arrivals scaled to
    ``spec.request_rate`` (zeros when offline); ``clipped`` counts the rows the cap shortened."""
    tr = load_trace(spec.kind)
    n = spec.num_requests
    ctx, gen = tr.context_tokens[:n].copy(), tr.generated_tokens[:n].copy()
    clipped = 0
    if spec.max_model_len:
        m = spec.max_model_len
        over = ctx + gen > m
        clipped = int(over.sum())
        gen = np.minimum(gen, m - 1)
        ctx = np.maximum(np.minimum(ctx, m - gen), 1)
    ctx, gen = np.maximum(ctx, 1), np.maximum(gen, 1)
    t = tr.timestamps_s[:n] - tr.timestamps_s[0]
    if spec.is_offline:
        arrivals = np.zeros(n)
    else:
        span = float(t[-1])
        arrivals = t * ((n - 1) / span / spec.request_rate) if n > 1 and span > 0 else np.zeros(n)
    return ctx, gen, arrivals, clipped


def trace_info(spec: WorkloadSpec) -> dict:
    """What a trace spec replays, for results and logs: the trace and its file, rows used (the first
    ``num_requests``), rows clipped by ``max_model_len``, the rows' own mean rate (req/s), the time
    scale applied (scaled seconds per trace second; None offline), mean prompt and output lengths after
    the cap."""
    tr = load_trace(spec.kind)
    ctx, gen, _, clipped = trace_rows(spec)
    n = spec.num_requests
    span = float(tr.timestamps_s[n - 1] - tr.timestamps_s[0])
    native = (n - 1) / span if n > 1 and span > 0 else None
    scale = None if spec.is_offline or native is None else native / spec.request_rate
    return {"name": spec.kind, "file": f"compare/data/{TRACE_FILES[spec.kind]}", "rows_in_file": len(tr),
            "rows_used": n, "first_timestamp": tr.first_timestamp, "trace_span_s": round(span, 6),
            "trace_mean_rate": None if native is None else round(native, 6),
            "time_scale": None if scale is None else round(scale, 6),
            "max_model_len": spec.max_model_len or None, "rows_clipped": clipped,
            "mean_prompt_len": round(float(ctx.mean()), 3), "mean_output_len": round(float(gen.mean()), 3)}


def trace_note(spec: WorkloadSpec) -> str:
    """One line saying what a trace spec replays (empty for the synthetic kinds)."""
    if not spec.is_trace:
        return ""
    i = trace_info(spec)
    rate = ("a rate R scales its timestamps to R req/s, inf puts every row at t=0" if spec.is_offline else
            f"time scaled x{i['time_scale']:.4g} to {spec.request_rate:g} req/s")
    return (f"trace {i['name']}: first {i['rows_used']} of {i['rows_in_file']} rows, own mean rate "
            f"{i['trace_mean_rate'] or float('nan'):.3f} req/s, {rate}; {i['rows_clipped']} rows clipped to "
            f"prompt + output <= max_model_len {i['max_model_len']}; mean prompt {i['mean_prompt_len']:.0f}, "
            f"output {i['mean_output_len']:.0f} tokens")


def _token_range(vocab_size: int) -> tuple[int, int]:
    # skip the low ids (special/control tokens in most vocabularies)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    low = min(100, vocab_size // 4)
    return low, vocab_size


def lengths_and_arrivals(spec: WorkloadSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """``(prompt_lens, output_lens, arrivals_s, rngs)`` of ``spec``: sampled (synthetic kinds) or the
    trace's rows (:func:`trace_rows`); ``rngs[3]`` is the token stream :func:`generate` draws prompts
    from (``vmkv bench serve`` draws its text prompts from it too)."""
    rngs = [np.random.default_rng([spec.seed, i]) for i in range(4)]
    if spec.is_trace:
        in_lens, out_lens, arrivals, _ = trace_rows(spec)
        return in_lens, out_lens, arrivals, rngs
    in_lens = LengthDist.parse(spec.input_len).sample(rngs[0], spec.num_requests)
    out_lens = LengthDist.parse(spec.output_len).sample(rngs[1], spec.num_requests)
    arrivals = arrival_offsets(spec.num_requests, spec.request_rate, spec.burstiness, rngs[2])
    return in_lens, out_lens, arrivals, rngs


def generate(spec: WorkloadSpec, vocab_size: int) -> list[Request]:
    """The spec's requests, deterministic in ``(spec, vocab_size)``.

    Independent streams per quantity (lengths, arrivals, tokens) so changing the rate leaves the
    prompts unchanged; a trace kind takes lengths and arrivals from its rows.
    Raises:
        ValueError: bad vocab size, or a shared prefix longer than the input length allows.
    """
    in_lens, out_lens, arrivals, rngs = lengths_and_arrivals(spec)
    lo, hi = _token_range(vocab_size)
    tok_rng = rngs[3]
    prefixes = []
    if spec.kind == "shared-prefix":
        if int(in_lens.min()) <= spec.shared_prefix_len:
            raise ValueError(f"input lengths must exceed shared_prefix_len={spec.shared_prefix_len}; "
                             f"smallest is {int(in_lens.min())} (raise --input-len)")
        prefixes = [tok_rng.integers(lo, hi, spec.shared_prefix_len).tolist() for _ in range(spec.num_prefixes)]
    requests = []
    for i in range(spec.num_requests):
        prefix_id = -1
        if prefixes:
            prefix_id = i % spec.num_prefixes
            tail = tok_rng.integers(lo, hi, int(in_lens[i]) - spec.shared_prefix_len).tolist()
            ids = prefixes[prefix_id] + tail
        else:
            ids = tok_rng.integers(lo, hi, int(in_lens[i])).tolist()
        requests.append(Request(f"req-{i}", ids, int(out_lens[i]), float(arrivals[i]),
                                n=spec.n, prefix_id=prefix_id))
    return requests


def fingerprint(requests: list[Request]) -> str:
    """SHA-256 (first 16 hex digits) of the requests' prompts, output lengths and arrivals: equal
    fingerprints mean identical work."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([r.prompt_token_ids, r.output_len, round(r.arrival_s, 9), r.n]).encode())
    return h.hexdigest()[:16]
