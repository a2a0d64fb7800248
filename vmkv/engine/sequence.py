"""Requests and their sequences.

A request (:class:`SequenceGroup`) has ``n`` completions.  Its first sequence (the parent) is
prefilled alone; when the prompt is done the group forks it into ``n`` sequences that share the
prompt's KV (``KVCache.fork``).  Everything about ``n > 1`` is decided by :class:`SequenceGroup`
(its "n > 1" section).  Each :class:`Sequence` moves through
``WAITING -> RUNNING -> FINISHED``; a running sequence can be preempted by recompute
(``PREEMPTED``: its KV is freed and it waits again, to recompute prompt + generated tokens).
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence as Seq

import torch

from vmkv.engine.errors import PromptTooLongError  # noqa: F401 (re-exported: its old home)
from vmkv.engine.detokenizer import DeltaTracker, OutputText
from vmkv.engine.outputs import CompletionOutput, ListPrefix, RequestMetrics, RequestOutput
from vmkv.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["SequenceStatus", "Sequence", "SequenceGroup", "PromptTooLongError"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # not yet admitted (no KV)
    RUNNING = "running"        # holds KV; prefilling or decoding
    PREEMPTED = "preempted"    # KV freed by recompute preemption; waits to recompute
    FINISHED = "finished"      # done (stop, length or abort); KV freed


def _mix_seed(seed: int, index: int) -> int:
    """Distinct, stable generator seeds for the n completions of one seeded request."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (2 ** 63)


