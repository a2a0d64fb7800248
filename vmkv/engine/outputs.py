"""What the engine returns, in vLLM's shape (``vllm.RequestOutput``), with per-step deltas.

Streaming without O(L^2) copies: a request's output after each step carries what is new since its
previous output (``CompletionOutput.delta_text`` / ``delta_token_ids``, O(new tokens)), and its
cumulative fields are snapshots of the engine's append-only lists that are copied only when read
(``token_ids``, ``RequestMetrics.token_times``): a consumer that streams the deltas and reads the
cumulative fields once at the end copies O(L) token ids over a request of L tokens.
:func:`merge_outputs` folds several outputs of one request into one (a consumer that fell behind).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # torch-free at run time: the server's stream merges outputs without the model stack
    from vmkv.kvcache.base import CacheUsage

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "EngineStats", "merge_outputs"]


class ListPrefix:
    """The first ``length`` items of an append-only list, as of now; copied only by :meth:`to_list`.

    The engine's output token ids and token times only ever grow, so a prefix of them stays what it
    was when taken: an O(1) snapshot.
    """

    __slots__ = ("source", "length")

    def __init__(self, source: list, length: int | None = None) -> None:
        self.source = source
        self.length = len(source) if length is None else length

    def to_list(self) -> list:
        return self.source[:self.length]


def _lazy_list(name: str) -> property:
    """A dataclass field stored as a list or a :class:`ListPrefix`, read as a list (copied once)."""
    slot = "_" + name

    def get(self) -> list:
        value = self.__dict__[slot]
        if isinstance(value, ListPrefix):
            value = self.__dict__[slot] = value.to_list()
        return value

    def set(self, value) -> None:
        self.__dict__[slot] = value if isinstance(value, (list, ListPrefix)) else list(value)

    return property(get, set, doc=f"``{name}`` as a list (a snapshot taken by the engine is copied on "
                                  "first read)")


@dataclass(eq=True)
class CompletionOutput:
    """One of a request's ``n`` completions.

    ``text`` and ``token_ids`` are cumulative and append-only across steps: each step's output
    extends the previous one.  ``delta_text`` and ``delta_token_ids`` are what is new since this
    request's previous output (so the deltas of all its outputs, concatenated, are ``text`` and
    ``token_ids`` of the last one).  Text that might be the start of a stop string is held back
    until it is known not to be one.

    Attributes:
        index: which of the ``n`` completions (0..n-1).
        text: the detokenized output so far.
        token_ids: output token ids so far (an EOS or stop token id that ended the output is
            included; its text is not).  The engine passes a :class:`ListPrefix` that is copied
            into a list on first read, so outputs nobody reads cost nothing.
        finish_reason: ``None`` while running; ``"stop"`` (EOS, stop string or stop token id),
            ``"length"`` (``max_tokens`` or ``max_model_len``), ``"abort"``, or ``"error"`` (an
            exception while processing the request failed it: see ``RequestOutput.error``).
        stop_reason: the stop string or stop token id that ended the output, else ``None``.
        delta_text: text new since the request's previous output.
        delta_token_ids: token ids new since the request's previous output.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# after @dataclass, so that the generated __init__ / __eq__ / __repr__ go through the property
CompletionOutput.token_ids = _lazy_list("token_ids")  # type: ignore[assignment]


