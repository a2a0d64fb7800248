"""What the engine returns, in vLLM's shape (``vllm.RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vmkv.kvcache.base import CacheUsage

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "EngineStats"]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions.

    ``text`` and ``token_ids`` are cumulative and append-only across steps: each step's output
    extends the previous one.  Text that might be the start of a stop string is held back until
    it is known not to be one.

    Attributes:
        index: which of the ``n`` completions (0..n-1).
        text: the detokenized output so far.
        token_ids: output token ids so far (an EOS or stop token id that ended the output is
            included; its text is not).
        finish_reason: ``None`` while running; ``"stop"`` (EOS, stop string or stop token id),
            ``"length"`` (``max_tokens`` or ``max_model_len``), ``"abort"``, or ``"error"`` (an
            exception while processing the request failed it: see ``RequestOutput.error``).
        stop_reason: the stop string or stop token id that ended the output, else ``None``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
            the differences).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


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
