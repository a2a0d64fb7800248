"""The engine with the vLLM sampling fields of issue 25, item 1, on a tiny random Llama (no download), both
KV backends, synchronous and async scheduling: tokens equal a float64 reference decoded with
transformers' model and the pure-Python processing of ``sampling_refs``.

- ``min_tokens`` suppresses EOS (here the prompt's own greedy next token, made the model's EOS) and the
  stop token ids until that many tokens are out, then lets them stop the output;
- greedy + ``repetition_penalty`` (and frequency / presence) picks what the reference picks, which is not
  plain greedy's output;
- seeded sampling with penalties and ``min_p`` draws the same tokens under async scheduling as without
  (the step launched ahead reads token counts that already hold the token still on the device);
- stop strings wait for ``min_tokens``, ``include_stop_str_in_output`` keeps the stop string.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import hf_greedy
from sampling_refs import ref_process
from engine_helpers import BACKENDS, one_thread, tiny  # noqa: F401 (fixtures)
from engine_helpers import make_engine as make_backend_engine
from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.logits_processing import LogitsProcessing
from vmkv.engine.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 9, 100, 3, 77]


@pytest.fixture(params=[(b, a) for b in BACKENDS for a in (False, True)],
                ids=[f"{b}-{'async' if a else 'sync'}" for b in BACKENDS for a in (False, True)])
def mode(request):
    return request.param


def make_engine(tiny, mode, loaded=None) -> LLMEngine:
    """``test_engine.make_engine`` in ``mode`` (``(backend, async_scheduling)``), on ``loaded`` if given."""
    backend, async_scheduling = mode
    return make_backend_engine(tiny if loaded is None else {**tiny, "loaded": loaded}, backend,
                               async_scheduling=async_scheduling)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int] | str, SamplingParams]]) -> dict:
    """Add every request at once (they share steps), step until done: request id -> sorted completions."""
    for rid, (prompt, params) in requests.items():
        if isinstance(prompt, str):
            engine.add_request(rid, prompt, params)
        else:
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = sorted(out.outputs, key=lambda c: c.index)
    assert engine.kv_cache.usage().used_tokens == 0
    return final


def ref_greedy(hf, prompt: list[int], max_tokens: int, *, min_tokens: int = 0, eos: tuple[int, ...] = (),
               **penalties: float) -> list[int]:
    """Greedy decoding with transformers' model, the processing done by ``ref_process`` in float64:
    EOS suppressed before ``min_tokens``, penalties over prompt + output; stops at EOS after that."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1].double().tolist()
            proc = LogitsProcessing(suppress_token_ids=eos if len(out) < min_tokens else (), **penalties)
            x = ref_process(logits, proc, prompt, out)
            t = max(range(len(x)), key=x.__getitem__)
            out.append(t)
            ids.append(t)
            if t in eos and len(out) >= min_tokens:
                break
    return out


