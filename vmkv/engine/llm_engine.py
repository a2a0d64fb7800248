"""``LLMEngine``: continuous batching over one KV-cache backend.

The engine knows only the :class:`~vmkv.kvcache.KVCache` interface; switching
``kv_backend="paged"`` to ``"vmem"`` changes nothing else.  A step is three lines::

    sched = self.scheduler.schedule()        # who runs, how many tokens; KV backed
    result = self._execute(sched)            # tensors, model forward, sampling
    return self._update(sched, result)       # append tokens, stop checks, fork, free, outputs

Failure isolation ("a bad request is that request's failure, never the server's"):

- an exception in a per-request stage fails that request only: admission and KV backing
  (``SchedulerOutput.failed``), sampling (``StepResult.failed``), detokenization, stop checks
  and fork (caught per request in :meth:`_update`);
- an exception in the batched ``prepare`` / forward fails the requests of that step's batch;
- an unexpected exception anywhere else in :meth:`step` (an engine bug that cannot be
  attributed) fails every unfinished request, which leaves the scheduler empty and consistent;
- a failed request is finished at once: its KV is freed, ``RequestOutput.error`` says what
  failed, unfinished completions get ``finish_reason="error"``; the engine serves the rest;
- only a fatal error (:func:`vmkv.engine.errors.is_fatal_error`: a sticky CUDA error that
  poisons the context, or a ``BaseException`` such as ``KeyboardInterrupt``) propagates out of
  :meth:`step`; the engine is unusable afterwards.

Not thread-safe: one thread drives it (the server runs it on a background thread).
"""

from __future__ import annotations

import logging
import operator
import time
from typing import Any

import torch

from vmkv.engine.config import DEFAULT_CPU_KV_MEMORY_BYTES, DEFAULT_MAX_MODEL_LEN, EngineConfig
from vmkv.engine.errors import check_device, is_fatal_error
from vmkv.engine.outputs import EngineStats, RequestOutput
from vmkv.engine.runner import ModelRunner, StepResult
from vmkv.engine.sampler import Sampler
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.scheduler import Scheduler, SchedulerOutput, TimedAllocator
from vmkv.engine.sequence import PromptTooLongError, Sequence, SequenceGroup, SequenceStatus
from vmkv.kvcache import create_kv_cache
from vmkv.model.loader import resolve_device, resolve_dtype

__all__ = ["LLMEngine", "PromptTooLongError", "check_cache_salt"]

logger = logging.getLogger(__name__)

