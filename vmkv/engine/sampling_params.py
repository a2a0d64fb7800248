"""Per-request sampling parameters, in vLLM's shape (``vllm.SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplingParams", "GREEDY_EPS"]

#: temperatures below this are treated as greedy (argmax)
GREEDY_EPS = 1e-5


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    Args:
        n: completions per prompt (>= 1); they share the prompt's KV through ``fork``.
        temperature: in [0, 2]; 0 is greedy (argmax).
        top_p: nucleus sampling, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens (ties at the k-th value kept); -1 (or 0) disables it.
        seed: seeds this request's own ``torch.Generator`` so its samples do not depend on the
            other requests in the batch; ``None`` uses the engine's shared generator.
        max_tokens: output tokens at most (>= 1); ``None``: until ``max_model_len``.
        stop: stop string(s); the output text ends before the first occurrence
            (``finish_reason="stop"``, ``stop_reason`` = the string).
        stop_token_ids: token ids that end the output (``stop_reason`` = the id).
        ignore_eos: keep generating after the model's EOS token(s).
        skip_special_tokens: leave special tokens out of the output text.
    Raises:
        ValueError: a parameter out of range, e.g. ``"temperature must be in [0, 2], got 5"``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None:
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Check every parameter; raises ``ValueError`` naming the first bad one."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"top_k must be -1 (disabled) or an int >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        for s in self.stop or ():
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        for tid in self.stop_token_ids or ():
            if not _is_int(tid) or tid < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {tid!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: argmax, no randomness."""
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or ())

    @property
    def effective_top_k(self) -> int:
        """``top_k``, with 0 for "disabled"."""
        return self.top_k if self.top_k > 0 else 0