def test_min_tokens_suppresses_eos_until_reached(tiny, mode):
    first = hf_greedy(tiny["hf"], PROMPT, 1)[0]
    # the model's EOS is the prompt's greedy next token: without min_tokens the output ends at once
    loaded = dataclasses.replace(tiny["loaded"], config=dataclasses.replace(tiny["loaded"].config,
                                                                            eos_token_ids=(first,)))
    engine = make_engine(tiny, mode, loaded)
    eos = tuple(engine.eos_token_ids)
    assert first in eos
    got = run(engine, {
        "plain": (PROMPT, SamplingParams(temperature=0, max_tokens=12)),
        "min4": (PROMPT, SamplingParams(temperature=0, max_tokens=12, min_tokens=4)),
        "min4_n2": (PROMPT, SamplingParams(temperature=0, max_tokens=12, min_tokens=4, n=2)),
        "stop_ids": (PROMPT, SamplingParams(temperature=0, max_tokens=12, min_tokens=3, ignore_eos=True,
                                            stop_token_ids=[first])),
    })
    engine.close()
    assert list(got["plain"][0].token_ids) == [first] and got["plain"][0].finish_reason == "stop"
    want = ref_greedy(tiny["hf"], PROMPT, 12, min_tokens=4, eos=eos)
    assert len(want) > 4 and not set(want[:4]) & set(eos)
    for c in (*got["min4"], *got["min4_n2"]):
        assert list(c.token_ids) == want
        assert c.finish_reason == ("stop" if want[-1] in eos else "length")
    # stop_token_ids are held back the same way (EOS is ignored here)
    want_ids = ref_greedy(tiny["hf"], PROMPT, 12, min_tokens=3, eos=(first,))
    c = got["stop_ids"][0]
    assert list(c.token_ids) == want_ids and first not in want_ids[:3]
    if want_ids[-1] == first:
        assert (c.finish_reason, c.stop_reason) == ("stop", first)


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.6},
    {"repetition_penalty": 0.8, "frequency_penalty": 0.7},
    {"presence_penalty": 1.5, "frequency_penalty": -0.3},
], ids=["repetition", "repetition_below_1_frequency", "presence_frequency"])
def test_greedy_with_penalties_equals_the_reference(tiny, mode, penalties):
    engine = make_engine(tiny, mode)
    prompt2 = [11, 12, 11, 12, 11, 30]
    got = run(engine, {
        "pen": (PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties)),
        "pen2": (prompt2, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **penalties)),
        "plain": (PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
    })
    engine.close()
    want = ref_greedy(tiny["hf"], PROMPT, 24, **penalties)
    assert list(got["pen"][0].token_ids) == want
    assert list(got["pen2"][0].token_ids) == ref_greedy(tiny["hf"], prompt2, 16, **penalties)
    plain = list(got["plain"][0].token_ids)
    assert plain == hf_greedy(tiny["hf"], PROMPT, 24)           # the neighbour without penalties: untouched
    assert want != plain                                       # the penalty changed the output


def test_seeded_sampling_with_penalties_is_the_same_under_async_scheduling(tiny):
    """Async scheduling launches a step before the previous step's tokens reach the host: its penalty rows
    must read counts holding those tokens, or the draws would differ from synchronous scheduling's."""
    params = [SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True, repetition_penalty=1.4,
                             frequency_penalty=0.5, min_p=0.05),
              SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True, presence_penalty=1.0,
                             n=2, top_k=20),
              SamplingParams(temperature=0.7, seed=9, max_tokens=18, min_tokens=10, logit_bias={7: 3.0, 8: -50.0})]
    results = {}
    for mode in [("paged", False), ("paged", True), ("vmem", True)]:
        engine = make_engine(tiny, mode)
        out = run(engine, {f"r{i}": ([3 + i, *PROMPT], p) for i, p in enumerate(params)})
        assert mode[1] is False or engine.get_stats().num_ahead_steps_total > 0
        engine.close()
        results[mode] = {rid: [list(c.token_ids) for c in cs] for rid, cs in out.items()}
    sync = results[("paged", False)]
    assert all(r == sync for r in results.values())
    assert all(8 not in toks for toks in sync["r2"]) and len(sync["r2"][0]) >= 10


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """The server tests' tiny model: a word-level tokenizer, so the text is whole words and a stop string's
    place in it is plain to see."""
    from server_helpers import make_tiny_model
    from vmkv.model import load_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-words"))
    loaded = load_model(str(path), device="cpu", dtype="float32")
    return {"path": str(path), "loaded": loaded, "tokenizer": loaded.tokenizer}


def ref_stop(tokenizer, prompt: list[int], ids: list[int], stop: str, min_tokens: int,
             include: bool) -> tuple[str, int] | None:
    """vLLM's rule, token by token: the first stop string that ends in the text of an output token after
    the first ``min_tokens``: ``(output text, tokens kept)``, or None when none does.  The output's text
    is the text the prompt + output decode to, after the prompt's."""
    prev = ""
    base = tokenizer.decode(prompt)
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(prompt + ids[:k])[len(base):]
        idx = text.find(stop, max(0, len(prev) - len(stop) + 1))
        if k > min_tokens and idx >= 0:
            return text[:idx + len(stop) if include else idx], k
        prev = text
    return None