class Sequence:
    """One completion: prompt + output tokens, compute progress, text state.

    Attributes:
        seq_id: the KV cache's sequence id (unique in the engine).
        index: which of the request's ``n`` completions.
        num_computed_tokens: leading tokens whose K/V is in the cache.
        output_token_ids: sampled tokens.
        text: decoded output (including any held-back tail).
        output_text_state: the :class:`~vmkv.engine.detokenizer.OutputText`, or ``None``.
    """

    def __init__(self, seq_id: int, group: "SequenceGroup", index: int) -> None:
        self.seq_id = seq_id
        self.group = group
        self.index = index
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self._reported = DeltaTracker()     # deltas start where the request's previous output ended
        self._finish_reported = False       # take_delta reported finish_reason
        params = group.params
        #: detokenization and stop strings (``None``: no tokenizer, or ``params.detokenize`` is off and
        #: whoever reads the token ids does both, as the server's front process does)
        self.output_text_state = (
            OutputText.for_params(group.tokenizer, group.prompt_token_ids, params)
            if group.tokenizer is not None and params.detokenize else None)

    # ------------------------------------------------------------------ tokens
    @property
    def prompt_len(self) -> int:
        return len(self.group.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return self.prompt_len + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def all_token_ids(self) -> list[int]:
        return self.group.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``start..end-1`` of prompt + output."""
        p = self.group.prompt_token_ids
        if end <= len(p):
            return p[start:end]
        out = self.output_token_ids
        if start >= len(p):
            return out[start - len(p):end - len(p)]
        return p[start:] + out[:end - len(p)]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def generator(self) -> torch.Generator | None:
        return self.group.generators[self.index]

    # ------------------------------------------------------------------ output
    def ends_by_length_after(self, num_tokens: int, max_model_len: int) -> bool:
        """Would ``num_tokens`` more tokens end this sequence by length (``max_tokens`` or
        ``max_model_len``)?  Stops by token or string are not predictable and not counted."""
        max_tokens = self.group.params.max_tokens
        return ((max_tokens is not None and len(self.output_token_ids) + num_tokens >= max_tokens)
                or self.num_tokens + num_tokens >= max_model_len)

    def append_token(self, token_id: int, eos_token_ids: Seq[int], max_model_len: int) -> None:
        """Add a sampled token; detokenize it and apply the stop conditions (vLLM order: EOS,
        stop token ids, length; a stop string found in the new text overrides ``length``).  Before
        ``min_tokens`` output tokens nothing but the length stops it (vLLM's ``check_stop``; the sampler
        does not draw EOS or a stop token id then, and ``OutputText`` does not look for stop strings)."""
        params = self.group.params
        self.output_token_ids.append(int(token_id))
        stopped_by_token = False
        may_stop = len(self.output_token_ids) >= params.min_tokens
        if may_stop and not params.ignore_eos and token_id in eos_token_ids:
            self.finish_reason, self.stop_reason, stopped_by_token = "stop", None, True
        elif may_stop and params.stop_token_ids and token_id in params.stop_token_ids:
            self.finish_reason, self.stop_reason, stopped_by_token = "stop", int(token_id), True
        elif (params.max_tokens is not None and len(self.output_token_ids) >= params.max_tokens) \
                or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
        if self.output_text_state is None or (stopped_by_token and not params.include_stop_str_in_output):
            return                      # a stop token's own text is not part of the output (unless asked)
        hit = self.output_text_state.add_token(token_id, final=self.finish_reason is not None)
        if hit is not None:
            self.finish_reason, self.stop_reason = "stop", hit

    @property
    def text(self) -> str:
        """Decoded output (including any held-back tail); ``""`` without detokenization."""
        return "" if self.output_text_state is None else self.output_text_state.text

    @property
    def output_text(self) -> str:
        """Emitted text: everything once finished, else without a possible stop-string start."""
        if self.output_text_state is None:
            return ""
        return self.output_text_state.emitted(self.finish_reason is not None)

    def take_delta(self) -> tuple[int, list[int], str | None, str | int | None] | None:
        """``(index, new_token_ids, finish_reason, stop_reason)`` since the previous call, or ``None``
        when nothing is new (no token, finish already reported): :meth:`SequenceGroup.to_delta`."""
        ids = self.output_token_ids[self._reported.num_tokens:]
        if not ids and (self.finish_reason is None or self._finish_reported):
            return None
        self._reported.num_tokens = len(self.output_token_ids)
        self._finish_reported = self.finish_reason is not None
        return self.index, ids, self.finish_reason, self.stop_reason

    def completion_output(self) -> CompletionOutput:
        """This completion's output now, with what is new since the previous call as the delta.
        Costs O(new tokens): the cumulative token ids are a :class:`ListPrefix` of the
        append-only ``output_token_ids``, not a copy."""
        return self._reported.output(self.index, self.output_text, self.output_token_ids,
                                     self.finish_reason, self.stop_reason)


class SequenceGroup:
    """A request: its prompt, parameters, ``n`` sequences and metrics.

    Args:
        request_id: caller's id.
        prompt: prompt text or ``None``.
        prompt_token_ids: the prompt's token ids (non-empty).
        params: sampling parameters.
        tokenizer: for detokenization (``None``: no text).
        arrival_time: ``time.perf_counter()`` seconds.
        device: where per-request ``torch.Generator``s live (the logits' device).
        cache_salt: mixed into the prefix-cache key of every unit of this request (the KV cache's
            ``extra_key``): only requests with the same salt share cached prefixes; ``None``
            shares with other unsalted requests only.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, arrival_time: float, device: torch.device,
                 cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.cache_salt = cache_salt
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.admitted = False
        self.aborted = False
        #: why the request failed (``RequestOutput.error``), else None
        self.error: str | None = None
        self.seqs: list[Sequence] = []
        #: completions still to be created by fork once the parent's prompt is computed
        self.num_pending_forks = params.n - 1
        self.generators: list[torch.Generator | None] = [None] * params.n
        if params.seed is not None and not params.is_greedy:
            for i in range(params.n):
                g = torch.Generator(device=device)
                g.manual_seed(_mix_seed(params.seed, i))
                self.generators[i] = g

    @property
    def parent(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return self.num_pending_forks == 0 and all(s.is_finished for s in self.seqs)

    # ------------------------------------------------------------------ n > 1 (the one place)
    # The parent (index 0) is prefilled alone.  The step that computes its prompt's last token
    # samples one token per completion from the parent's logits row (each index with its own
    # generator); the parent keeps token 0 and :meth:`fork` makes the other completions, which
    # share the prompt's KV (``Scheduler.add_forked`` calls ``KVCache.fork``).  Until then the
    # pending completions hold seats, so the fork never waits for ``max_num_seqs``.

    def sample_indices(self, seq: Sequence) -> list[int]:
        """Completion indices whose token is sampled from ``seq``'s logits row in a step where it
        samples: its own, plus every pending completion's while ``seq`` is the parent."""
        if seq.index == 0 and self.num_pending_forks:
            return [0, *range(self.params.n - self.num_pending_forks, self.params.n)]
        return [seq.index]

    def num_seats(self, seq: Sequence) -> int:
        """Sequences (of ``max_num_seqs``) that ``seq`` holds: itself, plus the pending
        completions while it is the parent."""
        return 1 + (self.num_pending_forks if seq.index == 0 else 0)

    def cancel_forks(self) -> None:
        """The request ends (abort, failure, never fits): pending completions are never made."""
        self.num_pending_forks = 0

    def fork(self, parent: Sequence, child_tokens: list[int], new_seq_id: Callable[[], int],
             eos_token_ids: Seq[int], max_model_len: int) -> list[Sequence]:
        """Make the pending completions from ``parent``'s computed prompt, completion
        ``n - pending + i`` with first token ``child_tokens[i]`` (see :meth:`sample_indices`).

        Returns:
            the new sequences that did not finish on their first token: each needs a share of the
            parent's KV (``Scheduler.add_forked``).  Those that finished are ``FINISHED``.
        """
        assert len(child_tokens) == self.num_pending_forks, (
            f"request {self.request_id}: {len(child_tokens)} tokens for {self.num_pending_forks} forks")
        first_index = self.params.n - self.num_pending_forks
        self.num_pending_forks = 0
        running = []
        for offset, token in enumerate(child_tokens):
            child = Sequence(new_seq_id(), self, first_index + offset)
            self.seqs.append(child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.append_token(token, eos_token_ids, max_model_len)
            if child.finish_reason is not None:
                child.status = SequenceStatus.FINISHED
            else:
                running.append(child)
        return running

    @property
    def streams(self) -> bool:
        """Reported after every step that produced tokens (not ``RequestOutputKind.FINAL_ONLY``)."""
        return self.params.output_kind != RequestOutputKind.FINAL_ONLY

    # ------------------------------------------------------------------ output
    def to_delta(self) -> tuple:
        """What is new since the previous call, token ids only: ``(request_id, [(index, new_token_ids,
        finish_reason, stop_reason), ...], finished, num_cached_tokens, error)`` (the server's engine
        core sends it; its front turns it into a :class:`RequestOutput`).  Costs O(new tokens)."""
        comps = [d for d in (s.take_delta() for s in self.seqs) if d is not None]
        return self.request_id, comps, self.is_finished, self.num_cached_tokens, self.error

    def to_output(self) -> RequestOutput:
        """The request's output now: ``n`` completions by index (not yet forked ones empty), each
        with its delta since the previous call (call it once per reported output)."""
        by_index = {s.index: s.completion_output() for s in self.seqs}
        missing = "error" if self.error is not None else "abort" if self.aborted else None
        outs = [by_index.get(i) or CompletionOutput(index=i, text="", token_ids=[],
                                                    finish_reason=missing)
                for i in range(self.params.n)]
        m = self.metrics
        metrics = RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                 m.last_token_time, m.finished_time, ListPrefix(m.token_times))
        # prompt_token_ids is shared, not copied: treat it as read-only
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outs,
                             finished=self.is_finished, num_cached_tokens=self.num_cached_tokens,
                             metrics=metrics, error=self.error)
