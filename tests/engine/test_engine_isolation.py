"""Failure isolation (issue 9): a bad request is that request's failure, never the engine's.

An exception injected into one request's stage (KV allocation or extension, sampling, detokenization,
stop checks, fork) fails that request only: ``finish_reason="error"`` and ``RequestOutput.error``, its
KV freed (``check_integrity`` and usage show nothing leaked), the other requests finish with the
same tokens as transformers.  An exception in the batched forward fails that step's batch; waiting
and later requests run.  Only a context-poisoning CUDA error stops the engine (and the
``AsyncEngine``, whose ``error`` then says why).  Both KV backends, on the tiny random Llama.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import hf_greedy, random_prompts
from engine_helpers import BACKENDS, BYTES_PER_TOKEN, backend, greedy, make_engine, one_thread, run_all, tiny  # noqa: F401,E501 (fixtures)
from vmkv.engine import detokenizer as detokenizer_mod
from vmkv.engine.errors import RequestFailedError, is_fatal_error
from vmkv.engine.sampling_params import SamplingParams


def assert_no_leak(engine) -> None:
    engine.kv_cache.check_integrity()
    usage = engine.kv_cache.usage()
    assert usage.num_seqs == 0 and usage.used_tokens == 0, usage
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting


def add_three(engine, tiny, max_tokens: int = 6, **bad_kw):
    """Requests ``ok0``, ``bad``, ``ok1`` (prompts of 20, 24, 28 tokens); returns their references."""
    prompts = random_prompts(len(tiny["tokenizer"]), [20, 24, 28], seed=21)
    for rid, p in zip(("ok0", "bad", "ok1"), prompts):
        engine.add_request(rid, None, greedy(max_tokens, **(bad_kw if rid == "bad" else {})),
                           prompt_token_ids=p)
    return {rid: hf_greedy(tiny["hf"], p, max_tokens) for rid, p in zip(("ok0", "bad", "ok1"), prompts)
            if rid != "bad"}


def assert_only_bad_failed(final, refs, what: str) -> None:
    bad = final["bad"]
    assert bad.finished and bad.error is not None and what in bad.error, bad.error
    assert all(c.finish_reason == "error" for c in bad.outputs)
    for rid, ref in refs.items():
        assert final[rid].error is None
        assert final[rid].outputs[0].token_ids == ref and final[rid].outputs[0].finish_reason == "length"


def check_still_serves(engine, tiny) -> None:
    prompt = random_prompts(len(tiny["tokenizer"]), [12], seed=22)[0]
    engine.add_request("after", None, greedy(4), prompt_token_ids=prompt)
    out = run_all(engine)["after"]
    assert out.error is None and out.outputs[0].token_ids == hf_greedy(tiny["hf"], prompt, 4)
    assert_no_leak(engine)


# ---------------------------------------------------------------------- per-request stages
def test_detokenizer_failure_fails_only_that_request(tiny, backend):
    engine = make_engine(tiny, backend)
    refs = add_three(engine, tiny)
    engine.step()                                   # all three prefill and sample a token

    def boom(token_id):
        raise RuntimeError("injected detokenizer failure")

    engine._groups["bad"].parent.output_text_state._detok.add_token = boom
    final = run_all(engine)
    assert_only_bad_failed(final, refs, "injected detokenizer failure")
    # the token whose detokenization raised was appended first: the output holds the tokens sampled
    assert "output processing" in final["bad"].error and len(final["bad"].outputs[0].token_ids) == 2
    assert engine.get_stats().num_failed_total == 1
    check_still_serves(engine, tiny)


def inject_stop_check_failure(monkeypatch) -> list[int]:
    """Stop-string checks of requests with the stop string "BOOM" raise; returns the list that counts
    the injected failures (a test asserts it fired: a patch of a name the code no longer calls would
    inject nothing)."""
    real, fired = detokenizer_mod.find_stop_string, []

    def find(text, stop, new_len):
        if "BOOM" in stop:
            fired.append(1)
            raise RuntimeError("injected stop-check failure")
        return real(text, stop, new_len)

    monkeypatch.setattr(detokenizer_mod, "find_stop_string", find)
    return fired


def test_stop_check_failure_fails_only_that_request(tiny, backend, monkeypatch):
    fired = inject_stop_check_failure(monkeypatch)
    engine = make_engine(tiny, backend)
    refs = add_three(engine, tiny, stop=["BOOM"])
    assert_only_bad_failed(run_all(engine), refs, "injected stop-check failure")
    assert fired, "the injected stop-check failure never fired"
    check_still_serves(engine, tiny)


def test_sampling_failure_fails_only_that_request(tiny, backend):
    """The batched sample raises because of one row; each request is then sampled alone and only
    the one whose rows raise fails."""
    engine = make_engine(tiny, backend)
    real = engine.sampler.sample_device

    def sample(logits, rows):
        if any(r.temperature == 0.77 for r in rows):
            raise RuntimeError("injected sampling failure")
        return real(logits, rows)

    engine.sampler.sample_device = sample
    prompts = random_prompts(len(tiny["tokenizer"]), [20, 24, 28], seed=21)
    refs = {}
    for rid, p in zip(("ok0", "bad", "ok1"), prompts):
        params = SamplingParams(temperature=0.77, max_tokens=6) if rid == "bad" else greedy(6)
        engine.add_request(rid, None, params, prompt_token_ids=p)
        refs[rid] = hf_greedy(tiny["hf"], p, 6)
    del refs["bad"]
    final = run_all(engine)
    assert_only_bad_failed(final, refs, "injected sampling failure")
    assert "sampling" in final["bad"].error and final["bad"].outputs[0].token_ids == []
    check_still_serves(engine, tiny)


def test_kv_allocate_failure_fails_only_that_request(tiny, backend):
    engine = make_engine(tiny, backend)
    refs = add_three(engine, tiny)
    bad_seq = engine._groups["bad"].parent.seq_id
    real = engine.kv_cache.allocate

    def allocate(seq_id, *args, **kw):
        if seq_id == bad_seq:
            real(seq_id, *args, **kw)               # half-made: the cache holds it, then it raises
            raise AssertionError("injected allocate failure")
        return real(seq_id, *args, **kw)

    engine.kv_cache.allocate = allocate
    final = run_all(engine)
    assert_only_bad_failed(final, refs, "injected allocate failure")
    assert "KV allocation" in final["bad"].error
    check_still_serves(engine, tiny)


def test_kv_extend_failure_while_decoding_fails_only_that_request(tiny, backend):
    engine = make_engine(tiny, backend, async_scheduling=False)   # the token count below is a sync step's
    refs = add_three(engine, tiny, max_tokens=20)
    for _ in range(3):
        engine.step()
    bad_seq = engine._groups["bad"].parent.seq_id
    real = engine.kv_cache.extend

    def extend(seq_id, num_tokens):
        if seq_id == bad_seq:
            raise RuntimeError("injected extend failure")
        return real(seq_id, num_tokens)

    engine.kv_cache.extend = extend
    final = run_all(engine)
    assert_only_bad_failed(final, refs, "injected extend failure")
    # what it produced before the failure: 3 steps, plus the one whose position was backed ahead
    # while the GPU ran step 3 (ModelRunner._extend_ahead), before the injection
    assert len(final["bad"].outputs[0].token_ids) == 4
    check_still_serves(engine, tiny)


def test_fork_failure_fails_the_n3_request_only(tiny, backend):
    engine = make_engine(tiny, backend)
    refs = add_three(engine, tiny, n=3)

    def fork(parent_id, child_id):
        raise RuntimeError("injected fork failure")

    engine.kv_cache.fork = fork
    final = run_all(engine)
    assert_only_bad_failed(final, refs, "injected fork failure")
    assert [c.index for c in final["bad"].outputs] == [0, 1, 2]
    check_still_serves(engine, tiny)


# ---------------------------------------------------------------------- batch-wide and fatal
class FailingModel:
    """Wraps the model; ``forward`` raises ``exc`` on the calls listed in ``fail_calls`` (1-based)."""

    def __init__(self, model, exc: Exception, fail_calls=(1,)) -> None:
        self.model, self.exc, self.fail_calls, self.calls = model, exc, set(fail_calls), 0

    def forward(self, *args, **kw):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise self.exc
        return self.model.forward(*args, **kw)


def test_forward_failure_fails_the_batch_and_the_engine_runs_on(tiny, backend):
    engine = make_engine(tiny, backend, max_num_seqs=2)
    prompts = random_prompts(len(tiny["tokenizer"]), [20, 24, 28], seed=23)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(5), prompt_token_ids=p)
    engine.runner.model = FailingModel(engine.runner.model, ValueError("Pointer argument (at 2) cannot "
                                                                       "be accessed from Triton"), (2,))
    engine.step()                                   # r0, r1 prefill (r2 waits: max_num_seqs=2)
    outs = {o.request_id: o for o in engine.step()}  # their first decode step fails
    assert set(outs) == {"r0", "r1"} and all(o.finished and "model forward" in o.error for o in outs.values())
    assert engine.kv_cache.usage().num_seqs == 0    # the batch's KV is freed before r2 is admitted
    final = run_all(engine)
    assert final["r2"].error is None and final["r2"].outputs[0].token_ids == hf_greedy(tiny["hf"], prompts[2], 5)
    check_still_serves(engine, tiny)


def test_a_failed_prefill_is_not_served_from_the_prefix_cache(tiny, backend):
    """The retry of a request whose forward failed recomputes what it must: same tokens as transformers."""
    engine = make_engine(tiny, backend)
    prompt = random_prompts(len(tiny["tokenizer"]), [40], seed=24)[0]
    engine.runner.model = FailingModel(engine.runner.model, RuntimeError("injected forward failure"))
    engine.add_request("first", None, greedy(4), prompt_token_ids=prompt)
    assert run_all(engine)["first"].error is not None
    engine.add_request("retry", None, greedy(4), prompt_token_ids=prompt)
    retry = run_all(engine)["retry"]
    assert retry.error is None and retry.outputs[0].token_ids == hf_greedy(tiny["hf"], prompt, 4)
    assert_no_leak(engine)


def test_scheduler_bug_fails_unfinished_requests_and_the_engine_recovers(tiny, backend):
    # synchronous: the injected bug must hit the schedule() of the step after the first, not a step ahead
    engine = make_engine(tiny, backend, async_scheduling=False)
    add_three(engine, tiny)
    engine.step()
    real, calls = engine.scheduler.schedule, []

    def schedule():
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("injected scheduler bug")
        return real()

    engine.scheduler.schedule = schedule
    outs = engine.step()
    assert {o.request_id for o in outs} == {"ok0", "bad", "ok1"}
    assert all(o.finished and "injected scheduler bug" in o.error for o in outs)
    check_still_serves(engine, tiny)


@pytest.mark.parametrize("message", ["CUDA error: an illegal memory access was encountered",
                                     "CUDA error: device-side assert triggered",
                                     "cuMemMap failed: CUDA_ERROR_ILLEGAL_ADDRESS"])
def test_context_poisoning_error_propagates(tiny, message):
    engine = make_engine(tiny, "paged")
    engine.runner.model = FailingModel(engine.runner.model, RuntimeError(message))
    engine.add_request("r", None, greedy(4), prompt_token_ids=[5, 6, 7])
    with pytest.raises(RuntimeError, match="CUDA"):
        engine.step()


def test_fatal_error_classifier():
    import torch

    assert is_fatal_error(torch.AcceleratorError("CUDA error: unspecified launch failure"))
    assert is_fatal_error(KeyboardInterrupt())
    wrapped = ValueError("wrapper")
    wrapped.__cause__ = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert is_fatal_error(wrapped)
    for benign in (torch.OutOfMemoryError("CUDA out of memory"), ValueError("Pointer argument (at 2) "
                   "cannot be accessed from Triton (cpu tensor?)"), RuntimeError("CUDA_ERROR_OUT_OF_MEMORY"),
                   AssertionError("mapper"), OverflowError("Python int too large to convert to C long")):
        assert not is_fatal_error(benign), benign


# ---------------------------------------------------------------------- sampling parameter ranges
def test_top_k_2_pow_63_is_rejected_and_never_reaches_the_engine(tiny, backend):
    with pytest.raises(ValueError, match=r"top_k must be .*\[1, 2147483647\], got 9223372036854775808"):
        SamplingParams(top_k=2 ** 63)
    engine = make_engine(tiny, backend)
    params = greedy(3)
    params.top_k = 2 ** 63                          # mutated after construction: add_request validates
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request("r", None, params, prompt_token_ids=[5, 6, 7])
    assert_no_leak(engine)
    # a k above the vocabulary is clamped by the sampler (keeps every token), never an error
    engine.add_request("big", None, SamplingParams(top_k=2 ** 31 - 1, max_tokens=3, seed=1),
                       prompt_token_ids=[5, 6, 7])
    engine.add_request("off", None, SamplingParams(top_k=-1, max_tokens=3, seed=1), prompt_token_ids=[5, 6, 7])
    final = run_all(engine)
    assert final["big"].error is None and final["big"].outputs[0].token_ids == final["off"].outputs[0].token_ids


def test_lone_surrogate_is_a_value_error_naming_the_field(tiny):
    engine = make_engine(tiny, "paged")
    with pytest.raises(ValueError, match=r"prompt contains a lone UTF-16 surrogate '\\ud800' at index 1"):
        engine.add_request("r", "a\ud800b", greedy(2))
    with pytest.raises(ValueError, match=r"messages\[1\]\.content contains a lone UTF-16 surrogate"):
        engine.apply_chat_template([{"role": "system", "content": "hi"}, {"role": "user", "content": "\udfff"}])
    assert_no_leak(engine)


# ---------------------------------------------------------------------- prefix lookups count once
def test_waiting_prompt_is_looked_up_once(tiny, backend):
    """Chunked prefill off: a prompt that does not fit the step's remaining budget waits without
    being allocated, so the prefix cache sees one lookup per admission (issue 9: a 94-token prompt
    added 2,820 lookup tokens)."""
    engine = make_engine(tiny, backend, enable_chunked_prefill=False, max_num_batched_tokens=128,
                         max_model_len=128)
    short = random_prompts(len(tiny["tokenizer"]), [10] * 10, seed=25)
    long = random_prompts(len(tiny["tokenizer"]), [120], seed=26)[0]
    for i, p in enumerate(short):                   # 10 decodes per step leave < 120 of the budget
        engine.add_request(f"s{i}", None, greedy(4), prompt_token_ids=p)
    engine.add_request("long", None, greedy(2), prompt_token_ids=long)
    waited = 0
    while "long" not in {s.group.request_id for s in engine.scheduler.running}:
        engine.step()
        waited += 1
    assert waited >= 3
    run_all(engine)
    usage = engine.kv_cache.usage()
    assert usage.prefix_query_tokens == 10 * 10 + 120
    assert_no_leak(engine)


# ---------------------------------------------------------------------- AsyncEngine (the core process)
def core_kwargs(tiny, backend: str) -> dict:
    """``LLMEngine.from_args`` keywords of :func:`make_engine`'s engine, for an engine core process."""
    opts = dict(BACKENDS[backend])
    kv_backend = opts.pop("kv_backend")
    return {"model": tiny["path"], "kv_backend": kv_backend, "device": "cpu", "dtype": "float32",
            "max_model_len": 256, "memory_bytes": 512 * BYTES_PER_TOKEN, **opts}


