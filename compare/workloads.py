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
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["LengthDist", "WorkloadSpec", "Request", "generate", "arrival_offsets", "WORKLOAD_KINDS"]

WORKLOAD_KINDS = ("random", "shared-prefix", "parallel")

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

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload kind must be one of {WORKLOAD_KINDS}, got {self.kind!r}")
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
        LengthDist.parse(self.input_len)
        LengthDist.parse(self.output_len)

    @property
    def is_offline(self) -> bool:
        return math.isinf(self.request_rate)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = "inf" if self.is_offline else self.request_rate
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "WorkloadSpec":
        d = dict(d)
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


def _token_range(vocab_size: int) -> tuple[int, int]:
    # skip the low ids (special/control tokens in most vocabularies)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    low = min(100, vocab_size // 4)
    return low, vocab_size


def generate(spec: WorkloadSpec, vocab_size: int) -> list[Request]:
    """The spec's requests, deterministic in ``(spec, vocab_size)``.

    Independent streams per quantity (lengths, arrivals, tokens) so changing the rate leaves the
    prompts unchanged.
    Raises:
        ValueError: bad vocab size, or a shared prefix longer than the input length allows.
    """
    rngs = [np.random.default_rng([spec.seed, i]) for i in range(4)]
    in_lens = LengthDist.parse(spec.input_len).sample(rngs[0], spec.num_requests)
    out_lens = LengthDist.parse(spec.output_len).sample(rngs[1], spec.num_requests)
    arrivals = arrival_offsets(spec.num_requests, spec.request_rate, spec.burstiness, rngs[2])
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
