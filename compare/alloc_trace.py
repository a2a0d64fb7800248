"""The seeded sequence-length trace every allocator peer runs (``vmkv.compare.alloc_peers``).

``--num-seqs`` sequences are admitted at once with a prompt, grow ``--decode-tokens`` positions per decode
step until their final length and are freed when they reach it (the ``vmkv.compare.alloc_peers`` docstring
defines the workload and every figure measured on it).  Same :class:`TraceConfig`, same trace and digest.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

ADMIT, GROW, FREE = "admit", "grow", "free"


@dataclass(frozen=True)
class TraceConfig:
    """The seeded workload every allocator runs (``vmkv.compare.alloc_peers`` docstring)."""

    num_seqs: int = 64
    prompt_len: tuple[int, int] = (64, 256)
    final_len: tuple[int, int] = (512, 2048)
    decode_tokens: int = 1
    admit_len: int = 2048
    admit_reps: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_seqs", "decode_tokens", "admit_len", "admit_reps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TraceConfig.{name} must be an int >= 1, got {value!r}")
        (p0, p1), (f0, f1) = self.prompt_len, self.final_len
        if not 1 <= p0 <= p1:
            raise ValueError(f"TraceConfig.prompt_len must be A..B with 1 <= A <= B, got {p0}..{p1}")
        if not p1 < f0 <= f1:
            raise ValueError(f"TraceConfig.final_len must be A..B with prompt max {p1} < A <= B, got {f0}..{f1}")

    @property
    def max_len(self) -> int:
        return max(self.final_len[1], self.admit_len)


def make_trace(cfg: TraceConfig) -> list[list[tuple[str, int, int]]]:
    """Decode steps of ``(op, seq_id, num_tokens)``: step 0 admits every sequence with its prompt; each
    later step grows every live sequence by ``decode_tokens`` (``num_tokens`` = its new length) and frees
    (``num_tokens`` 0) those that reached their final length.  Same ``cfg``, same trace."""
    rng = random.Random(cfg.seed)
    lens = [rng.randint(*cfg.prompt_len) for _ in range(cfg.num_seqs)]
    finals = [rng.randint(*cfg.final_len) for _ in range(cfg.num_seqs)]
    steps = [[(ADMIT, s, n) for s, n in enumerate(lens)]]
    live = list(range(cfg.num_seqs))
    while live:
        step, still = [], []
        for s in live:
            lens[s] = min(finals[s], lens[s] + cfg.decode_tokens)
            step.append((GROW, s, lens[s]))
            if lens[s] == finals[s]:
                step.append((FREE, s, 0))
            else:
                still.append(s)
        steps.append(step)
        live = still
    return steps


def trace_digest(steps: list[list[tuple[str, int, int]]]) -> str:
    """sha256 of the trace (the runs of one comparison must show the same)."""
    return hashlib.sha256(json.dumps(steps).encode()).hexdigest()[:16]