def test_stop_strings_wait_for_min_tokens_and_can_be_kept(word_model, mode):
    engine = make_engine(word_model, mode, word_model["loaded"])
    tok = word_model["tokenizer"]
    prompt = tok.encode("the capital of France is", add_special_tokens=False)
    plain = run(engine, {"p": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))})["p"][0]
    ids = list(plain.token_ids)
    words = plain.text.split()
    # the word that occurs twice the earliest: its first occurrence is early, the second later
    stop = next(w for i, w in enumerate(words) if w in words[i + 1:])
    first = ref_stop(tok, prompt, ids, stop, 0, False)
    assert first is not None
    min_tokens = first[1]                   # the first occurrence's token may not stop it now
    later = ref_stop(tok, prompt, ids, stop, min_tokens, False)
    assert later is not None and later[1] > first[1]
    got = run(engine, {
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])),
        "keep": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                        include_stop_str_in_output=True)),
        "late": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                        min_tokens=min_tokens)),
        "late_keep": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                             min_tokens=min_tokens, include_stop_str_in_output=True)),
    })
    engine.close()
    for rid, (m, include) in {"stop": (0, False), "keep": (0, True), "late": (min_tokens, False),
                              "late_keep": (min_tokens, True)}.items():
        text, num_tokens = ref_stop(tok, prompt, ids, stop, m, include)
        c = got[rid][0]
        assert (c.text, list(c.token_ids)) == (text, ids[:num_tokens]), rid
        assert (c.finish_reason, c.stop_reason) == ("stop", stop), rid
    assert got["keep"][0].text.endswith(stop) and not got["stop"][0].text.endswith(stop)
    assert len(got["late"][0].token_ids) > min_tokens >= len(got["stop"][0].token_ids)


# ---------------------------------------------------------------------- CUDA: graphs + async scheduling
GPU_PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=36, min_tokens=30, frequency_penalty=0.8,
                             presence_penalty=0.4, logit_bias={11: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=38, ignore_eos=True, min_p=0.1,
                             repetition_penalty=1.2),
              SamplingParams(temperature=0.7, max_tokens=30, min_tokens=12, top_k=40)]


def _gpu_run(async_scheduling: bool, enforce_eager: bool, check_sync: bool) -> tuple[dict, object]:
    cfg = EngineConfig.from_args(None, "paged", "cuda", "float32", random_weights="smollm2-135m", max_num_seqs=8,
                                 max_model_len=256, max_num_batched_tokens=512, seed=5,
                                 async_scheduling=async_scheduling, enforce_eager=enforce_eager)
    engine = LLMEngine(cfg)
    if check_sync:
        plain_launch = engine.runner.launch

        def launch(sched, input_ids=None):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return plain_launch(sched, input_ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        engine.runner.launch = launch
    for i, p in enumerate(GPU_PARAMS):
        engine.add_request(f"r{i}", None, p, prompt_token_ids=list(range(5 + i, 40 + 3 * i)))
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = [list(c.token_ids) for c in o.outputs]
    stats = engine.get_stats()
    engine.close()
    return final, stats


@pytest.mark.gpu
def test_logits_processing_under_cuda_graphs_and_async_scheduling_never_waits_and_matches_eager():
    """Penalties, min_tokens, logit_bias and min_p rows in decode steps replayed from CUDA graphs (the
    sampler runs after the replay) and launched ahead: no synchronising CUDA call in a launch, and the
    tokens are eager synchronous scheduling's (greedy and seeded rows; unseeded ones differ by design)."""
    got, stats = _gpu_run(True, False, check_sync=True)
    want, _ = _gpu_run(False, True, check_sync=False)
    assert stats.num_ahead_steps_total > 0 and stats.num_cuda_graph_steps_total > 0
    for rid in ("r0", "r1", "r2", "r3"):
        assert got[rid] == want[rid], rid
    assert len(got["r1"][0]) >= 30 and len(got["r4"][0]) >= 12