@dataclass
class RequestMetrics:
    """Timestamps of one request, ``time.perf_counter()`` seconds.

    Attributes:
        arrival_time: when the request was added.
        first_scheduled_time: first step that computed any of its tokens (None before).
        first_token_time: first output token sampled (TTFT = this - arrival_time).
        last_token_time: latest output token.
        finished_time: when it finished (None while running).
        token_times: one entry per step that produced output tokens (inter-token latencies are
            the differences); a snapshot copied on first read, like ``CompletionOutput.token_ids``.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


RequestMetrics.token_times = _lazy_list("token_times")  # type: ignore[assignment]


@dataclass
class RequestOutput:
    """A request's state after a step.

    Attributes:
        request_id: as given to ``add_request``.
        prompt: the prompt text (``None`` if given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: ``n`` :class:`CompletionOutput`, by index.
        finished: every completion has finished.
        num_cached_tokens: prompt tokens found in the prefix cache at first admission (not
            recomputed).
        metrics: :class:`RequestMetrics`.
        error: ``None``, or why the request failed: an exception while processing it (KV
            allocation, sampling, detokenization, stop checks, fork) or in the forward of a batch
            it was part of.  A failed request is finished, its KV freed, and every completion that
            had not finished has ``finish_reason="error"``; the engine keeps serving the others.
            (Over :class:`~vmkv.server.async_engine.AsyncEngine`, iterating the request's stream
            raises :class:`~vmkv.engine.errors.RequestFailedError` instead.)
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One output of a request equivalent to receiving ``outputs`` in order: the last one, with the
    deltas of all of them concatenated per completion (a stream consumer that fell behind).
    Costs O(the deltas); the cumulative fields are the last output's, not copied."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    for out in outputs:
        for c in out.outputs:
            texts.setdefault(c.index, []).append(c.delta_text)
            ids.setdefault(c.index, []).extend(c.delta_token_ids)
    merged = [CompletionOutput(c.index, c.text, c.__dict__["_token_ids"], c.finish_reason, c.stop_reason,
                               delta_text="".join(texts[c.index]), delta_token_ids=ids[c.index])
              for c in last.outputs]
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, merged, last.finished,
                         last.num_cached_tokens, last.metrics, last.error)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (``LLMEngine.get_stats``).

    Attributes:
        num_running: requests with a sequence running (holding KV).
        num_waiting: requests waiting for admission (new or preempted).
        num_preempted_total: recompute preemptions so far (one per sequence preempted).
        kv_usage: the KV cache's :class:`~vmkv.kvcache.CacheUsage`.
        prefix_hit_rate: prompt tokens found in the prefix cache / prompt tokens looked up.
        num_steps: steps that ran the model.
        step_time_s_total, last_step_time_s: wall time of ``step()``, seconds.
        alloc_time_s_total: seconds spent in the cache's allocate/extend/fork/free.
        alloc_ahead_time_s_total: the part of ``alloc_time_s_total`` spent scheduling a step ahead
            (async scheduling), while the device ran the previous step: off the critical path.
        prefetch_time_s_total: seconds spent in the cache's ``prefetch`` (off the critical path:
            it overlaps the GPU's forward; not part of ``alloc_time_s_total``).
        max_concurrent_seqs: most sequences running in one step so far.
        num_running_seqs: sequences running now (n > 1 requests count n).
        num_prefill_chunks_total: prefill passes that did not reach the end of the prompt
            (chunked prefill happened when > 0).
        num_prompt_tokens_total, num_generation_tokens_total: tokens computed by the model as
            prompt (including recomputation) and tokens sampled.
        num_cached_tokens_total: prompt tokens skipped thanks to the prefix cache.
        num_finished_total: requests finished (any reason).
        num_failed_total: requests failed by an exception (``finish_reason="error"``).
        num_cuda_graph_steps_total: steps replayed from a captured CUDA graph (decode only).
        cuda_graph_capture_s, cuda_graph_memory_bytes: start-up capture time and the device memory
            the graphs took (0 when eager: CPU, ``enforce_eager``, or a cache that cannot be captured).
        num_ahead_steps_total: steps launched before the previous step's tokens reached the host
            (``async_scheduling``).
        reserved_unused_bytes: KV bytes of positions backed for running sequences that no scheduled
            step has written yet (static reservation's reserved-but-unused memory,
            ``Scheduler.reserved_unused_tokens`` x bytes per token; the cache's ``waste_bytes`` counts
            only unit tails beyond the backed positions).
        num_reservation_overruns: extensions of a reserved sequence past its reservation (always 0).
    """

    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_usage: CacheUsage
    prefix_hit_rate: float
    num_steps: int
    step_time_s_total: float
    alloc_time_s_total: float
    last_step_time_s: float
    max_concurrent_seqs: int
    num_running_seqs: int = 0
    num_prefill_chunks_total: int = 0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_cached_tokens_total: int = 0
    num_finished_total: int = 0
    prefetch_time_s_total: float = 0.0
    num_failed_total: int = 0
    num_cuda_graph_steps_total: int = 0
    cuda_graph_capture_s: float = 0.0
    cuda_graph_memory_bytes: int = 0
    num_ahead_steps_total: int = 0
    alloc_ahead_time_s_total: float = 0.0
    reserved_unused_bytes: int = 0
    num_reservation_overruns: int = 0
