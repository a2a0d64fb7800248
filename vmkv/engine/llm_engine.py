"""``LLMEngine``: continuous batching over one KV-cache backend.

The engine knows only the :class:`~vmkv.kvcache.KVCache` interface; switching
``kv_backend="paged"`` to ``"vmem"`` changes nothing else.  A step is two lines::

    sched, result = self.steps.next()        # schedule (KV backed), model forward, sampling
    return self._update(sched, result)       # append tokens, stop checks, fork, free, outputs

(:class:`~vmkv.engine.async_scheduling.StepDriver`; with ``async_scheduling`` it launches the next
decode step before this one's tokens reach the host.)

Around it: the limits (``max_model_len``, the KV budget) are decided once, before anything is
built, by :func:`~vmkv.engine.resolved_config.resolve_config` (:attr:`LLMEngine.resolved`);
prompts and chat messages become validated token ids in :mod:`vmkv.engine.input_processor`;
unfinished and early-ended requests are kept by :mod:`vmkv.engine.request_table`; ``n > 1`` is
:class:`~vmkv.engine.sequence.SequenceGroup`'s business.  Each output carries what is new since
the request's previous output (:mod:`vmkv.engine.outputs`), so streaming costs O(new tokens).

Failure isolation ("a bad request is that request's failure, never the server's"): an exception in
a per-request stage (admission and KV backing, sampling, detokenization, stop checks, fork) fails that
request only; one in the batched ``prepare`` / forward fails that step's batch; one anywhere else in
:meth:`step` (an engine bug) fails every unfinished request.  A failed request is finished at once (KV
freed, ``RequestOutput.error``, ``finish_reason="error"``); only a fatal error
(:func:`vmkv.engine.errors.is_fatal_error`) propagates out of :meth:`step`.

Not thread-safe: one thread drives it (the server runs it on a background thread).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vmkv.engine.config import EngineConfig
from vmkv.engine.cuda_graphs import build_cuda_graphs
from vmkv.engine.errors import is_fatal_error
from vmkv.engine.input_processor import InputProcessor, check_cache_salt
from vmkv.engine.outputs import EngineStats, RequestOutput
from vmkv.engine.request_table import RequestTable
from vmkv.engine.resolved_config import ResolvedConfig, resolve_config
from vmkv.engine.async_scheduling import StepDriver
from vmkv.engine.runner import ModelRunner, StepResult
from vmkv.engine.sampler import Sampler
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.scheduler import Scheduler, SchedulerOutput, TimedAllocator
from vmkv.engine.sequence import PromptTooLongError, Sequence, SequenceGroup
from vmkv.engine.tensor_parallel import kv_cache_factory, load_engine_model
from vmkv.kvcache import KVCache, KVCacheSpec, create_kv_cache
from vmkv.model.loader import resolve_device, resolve_dtype

__all__ = ["LLMEngine", "PromptTooLongError", "check_cache_salt"]

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.005  #: seconds a step that could schedule nothing waits (KV memory held elsewhere)


class LLMEngine:
    """Continuous-batching engine (see the module docstring).

    Args:
        config: :class:`~vmkv.engine.config.EngineConfig`.
        loaded: an already loaded :class:`vmkv.model.LoadedModel` to use instead of loading
            ``config.model`` (tests, several engines on one model).
        progress: ``progress(stage, done, total)`` callback passed to ``vmkv.model.load_model``.
    Attributes:
        resolved: the :class:`~vmkv.engine.resolved_config.ResolvedConfig` it runs with
            (``max_model_len``, the KV budget, ...), decided once at construction.
        input_processor: tokenization, chat templates and request validation.
    Raises:
        ValueError: ``max_model_len`` above the model's context, or a KV budget that cannot hold
            one sequence of ``max_model_len`` tokens (the message says what to change).
    """

    def __init__(self, config: EngineConfig, *, loaded=None, progress=None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            loaded = self._load_model(progress)
        else:                                # a preloaded model decides where the engine runs
            self.device, self.dtype = loaded.device, loaded.dtype
        self.loaded = loaded
        self.model = loaded.model
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = str(getattr(loaded, "name", None) or config.model or config.random_weights)
        self.eos_token_ids = tuple(mc.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in self.eos_token_ids:
            self.eos_token_ids += (int(tok_eos),)
        self.kv_cache, self.resolved = self._build_kv_cache(mc.kv_spec(self.device, self.dtype))
        r = self.resolved
        self.input_processor = InputProcessor(self.tokenizer, mc, r.max_model_len,
                                              max_num_seqs=r.max_num_seqs, model_name=self.model_name)
        self.allocator = TimedAllocator(self.kv_cache)
        self.scheduler = Scheduler(config.scheduler, self.allocator, r.max_model_len, r.enable_prefix_caching)
        self.sampler = Sampler(config.seed, self.device)
        graphs = build_cuda_graphs(self.model, self.kv_cache, self.device, enforce_eager=config.enforce_eager,
                                   sizes=config.cuda_graph_sizes, max_num_seqs=r.max_num_seqs)
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.device,
                                  prefetch_tokens=r.prefetch_tokens, cuda_graphs=graphs,
                                  upcoming=self.scheduler.upcoming_admissions,
                                  num_waiting=self.scheduler.num_waiting,
                                  admission_len=self.scheduler.admission_len,
                                  eos_token_ids=self.eos_token_ids)
        self.requests = RequestTable(self.scheduler)
        self.steps = StepDriver(self.scheduler, self.runner, self.requests, self.device,
                                ahead=config.async_scheduling)
        self._next_seq_id = 0
        self._num_steps = 0
        self._step_time_s_total = 0.0
        self._last_step_time_s = 0.0
        self._max_concurrent_seqs = 0
        self._num_prompt_tokens_total = 0
        self._num_generation_tokens_total = 0
        logger.info("engine ready: model %s on %s (%s)", self.model_name, self.device, self.dtype)

    @classmethod
    def from_args(cls, model: str | None = None, kv_backend: str = "paged", device: str | None = None,
                  dtype: str | None = None, **knobs: Any) -> "LLMEngine":
        """Build from flat knobs (fields of CacheConfig, SchedulerConfig and EngineConfig)."""
        return cls(EngineConfig.from_args(model, kv_backend, device, dtype, **knobs))

    @property
    def max_model_len(self) -> int:
        """Positions per sequence (prompt + output): ``resolved.max_model_len``."""
        return self.resolved.max_model_len

    @property
    def _groups(self) -> dict[str, SequenceGroup]:
        """Unfinished requests by id (``requests.groups``)."""
        return self.requests.groups

    # ------------------------------------------------------------------ construction helpers
    def _load_model(self, progress):   # tensor_parallel_size > 1: rank 0's shard, the workers started
        return load_engine_model(self.config, self.device, self.dtype, progress)

    def _build_kv_cache(self, spec: KVCacheSpec) -> tuple[KVCache, ResolvedConfig]:
        """Resolve the limits, build the KV cache once, and fit the limits to the units it holds
        (:meth:`ResolvedConfig.fit_to_capacity`); the cache is closed if they do not fit."""
        cc = self.config.cache
        on_cuda = self.device.type == "cuda" and cc.memory_bytes is None
        free = torch.cuda.mem_get_info(self.device)[0] if on_cuda else None
        resolved = resolve_config(self.config, self.model_config, spec, device_type=self.device.type,
                                  free_memory_bytes=free)
        kv_cache = kv_cache_factory(self.config, self.model, create_kv_cache)(   # TP: every rank's
            cc.backend, spec, max_num_seqs=resolved.max_num_seqs, max_model_len=resolved.max_model_len,
            memory_bytes=resolved.kv_memory_bytes, options=cc.backend_options())
        try:
            usage = kv_cache.usage()
            resolved = resolved.fit_to_capacity(usage.free_tokens, usage.capacity_bytes)
        except BaseException:
            kv_cache.close()
            raise
        logger.info("KV cache: %s backend, %s", cc.backend, resolved)
        return kv_cache, resolved

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    *, cache_salt: str | None = None) -> None:
        """Queue a request (validated and tokenized by :attr:`input_processor`).

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized with the model's tokenizer) or ``None`` when
                ``prompt_token_ids`` is given (the ids win when both are).
            params: sampling parameters (validated again here).
            arrival_time: ``time.perf_counter()`` seconds; default now.
            cache_salt: a non-empty string mixed into the prefix-cache key (vLLM's ``cache_salt``):
                the request reuses cached prefixes only of requests with the same salt, so
                tenants with different salts never share KV.  ``None``: no salt.
        Raises:
            PromptTooLongError: the prompt has ``>= max_model_len`` tokens.
            ValueError: empty prompt, duplicate id, token ids outside the vocabulary, stop
                strings without a tokenizer, a ``cache_salt`` that is not a non-empty str.
        """
        if request_id in self.requests.groups:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        req = self.input_processor.process(prompt, params, prompt_token_ids, cache_salt)
        group = SequenceGroup(request_id, req.prompt, req.prompt_token_ids, req.params, self.tokenizer,
                              time.perf_counter() if arrival_time is None else arrival_time,
                              self.device, cache_salt=req.cache_salt)
        group.seqs.append(Sequence(self._new_seq_id(), group, 0))
        self.requests.add(group)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def abort_request(self, request_id: str) -> None:
        """Finish a request with ``"abort"`` and free its KV now; unknown/finished ids are ignored.
        The aborted request is reported by the next :meth:`step`."""
        self.requests.abort(request_id)

    def finish_sequence(self, request_id: str, index: int, stop_reason: str | int | None = None) -> None:
        """Finish completion ``index`` of ``request_id`` with ``"stop"`` and free its KV now (a stop
        string found outside the engine, with ``SamplingParams.detokenize=False``); ignored for
        unknown or finished ones.  A request whose last completion this was is reported by the
        next :meth:`step`."""
        self.requests.finish_sequence(request_id, index, stop_reason)

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or finished ones not yet reported by :meth:`step`."""
        return bool(self.requests.groups) or self.requests.has_unreported

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def idle(self) -> None:
        """Between requests (no step to run): idle KV memory may go back (``kv_cache.release_idle``)."""
        self.runner.idle()

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (``input_processor.encode``: checks and raises there)."""
        return self.input_processor.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation (``input_processor.apply_chat_template``)."""
        return self.input_processor.apply_chat_template(messages)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; outputs of every request that produced tokens or finished
        (failed requests included: see the module docstring).

        Raises:
            only fatal errors (:func:`vmkv.engine.errors.is_fatal_error`).
        """
        return [g.to_output() for g in self._step()]

    def step_deltas(self) -> list[tuple]:
        """:meth:`step` in its lightest form (the server's engine core sends this): per request that
        produced tokens or finished, ``SequenceGroup.to_delta()``, i.e. ``(request_id, [(index,
        new_token_ids, finish_reason, stop_reason), ...], finished, num_cached_tokens, error)``; no
        text, no ``RequestOutput`` objects.  Use one of the two per engine."""
        return [g.to_delta() for g in self._step()]

    def _step(self) -> list[SequenceGroup]:
        t0 = time.perf_counter()
        try:
            sched, result = self.steps.next()      # schedule + run (or the step planned ahead)
            touched = self._update(sched, result)
            self.steps.drop_if_done()
            if sched.is_empty and not touched and self.scheduler.waiting:
                time.sleep(IDLE_WAIT_S)     # nothing could run (memory held elsewhere): no spinning
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.exception("engine step failed outside any request's stage; failing every "
                             "unfinished request")
            touched = self.requests.fail_all(exc)
        self._last_step_time_s = time.perf_counter() - t0
        self._step_time_s_total += self._last_step_time_s
        return touched

    def _update(self, sched: SchedulerOutput, result: StepResult) -> list[SequenceGroup]:
        now = time.perf_counter()
        touched: dict[str, SequenceGroup] = {}
        for group in sched.ignored:
            self.requests.finish_never_fits(group, now)
            touched[group.request_id] = group
        if not sched.is_empty:
            self._num_steps += 1
            self._max_concurrent_seqs = max(self._max_concurrent_seqs, len(self.scheduler.running))
        for s in sched.scheduled:
            group = s.seq.group
            if group.error is not None or s.seq.is_finished:
                continue                # failed in this step, or finished while its step ran ahead
            try:     # FINAL_ONLY requests are reported when they finish (take_unreported)
                if self._update_seq(s, result.sampled.get(s.seq.seq_id), now) and (
                        group.streams or group.is_finished):
                    touched[group.request_id] = group
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                self.requests.fail(group, "output processing (detokenization, stop checks, fork)", exc)
        for group in self.requests.take_unreported():   # aborted between steps or failed in this one
            touched.setdefault(group.request_id, group)
        return list(touched.values())

    def _update_seq(self, s, tokens: list[int] | None, now: float) -> bool:
        """Apply one scheduled sequence's result; returns whether it produced tokens."""
        seq, group = s.seq, s.seq.group
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = now
        if s.is_prefill:
            self._num_prompt_tokens_total += s.num_new_tokens
        if not tokens:
            return False
        if len(tokens) > 1:             # n > 1: the parent's first sample makes the others
            for child in group.fork(seq, tokens[1:], self._new_seq_id, self.eos_token_ids,
                                    self.max_model_len):
                self.scheduler.add_forked(seq, child)
            self._num_generation_tokens_total += len(tokens) - 1
        self._append(seq, tokens[0])
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        if not group.metrics.token_times or group.metrics.token_times[-1] != now:
            group.metrics.token_times.append(now)
        if group.is_finished:
            self.requests.finish(group, now)
        return True

    def _append(self, seq: Sequence, token: int) -> None:
        self._num_generation_tokens_total += 1
        seq.append_token(token, self.eos_token_ids, self.max_model_len)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    # ------------------------------------------------------------------ introspection
    def get_stats(self) -> EngineStats:
        usage = self.kv_cache.usage()
        running = self.scheduler.running
        return EngineStats(
            num_running=len({s.group.request_id for s in running}),
            num_waiting=len({s.group.request_id for s in self.scheduler.waiting} -
                            {s.group.request_id for s in running}),
            num_preempted_total=self.scheduler.num_preempted_total,
            kv_usage=usage,
            prefix_hit_rate=usage.prefix_hit_rate,
            num_steps=self._num_steps,
            step_time_s_total=self._step_time_s_total,
            alloc_time_s_total=self.allocator.time_s,
            alloc_ahead_time_s_total=self.allocator.ahead_time_s,
            last_step_time_s=self._last_step_time_s,
            max_concurrent_seqs=self._max_concurrent_seqs,
            num_running_seqs=len(running),
            num_prefill_chunks_total=self.scheduler.num_prefill_chunks_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
            num_generation_tokens_total=self._num_generation_tokens_total,
            num_cached_tokens_total=self.scheduler.num_cached_tokens_total,
            num_finished_total=self.requests.num_finished_total,
            num_failed_total=self.requests.num_failed_total,
            prefetch_time_s_total=self.runner.prefetch_time_s_total, **self.runner.graph_stats(),
            num_ahead_steps_total=self.steps.num_ahead_steps,
            reserved_unused_bytes=self.scheduler.reserved_unused_tokens() * self.kv_cache.spec.bytes_per_token,
            num_reservation_overruns=self.scheduler.num_reservation_overruns)

    def close(self) -> None:
        """Release the KV cache's memory (the engine is unusable afterwards)."""
        self.steps.drain()
        self.kv_cache.close()

