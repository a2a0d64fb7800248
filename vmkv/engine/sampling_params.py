"""Per-request sampling parameters, in vLLM's shape (``vllm.SamplingParams``)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["SamplingParams", "RequestOutputKind", "GREEDY_EPS", "MAX_INT32", "MAX_INT64", "MAX_LOGIT_BIAS"]

#: temperatures below this are treated as greedy (argmax)
GREEDY_EPS = 1e-5
#: largest int32 / int64: upper bounds of integer parameters (see :meth:`SamplingParams.validate`)
MAX_INT32 = 2 ** 31 - 1
MAX_INT64 = 2 ** 63 - 1
#: largest ``|logit_bias|`` value (OpenAI's range is [-100, 100])
MAX_LOGIT_BIAS = 100.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _has_lone_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def _check_int(name: str, value: object, low: int, high: int, prefix: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an int in ``[low, high]`` (the message names both)."""
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be {prefix}an int in [{low}, {high}], got {value!r}")


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number in the interval (NaN is in none; the
    message names the field, the interval and the value)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


class RequestOutputKind(enum.IntEnum):
    """When a request's outputs are reported (vLLM's ``RequestOutputKind``).

    ``CUMULATIVE`` and ``DELTA``: after every step that produced tokens (each output carries both the
    cumulative tokens/text and the delta since the previous one); ``FINAL_ONLY``: once, when the
    request finishes (offline generation: no per-step output objects are built).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    Args:
        n: completions per prompt, in [1, 2**31 - 1] (and at most the engine's ``max_num_seqs``);
            they share the prompt's KV through ``fork``.
        temperature: in [0, 2]; 0 is greedy (argmax).
        top_p: nucleus sampling, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens (ties at the k-th value kept), in [1, 2**31 - 1] (a k
            above the vocabulary keeps every token); -1 (or 0) disables it.
        seed: in [0, 2**63 - 1]; seeds this request's own ``torch.Generator`` so its samples do
            not depend on the other requests in the batch; ``None`` uses the engine's shared one.
        max_tokens: output tokens at most, in [1, 2**31 - 1]; ``None``: until ``max_model_len``.
        stop: stop string(s); the output text ends before the first occurrence
            (``finish_reason="stop"``, ``stop_reason`` = the string).
        stop_token_ids: token ids in [0, 2**63 - 1] that end the output (``stop_reason`` = the id).
        ignore_eos: keep generating after the model's EOS token(s).
        min_tokens: output tokens before EOS, ``stop_token_ids`` or a stop string may end the output,
            in [0, max_tokens]: until then EOS and the stop token ids are never sampled (their logits
            are ``-inf``) and stop strings are not looked for (vLLM's ``min_tokens``).
        min_p: in [0, 1]: drop tokens whose probability (after temperature) is below ``min_p`` times
            the most likely token's; 0 disables it.  Applied before top-k and top-p, as vLLM does.
        repetition_penalty: in (0, inf): a token that occurs in the prompt or the output so far has its
            logit divided by it when positive, multiplied when negative (CTRL, Keskar et al. 2019);
            1 disables it.
        frequency_penalty: in [-2, 2]: subtracted from a token's logit once per time it occurs in the
            output so far (OpenAI's definition); 0 disables it.
        presence_penalty: in [-2, 2]: subtracted from a token's logit if it occurs in the output so
            far; 0 disables it.
        logit_bias: ``{token_id: bias}``, biases in [-100, 100] added to the logits before sampling
            (ids inside the vocabulary: checked against the model when the request is added).
        include_stop_str_in_output: the output text keeps the stop string that ended it (and the
            text of a stop token), instead of ending right before it.
        skip_special_tokens: leave special tokens out of the output text.
        output_kind: a :class:`RequestOutputKind`: per-step outputs (default) or the final one only.
        detokenize: decode the output tokens into text (vLLM's ``detokenize``).  ``False``: outputs
            carry token ids only (``text`` stays ``""``) and ``stop`` must be empty; the server's engine
            core process runs so, its front process detokenizes and applies stop strings.
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
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True

    def __setattr__(self, name: str, value: object) -> None:
        # one spelling of a stop list, whether given to the constructor or assigned later
        # (``sp.stop = "the"``): a str becomes a one-element list, a list or tuple a list; any other
        # type is kept as given, for validate() to reject (a dict or set is not a list of stops)
        if name == "stop" and isinstance(value, str):
            value = [value]
        elif name in ("stop", "stop_token_ids") and isinstance(value, (list, tuple)):
            value = list(value)
        super().__setattr__(name, value)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every parameter; raises ``ValueError`` naming the first bad one, its value and the
        allowed range.  Integer bounds keep every value inside the torch dtype it ends up in
        (``top_k`` and ``n`` int32, ``seed`` and token ids int64), so no request can overflow a
        tensor constructor in the engine's step."""
        _check_int("n", self.n, 1, MAX_INT32)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_INT32):
            raise ValueError(f"top_k must be -1 or 0 (disabled) or an int in [1, {MAX_INT32}], "
                             f"got {self.top_k!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_INT64, "None or ")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, MAX_INT32, "None or ")
        if self.stop is not None and not isinstance(self.stop, list):
            raise ValueError(f"stop must be None, a str or a list of str, got a {type(self.stop).__name__}: "
                             f"{self.stop!r}")
        for s in self.stop or ():
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
            if _has_lone_surrogate(s):
                raise ValueError(f"stop strings must be Unicode text without lone UTF-16 surrogates, got {s!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be None or a list of ints, got a "
                             f"{type(self.stop_token_ids).__name__}: {self.stop_token_ids!r}")
        for tid in self.stop_token_ids or ():
            if not _is_int(tid) or not 0 <= tid <= MAX_INT64:
                raise ValueError(f"stop_token_ids must be ints in [0, {MAX_INT64}], got {tid!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens, 0, MAX_INT32)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True, high_open=True)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be None or a dict {{token_id: bias}}, got a "
                                 f"{type(self.logit_bias).__name__}: {self.logit_bias!r}")
            for tid, bias in self.logit_bias.items():
                if not _is_int(tid) or not 0 <= tid <= MAX_INT64:
                    raise ValueError(f"logit_bias keys must be token ids in [0, {MAX_INT64}], got {tid!r}")
                _check_float(f"logit_bias[{tid}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings need detokenize=True (got stop={self.stop!r} with detokenize=False); "
                             "apply them where the text is decoded")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind "
                             f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: argmax, no randomness."""
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """A repetition, frequency or presence penalty is on (the sampler keeps token counts)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Anything beyond temperature, top-k and top-p touches the logits: ``min_tokens``, ``min_p``,
        ``logit_bias`` or a penalty (the sampler's per-row logits processing)."""
        return bool(self.min_tokens or self.min_p or self.logit_bias or self.uses_penalties)

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or ())

    @property
    def effective_top_k(self) -> int:
        """``top_k``, with 0 for "disabled"."""
        return self.top_k if self.top_k > 0 else 0
