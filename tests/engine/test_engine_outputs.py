"""Engine outputs carry deltas: streaming a request of L tokens copies O(L) token ids, not O(L^2);
the deltas of a request's outputs add up to its final text and token ids (both backends, stop
strings with held-back text, n > 1); a stream consumer that falls behind gets the skipped deltas
merged; the engine's limits come from one resolution and one KV-cache build."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine_helpers import BACKENDS, BYTES_PER_TOKEN, backend, make_engine, make_tiny_llama, one_thread  # noqa: F401
from vmkv.engine import llm_engine as llm_engine_module
from vmkv.engine.errors import RequestFailedError
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import CompletionOutput, ListPrefix, RequestMetrics, RequestOutput, merge_outputs
from vmkv.engine.sampling_params import SamplingParams
from vmkv.server.async_engine import RequestStream


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vmkv.model import load_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path)
    return {"path": str(path), "loaded": load_model(str(path), device="cpu", dtype="float32")}


def stream_all(engine: LLMEngine) -> tuple[dict, dict]:
    """Step until done; returns ``({rid: [RequestOutput, ...]}, {rid: final RequestOutput})``."""
    seen: dict[str, list[RequestOutput]] = {}
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
            if out.finished:
                final[out.request_id] = out
    return seen, final


def test_streaming_l_tokens_copies_o_of_l_token_ids(tiny, backend, monkeypatch):
    copied = []
    real = ListPrefix.to_list
    monkeypatch.setattr(ListPrefix, "to_list", lambda self: copied.append(self.length) or real(self))
    num_tokens = 120
    engine = make_engine(tiny, backend)
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True),
                       prompt_token_ids=[5, 6, 7, 8])
    outs, final = stream_all(engine)
    steps = outs["r"]
    assert len(steps) == num_tokens                          # one output per decode step
    assert [len(o.outputs[0].delta_token_ids) for o in steps] == [1] * num_tokens
    assert sum(copied) == 0                                  # nobody read a cumulative list: nothing copied
    ids = final["r"].outputs[0].token_ids                    # the one read of the cumulative list
    assert sum(copied) == num_tokens and len(ids) == num_tokens
    assert [t for o in steps for t in o.outputs[0].delta_token_ids] == ids
    # cumulative snapshots stay what they were when taken (the engine's list kept growing)
    assert steps[9].outputs[0].token_ids == ids[:10] and steps[9].metrics.token_times == \
        final["r"].metrics.token_times[:10]


def test_streamed_deltas_add_up_to_the_final_outputs(tiny, backend):
    probe = make_engine(tiny, backend)
    probe.add_request("probe", "The capital of France is", SamplingParams(temperature=0, max_tokens=40,
                                                                          ignore_eos=True))
    text = stream_all(probe)[1]["probe"].outputs[0].text
    assert len(text) > 12
    stop = text[len(text) // 2:len(text) // 2 + 3]          # hit mid-output, after held-back prefixes
    engine = make_engine(tiny, backend)
    engine.add_request("stop", "The capital of France is",
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    engine.add_request("n3", "Hello world!", SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24))
    engine.add_request("ids", None, SamplingParams(temperature=0.8, seed=3, max_tokens=30),
                       prompt_token_ids=[40, 41, 42, 43, 44])
    seen, final = stream_all(engine)
    assert final["stop"].outputs[0].finish_reason == "stop" and final["stop"].outputs[0].stop_reason == stop
    for rid, outs in seen.items():
        for c in final[rid].outputs:
            mine = [o.outputs[c.index] for o in outs]
            assert "".join(x.delta_text for x in mine) == c.text, (rid, c.index)
            assert [t for x in mine for t in x.delta_token_ids] == c.token_ids, (rid, c.index)
            assert sum(1 for x in mine if x.finish_reason is not None and x.delta_token_ids) <= 1


def _output(rid: str, pieces: list[tuple[str, list[int]]], finished: bool = False, so_far=("", [])) -> RequestOutput:
    text, ids = so_far
    outs = []
    for i, (dt, dids) in enumerate(pieces):
        outs.append(CompletionOutput(i, text + dt, ids + dids, "stop" if finished else None,
                                     delta_text=dt, delta_token_ids=dids))
    return RequestOutput(rid, None, [1], outs, finished, 0, RequestMetrics(0.0))


def test_merge_outputs_keeps_the_newest_and_concatenates_the_deltas():
    a = _output("r", [("He", [1]), ("", [])])
    b = _output("r", [("llo", [2]), ("x", [9])], so_far=("He", [1]))
    c = _output("r", [("!", [3]), ("", [])], finished=True, so_far=("Hello", [1, 2]))
    assert merge_outputs([a]) is a
    m = merge_outputs([a, b, c])
    assert m.finished and m.outputs[0].text == "Hello!" and m.outputs[0].token_ids == [1, 2, 3]
    assert (m.outputs[0].delta_text, m.outputs[0].delta_token_ids) == ("Hello!", [1, 2, 3])
    assert (m.outputs[1].delta_text, m.outputs[1].delta_token_ids) == ("x", [9])
    assert m.outputs[0].finish_reason == "stop" and m.metrics is c.metrics


def test_request_stream_merges_what_a_slow_consumer_skipped():
    class Owner:
        aborted: list[str] = []

        def abort(self, request_id):
            self.aborted.append(request_id)

    async def run():
        owner = Owner()
        stream = RequestStream("r", owner)
        a = _output("r", [("He", [1])])
        b = _output("r", [("llo", [2])], so_far=("He", [1]))
        failure = RequestFailedError("r", "request r failed in sampling: boom", b)
        for item in (a, b, failure):
            stream._queue.put_nowait(item)
        got = []
        with pytest.raises(RequestFailedError):
            async for out in stream:                    # the deltas before the failure are not lost
                got.append(out)
        assert [(o.outputs[0].delta_text, o.outputs[0].delta_token_ids) for o in got] == [("Hello", [1, 2])]
        assert owner.aborted == []                      # finished in the engine: nothing to abort

    asyncio.run(run())


def test_limits_are_resolved_once_with_one_cache_build(tiny, backend, monkeypatch):
    builds = []
    real = llm_engine_module.create_kv_cache
    monkeypatch.setattr(llm_engine_module, "create_kv_cache", lambda *a, **k: builds.append(k) or real(*a, **k))
    # 300 tokens by bytes; paged blocks of 16 hold 288, so the default max_model_len ends at 288
    engine = make_engine(tiny, backend, memory_bytes=300 * BYTES_PER_TOKEN, max_model_len=None)
    assert len(builds) == 1 and builds[0]["max_model_len"] == 300
    free = engine.kv_cache.usage().free_tokens
    assert engine.max_model_len == min(300, free) and engine.resolved.max_model_len == engine.max_model_len
    assert engine.input_processor.max_model_len == engine.max_model_len == engine.scheduler.max_model_len
    with pytest.raises(AttributeError):
        engine.max_model_len = 10                       # read-only: resolved, never assigned
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.resolved.max_model_len = 10              # type: ignore[misc]


def test_final_only_requests_are_reported_once_when_they_finish():
    """``RequestOutputKind.FINAL_ONLY`` (vLLM's): no per-step outputs, one final output whose delta is
    the whole completion; a streaming request in the same batch still reports every step."""
    from vmkv.engine.config import EngineConfig
    from vmkv.engine.llm_engine import LLMEngine
    from vmkv.engine.sampling_params import RequestOutputKind, SamplingParams

    engine = LLMEngine(EngineConfig.from_args(None, "paged", "cpu", "float32", random_weights="tiny",
                                              max_num_seqs=4, max_model_len=64))
    final = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                           output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("final", None, final, prompt_token_ids=[1, 2, 3])
    engine.add_request("stream", None, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       prompt_token_ids=[1, 2, 3])
    seen: dict[str, list] = {"final": [], "stream": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["stream"]) == 5 and len(seen["final"]) == 1
    (out,) = seen["final"]
    assert out.finished and list(out.outputs[0].token_ids) == list(seen["stream"][-1].outputs[0].token_ids)
    assert list(out.outputs[0].delta_token_ids) == list(out.outputs[0].token_ids)
    assert len(out.metrics.token_times) == 5
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=2)
    engine.close()