def failing_model_engine(**kwargs):
    """Engine factory (runs in the core): the engine's model wrapped in a :class:`FailingModel` whose
    first forward raises."""
    from vmkv.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(**kwargs)
    engine.runner.model = FailingModel(engine.runner.model, RuntimeError("injected forward failure"))
    return engine


def fail_next_forward(engine, message: str) -> None:
    """(In the core) the model's next forward raises ``RuntimeError(message)``."""
    wrapper = engine.runner.model
    wrapper.exc = RuntimeError(message)
    wrapper.fail_calls = {wrapper.calls + 1}


def test_async_engine_survives_a_failed_request(tiny, backend, monkeypatch):
    """The front's output processing (stop strings) fails one request: that request's stream raises, its
    KV is freed in the core, the others finish with transformers' tokens."""
    from vmkv.server.async_engine import AsyncEngine

    fired = inject_stop_check_failure(monkeypatch)      # the front runs the stop checks: this process
    prompts = random_prompts(len(tiny["tokenizer"]), [20, 24, 28, 16], seed=27)

    async def main():
        ae = AsyncEngine(core_kwargs(tiny, backend), log_level="warning", torch_threads=1)
        ae.start()
        try:
            ok0 = await ae.add_request("ok0", None, greedy(8), prompts[0])
            bad = await ae.add_request("bad", None, greedy(8, stop=["BOOM"]), prompts[1])
            ok1 = await ae.add_request("ok1", None, greedy(8), prompts[2])
            with pytest.raises(RequestFailedError) as e:
                await bad.result()
            assert e.value.request_id == "bad" and "injected stop-check failure" in e.value.message
            outs = [await ok0.result(), await ok1.result()]
            assert ae.error is None and ae.is_running
            later = await (await ae.add_request("later", None, greedy(4), prompts[3],
                                                cache_salt="tenant")).result()
            await ae.call(assert_no_leak)
            return outs, later
        finally:
            await ae.shutdown()

    outs, later = asyncio.run(main())
    assert fired, "the injected stop-check failure never fired"
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny["hf"], p, 8) for p in (prompts[0], prompts[2])]
    assert later.error is None and later.outputs[0].token_ids == hf_greedy(tiny["hf"], prompts[3], 4)


def test_async_engine_batch_failure_then_fatal_error(tiny):
    from vmkv.server.async_engine import AsyncEngine, EngineDeadError

    prompts = random_prompts(len(tiny["tokenizer"]), [20, 24], seed=28)

    async def main():
        ae = AsyncEngine(core_kwargs(tiny, "paged"), engine_factory=failing_model_engine, log_level="warning",
                         torch_threads=1)
        ae.start()
        try:
            a = await ae.add_request("a", None, greedy(6), prompts[0])
            with pytest.raises(RequestFailedError, match="model forward"):
                await a.result()
            b = await (await ae.add_request("b", None, greedy(6), prompts[1])).result()
            assert b.error is None and ae.error is None
            await ae.call(fail_next_forward, "CUDA error: an illegal memory access was encountered")
            c = await ae.add_request("c", None, greedy(6), prompts[0])
            with pytest.raises(EngineDeadError):
                await c.result()
            assert "illegal memory access" in str(ae.error)
            with pytest.raises(EngineDeadError):
                await ae.add_request("d", None, greedy(6), prompts[0])
            return b
        finally:
            await ae.shutdown()

    b = asyncio.run(main())
    assert b.outputs[0].token_ids == hf_greedy(tiny["hf"], prompts[1], 6)
