"""Serving metrics as pure functions, named as vLLM's ``benchmark_serving`` names them.

Definitions (BENCHMARKS.md, "Engine and serving metrics"; vLLM ``benchmarks/benchmark_serving.py``):

- TTFT (time to first token): first generated token time minus request arrival time, seconds.
- TPOT (time per output token): ``(e2e_latency - ttft) / (output_tokens - 1)``, per request; undefined
  (excluded) for requests with fewer than two output tokens.
- ITL (inter-token latency): gaps between consecutive token (or streamed chunk) times, all requests pooled.
- E2E latency: last token (finish) time minus arrival time.
- Request throughput ``completed / duration_s``; output token throughput ``sum(output_tokens) / duration_s``;
  total token throughput ``sum(prompt_tokens + output_tokens) / duration_s``.
- Goodput: completed requests per second that meet every stated SLO (TTFT, TPOT, E2E, each in ms;
  DistServe, Zhong et al. OSDI 2024, section 2; the same definition as vLLM's ``--goodput``).

Percentiles use linear interpolation between closest ranks (``numpy.percentile`` default), as vLLM does.
All times are seconds unless a name says ``_ms`` or ``_us``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "PERCENTILES",
    "RequestRecord",
    "SLO",
    "percentile",
    "summarize",
    "tpot",
    "inter_token_latencies",
    "compute_serving_metrics",
    "WARMUP_FRACTION",
    "SLO_ATTAINMENT_MIN",
    "NORM_LATENCY_BOUND_FACTOR",
    "measured_records",
    "normalized_latency",
    "sweep_point",
    "sustained_rate",
]

#: percentiles reported for every latency (BENCHMARKS.md: mean, p50, p90, p99)
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One finished (or failed) request as seen by an engine or a client.

    Attributes:
        request_id: the request's id.
        prompt_len: prompt tokens.
        output_len: generated tokens of the request's (longest) completion, used for TPOT.
        arrival_time: when the request arrived (seconds, any monotonic clock shared with the others).
        first_token_time: when its first generated token appeared (None if none).
        finish_time: when its last token appeared / it finished (None if it failed).
        token_times: time of every generated token or streamed chunk (for ITL), ascending.
        num_output_tokens: tokens generated over all completions (``n`` of them; throughput counts
            these); defaults to ``output_len``.
        success: False if the request failed; failed requests count in no latency or throughput.
        error: the failure's message.
    """

    request_id: str
    prompt_len: int
    output_len: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int | None = None
    success: bool = True
    error: str = ""

    def __post_init__(self) -> None:
        if self.num_output_tokens is None:
            self.num_output_tokens = self.output_len

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if not self.success or self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to the last token."""
        if not self.success or self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """``(e2e - ttft) / (output_len - 1)`` seconds, None when ``output_len < 2``."""
        if self.ttft is None or self.e2e_latency is None:
            return None
        return tpot(self.e2e_latency, self.ttft, self.output_len)

    @property
    def itls(self) -> list[float]:
        return inter_token_latencies(self.token_times) if self.success else []

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2e_latency=self.e2e_latency)
        return d


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in milliseconds; None means "no limit on this metric"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO.{name} must be > 0 ms or None, got {value!r}")

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, rec: RequestRecord) -> bool:
        """Does a successful request meet every set objective? (A request without a TPOT meets the
        TPOT objective, as in vLLM.)"""
        if not rec.success or rec.ttft is None or rec.e2e_latency is None:
            return False
        if self.ttft_ms is not None and rec.ttft * 1e3 > self.ttft_ms:
            return False
        if self.tpot_ms is not None and rec.tpot is not None and rec.tpot * 1e3 > self.tpot_ms:
            return False
        if self.e2e_ms is not None and rec.e2e_latency * 1e3 > self.e2e_ms:
            return False
        return True

    @classmethod
    def parse(cls, text: str | None) -> "SLO":
        """Parse ``"ttft:500,tpot:50,e2e:10000"`` (milliseconds; vLLM's ``--goodput`` uses ``KEY:VALUE``).

        Raises:
            ValueError: unknown key or non-numeric value, naming it and the allowed keys.
        """
        if not text:
            return cls()
        keys = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}
        kwargs = {}
        for item in text.replace(" ", ",").split(","):
            if not item:
                continue
            key, sep, value = item.partition(":")
            if not sep or key.lower() not in keys:
                raise ValueError(f"SLO item {item!r} must be KEY:MILLISECONDS with KEY in ttft, tpot, e2e")
            try:
                kwargs[keys[key.lower()]] = float(value)
            except ValueError:
                raise ValueError(f"SLO value of {key!r} must be a number of ms, got {value!r}") from None
        return cls(**kwargs)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation; NaN for no values.

    Raises:
        ValueError: ``p`` outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile p must be in [0, 100], got {p}")
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


def summarize(values: Iterable[float], scale: float = 1.0) -> dict:
    """``{"n", "mean", "std", "min", "max", "p50", "p90", "p99"}`` of ``values * scale``.

    Use ``scale=1e3`` for milliseconds.  Empty input gives ``n=0`` and NaN statistics.
    """
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64) * scale
    out = {"n": int(arr.size)}
    if arr.size == 0:
        out.update({k: math.nan for k in ("mean", "std", "min", "max")})
        out.update({f"p{p}": math.nan for p in PERCENTILES})
        return out
    out.update(mean=float(arr.mean()), std=float(arr.std()), min=float(arr.min()), max=float(arr.max()))
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def tpot(e2e_latency: float, ttft: float, output_len: int) -> float | None:
    """Time per output token after the first: ``(e2e_latency - ttft) / (output_len - 1)`` seconds.

    Returns None when ``output_len < 2`` (no decode step to average).
    Raises:
        ValueError: ``ttft > e2e_latency`` or negative values.
    """
    if ttft < 0 or e2e_latency < 0:
        raise ValueError(f"latencies must be >= 0, got ttft={ttft}, e2e_latency={e2e_latency}")
    if ttft > e2e_latency + 1e-12:
        raise ValueError(f"ttft {ttft} s exceeds e2e latency {e2e_latency} s")
    if output_len < 2:
        return None
    return (e2e_latency - ttft) / (output_len - 1)


def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive token times (``len - 1`` of them), seconds.

    Raises:
        ValueError: the times are not ascending.
    """
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    if any(g < 0 for g in gaps):
        raise ValueError("token_times must be ascending")
    return gaps


def compute_serving_metrics(records: Sequence[RequestRecord], duration_s: float,
                            slo: SLO | None = None) -> dict:
    """Aggregate request records into the benchmark's metrics.

    Args:
        records: every request of the run (failed ones count only in ``failed``).
        duration_s: wall time of the run (first arrival to last finish), > 0.
        slo: objectives for goodput; goodput is None without one.
    Returns:
        dict with ``completed, failed, duration_s, total_input_tokens, total_output_tokens,
        request_throughput, output_throughput, total_token_throughput, goodput`` (per second),
        and ``ttft_ms, tpot_ms, itl_ms, e2e_ms`` each a :func:`summarize` dict in milliseconds.
    Raises:
        ValueError: ``duration_s <= 0``.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(int(r.num_output_tokens or 0) for r in ok)
    itls = [g for r in ok for g in r.itls]
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": float(duration_s),
        "total_input_tokens": int(total_in),
        "total_output_tokens": int(total_out),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft_ms": summarize((r.ttft for r in ok), 1e3),
        "tpot_ms": summarize((r.tpot for r in ok), 1e3),
        "itl_ms": summarize(itls, 1e3),
        "e2e_ms": summarize((r.e2e_latency for r in ok), 1e3),
        "goodput": None,
        "slo": None,
    }
    if slo is not None and slo.is_set:
        out["goodput"] = sum(1 for r in ok if slo.met_by(r)) / duration_s
        out["slo"] = asdict(slo)
    return out


# --- online sweeps: normalized latency and the rate a design sustains (issue 24) -----------------------

#: the share of a run's requests, first by arrival, left out of the sweep metrics (the run's ramp-up:
#: the batch fills from empty; the PagedAttention paper's Fig. 12 drops the same)
WARMUP_FRACTION = 0.1
#: a rate is sustained when at least this fraction of the measured requests meets the SLO ...
SLO_ATTAINMENT_MIN = 0.9
#: ... and its normalized latency is at most this factor times the design's lowest in the sweep
NORM_LATENCY_BOUND_FACTOR = 4.0


def measured_records(records: Sequence[RequestRecord], warmup_fraction: float = WARMUP_FRACTION
                     ) -> list[RequestRecord]:
    """``records`` by arrival time without the first ``floor(warmup_fraction x len(records))`` of them
    (ties keep their order).  Raises ValueError for a fraction outside [0, 1)."""
    if not 0 <= warmup_fraction < 1:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
    ordered = sorted(records, key=lambda r: r.arrival_time)
    return ordered[int(math.floor(warmup_fraction * len(ordered) + 1e-9)):]


def normalized_latency(records: Sequence[RequestRecord], warmup_fraction: float = WARMUP_FRACTION) -> float:
    """The PagedAttention paper's normalized latency (Kwon et al., SOSP'23, section 6.1, Fig. 12): the
    mean over requests of end-to-end latency / output tokens (``output_len``: the longest completion),
    seconds per token, over :func:`measured_records` (the first ``warmup_fraction`` by arrival
    dropped); successful requests with an output only; NaN when none."""
    vals = [r.e2e_latency / r.output_len for r in measured_records(records, warmup_fraction)
            if r.success and r.e2e_latency is not None and r.output_len > 0]
    return float(np.mean(vals)) if vals else math.nan


def sweep_point(records: Sequence[RequestRecord], rate: float, slo: SLO | None = None,
                warmup_fraction: float = WARMUP_FRACTION) -> dict:
    """One (design, rate) point of an online sweep, over :func:`measured_records`:
    ``normalized_latency_s`` (:func:`normalized_latency`), ``ttft_ms`` / ``tpot_ms`` / ``e2e_ms``
    (:func:`summarize`), ``slo_attainment`` (the fraction of the measured requests, failed ones
    included, that meets every objective of ``slo``; None without one), ``requests_measured`` and
    ``requests_dropped``; ``rate``: the offered rate (req/s)."""
    kept = measured_records(records, warmup_fraction)
    ok = [r for r in kept if r.success]
    out = {"rate": float(rate), "requests_measured": len(kept), "requests_dropped": len(records) - len(kept),
           "normalized_latency_s": normalized_latency(kept, 0.0),
           "ttft_ms": summarize((r.ttft for r in ok), 1e3), "tpot_ms": summarize((r.tpot for r in ok), 1e3),
           "e2e_ms": summarize((r.e2e_latency for r in ok), 1e3), "slo_attainment": None}
    if slo is not None and slo.is_set and kept:
        out["slo_attainment"] = sum(1 for r in ok if slo.met_by(r)) / len(kept)
    return out


def sustained_rate(points: Sequence[dict], attainment_min: float = SLO_ATTAINMENT_MIN,
                   latency_bound_factor: float = NORM_LATENCY_BOUND_FACTOR) -> dict:
    """The highest swept rate a design sustains, from its :func:`sweep_point` dicts (any order).

    A rate *passes* when (a) ``slo_attainment >= attainment_min`` (skipped when the points carry no
    SLO attainment) and (b) its normalized latency is finite and at most ``latency_bound_factor`` x the
    lowest normalized latency of the design's points (the latency stays bounded instead of growing with
    the queue).  The sustained rate is the highest rate such that it and every lower swept rate pass
    (a design sustains a rate only if it sustains every lighter load swept); None when the lowest
    rate fails.  Returns ``{"sustained_rate", "passes": [{"rate", "passed", "why"}...],
    "sustained_is_lower_bound", "rule"}`` (``sustained_is_lower_bound``: every swept rate passed, so the
    design may sustain a higher one than the sweep reached)."""
    pts = sorted(points, key=lambda p: p["rate"])
    finite = [p["normalized_latency_s"] for p in pts if p["normalized_latency_s"] is not None
              and math.isfinite(p["normalized_latency_s"])]
    floor_s = min(finite) if finite else math.nan
    sustained, broken, passes = None, False, []
    for p in pts:
        why = []
        nl = p["normalized_latency_s"]
        if p.get("error"):
            why.append(f"run failed: {p['error'][:120]}")
        elif nl is None or not math.isfinite(nl):
            why.append("no normalized latency")
        elif nl > latency_bound_factor * floor_s:
            why.append(f"normalized latency {nl:.4g} s > {latency_bound_factor:g} x {floor_s:.4g} s")
        att = p.get("slo_attainment")
        if att is not None and att < attainment_min:
            why.append(f"SLO attainment {att:.3f} < {attainment_min:g}")
        passes.append({"rate": p["rate"], "passed": not why, "why": "; ".join(why)})
        broken = broken or bool(why)
        if not broken:
            sustained = p["rate"]
    return {"sustained_rate": sustained, "passes": passes,
            # every swept rate passed: the design may sustain more than the sweep reached
            "sustained_is_lower_bound": bool(pts) and not broken,
            "rule": {"slo_attainment_min": attainment_min, "norm_latency_bound_factor": latency_bound_factor,
                     "norm_latency_floor_s": floor_s}}