class LLMEngine:
    """Continuous-batching engine (see the module docstring).

    Args:
        config: :class:`~vmkv.engine.config.EngineConfig`.
        loaded: an already loaded :class:`vmkv.model.LoadedModel` to use instead of loading
            ``config.model`` (tests, several engines on one model).
        progress: ``progress(stage, done, total)`` callback passed to ``vmkv.model.load_model``.
    Raises:
        ValueError: ``max_model_len`` above the model's context, or a KV budget that cannot hold
            one sequence of ``max_model_len`` tokens (the message says what to change).
    """

    def __init__(self, config: EngineConfig, *, loaded=None, progress=None) -> None:
        self.config = config
        self._progress = progress
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            loaded = self._load_model()
        else:                                # a preloaded model decides where the engine runs
            self.device, self.dtype = loaded.device, loaded.dtype
        self.loaded = loaded
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self._max_token_chars: int | None = None     # longest vocabulary entry, for _check_text_len
        self.model_name = str(getattr(loaded, "name", None) or config.model or config.random_weights)
        mc = self.model_config
        self.max_model_len = self._resolve_max_model_len()
        self.eos_token_ids = tuple(mc.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in self.eos_token_ids:
            self.eos_token_ids += (int(tok_eos),)
        cc, sc = config.cache, config.scheduler
        self.kv_cache = self._build_kv_cache(mc.kv_spec(self.device, self.dtype))
        self.allocator = TimedAllocator(self.kv_cache)
        self.scheduler = Scheduler(sc, self.allocator, self.max_model_len, cc.enable_prefix_caching)
        self.sampler = Sampler(config.seed, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.device,
                                  prefetch_tokens=cc.resolved_prefetch_tokens(self.device.type))
        self._groups: dict[str, SequenceGroup] = {}
        self._finished_unreported: list[SequenceGroup] = []
        self._next_seq_id = 0
        self._num_steps = 0
        self._step_time_s_total = 0.0
        self._last_step_time_s = 0.0
        self._max_concurrent_seqs = 0
        self._num_prompt_tokens_total = 0
        self._num_generation_tokens_total = 0
        self._num_finished_total = 0
        self._num_failed_total = 0
        logger.info("engine ready: model %s on %s (%s)", self.model_name, self.device, self.dtype)

    @classmethod
    def from_args(cls, model: str | None = None, kv_backend: str = "paged", device: str | None = None,
                  dtype: str | None = None, **knobs: Any) -> "LLMEngine":
        """Build from flat knobs (fields of CacheConfig, SchedulerConfig and EngineConfig)."""
        return cls(EngineConfig.from_args(model, kv_backend, device, dtype, **knobs))

    # ------------------------------------------------------------------ construction helpers
    def _load_model(self):
        from vmkv import model as model_pkg  # noqa: PLC0415  (heavy; imported on demand)

        if self.config.random_weights:
            return model_pkg.random_model(self.config.random_weights, device=str(self.device),
                                          dtype=self.dtype, seed=self.config.seed)
        return model_pkg.load_model(self.config.model, device=str(self.device), dtype=self.dtype,
                                    progress=self._progress)

    def _resolve_max_model_len(self) -> int:
        ctx = self.model_config.max_position_embeddings
        want = self.config.scheduler.max_model_len
        if want is None:
            return min(ctx, DEFAULT_MAX_MODEL_LEN)
        if want > ctx:
            raise ValueError(f"max_model_len={want} exceeds the model's context of {ctx} tokens; "
                             f"use a value in [1, {ctx}]")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < want:
            raise ValueError(f"max_num_batched_tokens={sc.max_num_batched_tokens} must be >= "
                             f"max_model_len={want} when chunked prefill is off")
        return want

    def _build_kv_cache(self, spec):
        """The KV cache for ``spec``; lowers a default ``max_model_len`` to what the budget holds."""
        cc, sc = self.config.cache, self.config.scheduler
        memory_bytes = self._resolve_memory_bytes(spec)
        fits = spec.max_tokens_for_bytes(memory_bytes)
        if sc.max_model_len is None and fits < self.max_model_len:
            logger.warning("KV budget of %d bytes holds %d tokens; lowering max_model_len from %d "
                           "to %d (give memory_bytes or max_model_len to choose)", memory_bytes,
                           fits, self.max_model_len, max(fits, 2))
            self.max_model_len = max(fits, 2)

        def build():
            return create_kv_cache(cc.backend, spec, max_num_seqs=sc.max_num_seqs,
                                   max_model_len=self.max_model_len, memory_bytes=memory_bytes,
                                   **cc.backend_options())

        kv_cache = build()
        free_tokens = kv_cache.usage().free_tokens
        if free_tokens < self.max_model_len and sc.max_model_len is None and free_tokens >= 2:
            kv_cache.close()                 # unit rounding: retry with what the backend holds
            self.max_model_len = free_tokens
            kv_cache = build()
            free_tokens = kv_cache.usage().free_tokens
        if free_tokens < self.max_model_len:
            cap = kv_cache.usage().capacity_bytes
            kv_cache.close()
            raise ValueError(
                f"the KV cache ({cap} bytes, {free_tokens} tokens) cannot hold one sequence of "
                f"max_model_len={self.max_model_len} tokens ({spec.kv_bytes(self.max_model_len)} "
                "bytes); raise memory_bytes / gpu_memory_utilization or lower max_model_len")
        logger.info("KV cache: %s backend, %d bytes, max_model_len %d", cc.backend, memory_bytes,
                    self.max_model_len)
        return kv_cache

    def _resolve_memory_bytes(self, spec) -> int:
        cc, sc = self.config.cache, self.config.scheduler
        most_useful = spec.kv_bytes(sc.max_num_seqs * self.max_model_len)
        if cc.memory_bytes is not None:
            return cc.memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cc.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_MEMORY_BYTES
        return max(1, min(budget, most_useful))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    *, cache_salt: str | None = None) -> None:
        """Queue a request.

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
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        check_cache_salt(cache_salt)
        params.validate()
        if prompt_token_ids is None:
            if prompt is None or prompt == "":
                raise ValueError("prompt is empty: give a non-empty prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        prompt_token_ids = _token_ids(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError("prompt is empty: prompt_token_ids must hold at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_token_ids), self.max_model_len)
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.scheduler.max_num_seqs}; "
                             "lower n or raise max_num_seqs")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        group = SequenceGroup(request_id, prompt, prompt_token_ids, params, self.tokenizer,
                              time.perf_counter() if arrival_time is None else arrival_time,
                              self.device, cache_salt=cache_salt)
        group.seqs.append(Sequence(self._new_seq_id(), group, 0))
        self._groups[request_id] = group
        self.scheduler.add(group)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def abort_request(self, request_id: str) -> None:
        """Finish a request with ``"abort"`` and free its KV now; unknown/finished ids are ignored.
        The aborted request is reported by the next :meth:`step`."""
        group = self._groups.get(request_id)
        if group is None or group.is_finished:
            return
        group.aborted = True
        group.num_pending_forks = 0
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.drop(seq)        # never raises for a free that fails (logged)
                seq.finish_reason = "abort"
        self._finish_group(group, time.perf_counter())
        self._finished_unreported.append(group)

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or finished ones not yet reported by :meth:`step`."""
        return bool(self._groups) or bool(self._finished_unreported)

    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; outputs of every request that produced tokens or finished
        (failed requests included: see the module docstring).

        Raises:
            only fatal errors (:func:`vmkv.engine.errors.is_fatal_error`).
        """
        t0 = time.perf_counter()
        try:
            sched = self.scheduler.schedule()
            result = self._execute(sched)
            outputs = self._update(sched, result)
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            logger.exception("engine step failed outside any request's stage; failing every "
                             "unfinished request")
            outputs = self._fail_all(exc)
        self._last_step_time_s = time.perf_counter() - t0
        self._step_time_s_total += self._last_step_time_s
        return outputs

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """Fail the requests the scheduler could not back, run the rest; a failed forward fails
        the requests of the batch."""
        for seq, exc in sched.failed:
            self._fail_group(seq.group, "KV allocation", exc)
        if sched.failed:
            sched.scheduled = [s for s in sched.scheduled if not s.seq.is_finished]
        if sched.is_empty:
            return StepResult()
        try:
            result = self.runner.execute(sched)
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            try:
                check_device(self.device)       # an asynchronous kernel error surfaces here
            except Exception as sync_exc:
                raise sync_exc from exc
            logger.exception("model forward failed; failing the %d request(s) of the batch",
                             len({s.seq.group.request_id for s in sched.scheduled}))
            for s in sched.scheduled:
                self._fail_group(s.seq.group, "the model forward of its batch", exc)
            return StepResult()
        for seq, exc in result.failed:
            self._fail_group(seq.group, "sampling", exc)
        return result

    def _update(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.perf_counter()
        touched: dict[str, SequenceGroup] = {}
        for group in sched.ignored:
            group.num_pending_forks = 0
            for seq in group.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason = "length"
            self._finish_group(group, now)
            touched[group.request_id] = group
        if not sched.is_empty:
            self._num_steps += 1
            self._max_concurrent_seqs = max(self._max_concurrent_seqs, len(self.scheduler.running))
        for s in sched.scheduled:
            group = s.seq.group
            if group.error is not None:
                continue                                # failed earlier in this step
            try:
                if self._update_seq(s, result.sampled.get(s.seq.seq_id), now):
                    touched[group.request_id] = group
            except Exception as exc:
                if is_fatal_error(exc):
                    raise
                self._fail_group(group, "output processing (detokenization, stop checks, fork)", exc)
        for group in self._finished_unreported:         # aborted between steps or failed in this one
            touched.setdefault(group.request_id, group)
        self._finished_unreported = []
        return [g.to_output() for g in touched.values()]

    def _update_seq(self, s, tokens: list[int] | None, now: float) -> bool:
        """Apply one scheduled sequence's result; returns whether it produced tokens."""
        seq, group = s.seq, s.seq.group
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = now
        if s.is_prefill:
            self._num_prompt_tokens_total += s.num_new_tokens
        if not tokens:
            return False
        if seq.index == 0 and group.num_pending_forks:
            self._fork(seq, tokens[1:])
        self._append(seq, tokens[0])
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        if not group.metrics.token_times or group.metrics.token_times[-1] != now:
            group.metrics.token_times.append(now)
        if group.is_finished:
            self._finish_group(group, now)
        return True

    def _fail_group(self, group: SequenceGroup, stage: str, exc: BaseException) -> None:
        """Fail ``group`` because ``exc`` was raised in ``stage``: drop every sequence (KV freed),
        mark unfinished completions ``"error"``; reported by this step (``RequestOutput.error``)."""
        if group.error is not None or group.metrics.finished_time is not None:
            return
        group.error = f"request {group.request_id} failed in {stage}: {type(exc).__name__}: {exc}"
        logger.warning("%s", group.error)
        group.num_pending_forks = 0
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.drop(seq)
                seq.finish_reason = "error"
            elif seq.finish_reason is None:             # dropped by the scheduler
                seq.finish_reason = "error"
        self._num_failed_total += 1
        self._finish_group(group, time.perf_counter())
        self._finished_unreported.append(group)

    def _fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Last resort for an exception no request can be blamed for: fail every unfinished
        request, so the scheduler is empty and consistent again, and report them all."""
        for group in list(self._groups.values()):
            try:
                self._fail_group(group, "an engine step that failed outside any request's stage", exc)
            except Exception as drop_exc:
                if is_fatal_error(drop_exc):
                    raise
                logger.exception("could not fail request %s cleanly", group.request_id)
                self._groups.pop(group.request_id, None)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        outputs = [g.to_output() for g in self._finished_unreported]
        self._finished_unreported = []
        return outputs

    def _append(self, seq: Sequence, token: int) -> None:
        self._num_generation_tokens_total += 1
        seq.append_token(token, self.eos_token_ids, self.max_model_len)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    def _fork(self, parent: Sequence, child_tokens: list[int]) -> None:
        """Create the request's other ``n - 1`` completions from the parent's computed prompt;
        each gets its first token; those that do not finish at once share the prompt's KV."""
        group = parent.group
        first_index = group.params.n - group.num_pending_forks
        group.num_pending_forks = 0
        for offset, token in enumerate(child_tokens):
            child = Sequence(self._new_seq_id(), group, first_index + offset)
            group.seqs.append(child)
            child.num_computed_tokens = parent.num_computed_tokens
            self._num_generation_tokens_total += 1
            child.append_token(token, self.eos_token_ids, self.max_model_len)
            if child.finish_reason is not None:
                child.status = SequenceStatus.FINISHED
            else:
                self.scheduler.add_forked(parent, child)

    def _finish_group(self, group: SequenceGroup, now: float) -> None:
        if group.metrics.finished_time is not None:
            return
        group.metrics.finished_time = now
        self._groups.pop(group.request_id, None)
        self._num_finished_total += 1

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
            last_step_time_s=self._last_step_time_s,
            max_concurrent_seqs=self._max_concurrent_seqs,
            num_running_seqs=len(running),
            num_prefill_chunks_total=self.scheduler.num_prefill_chunks_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
            num_generation_tokens_total=self._num_generation_tokens_total,
            num_cached_tokens_total=self.scheduler.num_cached_tokens_total,
            num_finished_total=self._num_finished_total,
            num_failed_total=self._num_failed_total,
            prefetch_time_s_total=self.runner.prefetch_time_s_total,
        )

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the tokenizer's chat template, ending with the
        assistant generation prompt.

        Raises:
            ValueError: empty or malformed messages (each needs string ``role`` and ``content``),
                text with a lone UTF-16 surrogate (names the message), or a tokenizer without a
                chat template.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        messages = [_text_message(i, m) for i, m in enumerate(messages)]
        for i, m in enumerate(messages):
            _check_unicode(m["role"], f"messages[{i}].role")
            _check_unicode(m["content"], f"messages[{i}].content")
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.model_name} has no chat template; send a plain prompt")
        self._check_text_len(sum(len(m["content"]) for m in messages))
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (the tokenizer's special tokens included, e.g. BOS).

        Raises:
            ValueError: the model has no tokenizer, or ``prompt`` is not a str of valid Unicode (a
                lone UTF-16 surrogate such as ``"\\ud800"``).
            PromptTooLongError: the text is so long that it cannot fit ``max_model_len`` tokens
                (decided from its length before tokenizing, see :meth:`_check_text_len`).
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompt_token_ids instead of text")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
        _check_unicode(prompt, "prompt")
        self._check_text_len(len(prompt))
        return list(self.tokenizer.encode(prompt))

    def _check_text_len(self, num_chars: int) -> None:
        """Reject text that is certainly too long without tokenizing it (tokenizing megabytes takes
        seconds and blocks the engine).  A token covers at most ``L`` characters, ``L`` the longest
        vocabulary entry, so text of ``num_chars`` has at least ``num_chars / L`` tokens; a factor of 4
        leaves room for normalizers that shrink text (Unicode composition)."""
        if self._max_token_chars is None:
            try:
                self._max_token_chars = max(1, max(len(t) for t in self.tokenizer.get_vocab()))
            except (AttributeError, TypeError, ValueError):
                self._max_token_chars = 0                    # unknown vocabulary: no early check
        if self._max_token_chars and num_chars > 4 * self._max_token_chars * self.max_model_len:
            raise PromptTooLongError(-(-num_chars // (4 * self._max_token_chars)), self.max_model_len,
                                     at_least=True)

    def close(self) -> None:
        """Release the KV cache's memory (the engine is unusable afterwards)."""
        self.kv_cache.close()


def _check_unicode(text: str, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` when ``text`` holds a lone UTF-16 surrogate (the
    tokenizer would raise a TypeError or UnicodeEncodeError deep inside)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} contains a lone UTF-16 surrogate {text[e.start]!r} at index {e.start}; "
                         "send valid Unicode text") from None


def check_cache_salt(cache_salt: Any) -> None:
    """Raise ``ValueError`` unless ``cache_salt`` is ``None`` or a non-empty ``str``."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")


def _token_ids(ids: Any) -> list[int]:
    """``ids`` as a list of ints; raises ValueError for anything but integers (no silent ``int(1.5)``)."""
    out = []
    for t in ids:
        if isinstance(t, bool):
            raise ValueError(f"prompt_token_ids must be integers, got {t!r}")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt_token_ids must be integers, got {t!r}") from None
    return out


def _text_message(i: int, m: Any) -> dict:
    """A chat message with string content: OpenAI text parts ``[{"type": "text", "text": ...}]`` are
    joined with newlines (as the server does); raises ValueError for anything else."""
    if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), list) \
            and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    for p in m["content"]):
        return {**m, "content": "\n".join(p["text"] for p in m["content"])}
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content' (a string or a list "
                         f"of {{'type': 'text', 'text': str}} parts), got {m!r}")
    return m
