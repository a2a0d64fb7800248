"""Straightforward float64 pure-Python references of the sampler's logits processing (one row, element by
element), shared by the sampler tests and the engine tests that check tokens against them."""

from __future__ import annotations

import math

from vmkv.engine.logits_processing import LogitsProcessing

NEG = float("-inf")


def ref_process(logits: list[float], proc: LogitsProcessing | None, prompt: list[int], output: list[int]) -> list[float]:
    """min_tokens suppression, logit_bias, then vLLM's penalties, one row, element by element."""
    out = [float(x) for x in logits]
    if proc is None:
        return out
    vocab = len(out)
    for t in proc.suppress_token_ids:
        if 0 <= t < vocab:
            out[t] = NEG
    for t, b in (proc.logit_bias or {}).items():
        if 0 <= t < vocab:
            out[t] += b
    if not proc.uses_penalties:
        return out
    for t in range(vocab):
        count = output.count(t)
        if t in prompt or count:
            out[t] = out[t] / proc.repetition_penalty if out[t] > 0 else out[t] * proc.repetition_penalty
        out[t] -= proc.frequency_penalty * count
        out[t] -= proc.presence_penalty * (1.0 if count else 0.0)
    return out


def ref_probs(logits: list[float], temperature: float, min_p: float, top_k: int, top_p: float) -> list[float]:
    """temperature, then min_p, top-k, top-p (vLLM v1 order), softmax: one row in float64."""
    x = [v / temperature for v in logits]
    vocab = len(x)

    def softmax(v: list[float]) -> list[float]:
        m = max(v)
        e = [math.exp(a - m) if a != NEG else 0.0 for a in v]
        s = sum(e)
        return [a / s for a in e]

    if min_p > 0:
        p = softmax(x)
        thr = max(p) * min_p
        x = [NEG if p[i] < thr else x[i] for i in range(vocab)]
    if 0 < top_k < vocab:
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [NEG if v < kth else v for v in x]
    if top_p < 1.0:
        p = softmax(x)
        order = sorted(range(vocab), key=lambda i: -p[i])
        mass, keep = 0.0, set()
        for rank, i in enumerate(order):
            if rank == 0 or mass < top_p:
                keep.add(i)
            mass += p[i]
        x = [x[i] if i in keep else NEG for i in range(vocab)]
    return softmax(x)
