"""The front process's half of output processing: token ids from the engine core become text, stop
strings are applied, and each request's :class:`~vmkv.engine.outputs.RequestOutput` is built with its
deltas (vLLM v1's ``output_processor.py``).

The engine core runs every request with ``SamplingParams.detokenize=False`` and no stop strings: it stops
on EOS, stop token ids and length only.  Here each completion keeps an
:class:`~vmkv.engine.detokenizer.OutputText` (the same detokenization and stop-string code the in-process
engine runs) and a :class:`~vmkv.engine.detokenizer.DeltaTracker`.  A stop string found here finishes the
completion at once (tokens the core made after it are dropped) and is returned to the caller, which tells
the core to free that completion's KV (``FinishSequences``).  Token for token, a request ends as it would
in-process: the output holds the token that completed the stop string, the text ends before it.

Timestamps (``RequestMetrics``) are taken here, when a step's message arrives: what a client of this
process sees, including the IPC hop.
"""

from __future__ import annotations

import time
from typing import Any

from vmkv.engine.detokenizer import DeltaTracker, OutputText
from vmkv.engine.outputs import CompletionOutput, ListPrefix, RequestMetrics, RequestOutput

__all__ = ["RequestState"]


class _Completion:
    __slots__ = ("index", "token_ids", "text", "finish_reason", "stop_reason", "reported")

    def __init__(self, index: int, text: OutputText | None) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text = text
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.reported = DeltaTracker()

    def add(self, token_ids: list[int], finish_reason: str | None, stop_reason: str | int | None) -> str | None:
        """Apply one step's news from the core; returns the stop string that finished it here, if any."""
        if self.finish_reason is not None:
            return None                          # finished here already: the core's late tokens go
        last = len(token_ids) - 1
        for k, token in enumerate(token_ids):
            self.token_ids.append(int(token))
            final = k == last and finish_reason is not None
            if final:
                self.finish_reason, self.stop_reason = finish_reason, stop_reason
            if self.text is None or (final and finish_reason == "stop" and not self.text.include_stop_str):
                continue                         # the core stops by token only: that token has no text
                                                 # (unless include_stop_str_in_output asks for it)
            hit = self.text.add_token(token, final=final)
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit
                return hit
        if not token_ids and finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return None

    def output(self) -> CompletionOutput:
        text = "" if self.text is None else self.text.emitted(self.finish_reason is not None)
        return self.reported.output(self.index, text, self.token_ids, self.finish_reason, self.stop_reason)


class RequestState:
    """One request's output state in the front.

    Args:
        request_id: the engine request id.
        prompt: prompt text or ``None``.
        prompt_token_ids: the prompt's ids (decoding context).
        params: the request's own ``SamplingParams`` (with its stop strings; ``n`` completions).
        tokenizer: decodes the output (``None``: token ids only).
        arrival_time: ``time.perf_counter()`` seconds.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any,
                 tokenizer: Any, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.n = int(params.n)
        detok = tokenizer is not None and params.detokenize
        self.completions = [
            _Completion(i, OutputText.for_params(tokenizer, prompt_token_ids, params) if detok else None)
            for i in range(self.n)]
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        for c in self.completions:
            if c.finish_reason is None:
                return False
        return True

    def update(self, delta: Any, now: float | None = None) -> tuple[RequestOutput | None, list[tuple[int, str]]]:
        """Apply one :class:`~vmkv.server.core_protocol.RequestDelta`.

        Returns:
            ``(output, stops)``: the request's output with what is new (``None`` if nothing is), and the
            ``(index, stop_string)`` of completions a stop string finished here (the core must free them).
        """
        now = time.perf_counter() if now is None else now
        if self.finished:
            return None, []
        self.num_cached_tokens = delta.num_cached_tokens
        stops: list[tuple[int, str]] = []
        produced = False
        for c in delta.completions:
            comp = self.completions[c.index]
            if comp.finish_reason is not None:
                continue
            produced = produced or bool(c.token_ids)
            hit = comp.add(c.token_ids, c.finish_reason, c.stop_reason)
            if hit is not None:
                stops.append((c.index, hit))
        if delta.error is not None and self.error is None:
            self.error = delta.error
            for comp in self.completions:
                if comp.finish_reason is None:
                    comp.finish_reason = "error"
        if delta.finished:                      # the core is done with it: whatever is left has ended
            for comp in self.completions:
                if comp.finish_reason is None:
                    comp.finish_reason = "abort"
        m = self.metrics
        if produced:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.token_times.append(now)
        finished = self.finished
        if finished:
            m.finished_time = now
        if not produced and not finished:
            return None, stops
        return self.output(), stops

    def abort(self, now: float | None = None) -> RequestOutput:
        """Finish every unfinished completion with ``"abort"`` (the client left); the final output."""
        for comp in self.completions:
            if comp.finish_reason is None:
                comp.finish_reason = "abort"
        if self.metrics.finished_time is None:
            self.metrics.finished_time = time.perf_counter() if now is None else now
        return self.output()

    def output(self) -> RequestOutput:
        """The request's output now, with its deltas since the previous call."""
        m = self.metrics
        metrics = RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                                 m.finished_time, ListPrefix(m.token_times))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[c.output() for c in self.completions], finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens, metrics=metrics, error=self.error)
