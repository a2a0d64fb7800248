"""End-to-end engine tests on a tiny random Llama saved with ``save_pretrained`` (no download).

Every behaviour runs on both KV backends: ``paged`` and ``vmem`` (host driver, 4 KiB pages, so
a megacache page holds 8 tokens of this model: ``bytes_per_token = 2 layers x 2 (K,V) x 2 heads
x 16 x 4 bytes = 512``).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (BACKENDS, BYTES_PER_TOKEN, backend, greedy, hf_greedy, make_engine, one_thread,  # noqa: F401
                            random_prompts, run_all, tiny)  # (fixtures)
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.sequence import PromptTooLongError


# ---------------------------------------------------------------------- greedy == transformers
def test_greedy_matches_transformers(tiny, backend):
    prompts = random_prompts(len(tiny["tokenizer"]), [3, 17, 40, 64], seed=1)
    refs = [hf_greedy(tiny["hf"], p, 24) for p in prompts]
    engine = make_engine(tiny, backend)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(24), prompt_token_ids=p)
    final = run_all(engine)
    for i, ref in enumerate(refs):
        out = final[f"r{i}"].outputs[0]
        assert out.token_ids == ref, f"request {i}"
        assert out.finish_reason == "length"
    assert engine.kv_cache.usage().used_tokens == 0
    engine.kv_cache.check_integrity()


def test_preemption_and_chunked_prefill_match_transformers(tiny, backend):
    """A 160-token cache for 5 requests of ~90 tokens each, an 16-token step budget: prompts are
    prefilled in chunks, running requests are preempted by recompute, and every request still
    produces exactly transformers' greedy tokens and completes."""
    prompts = random_prompts(len(tiny["tokenizer"]), [50, 37, 61, 45, 29], seed=2)
    refs = [hf_greedy(tiny["hf"], p, 40) for p in prompts]
    engine = make_engine(tiny, backend, memory_bytes=160 * BYTES_PER_TOKEN, max_model_len=128,
                         max_num_batched_tokens=16, max_num_seqs=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(40), prompt_token_ids=p)
    checked = []
    final = run_all(engine, on_step=lambda e: checked.append(e.kv_cache.check_integrity()))
    stats = engine.get_stats()
    assert stats.num_preempted_total > 0
    assert stats.num_prefill_chunks_total > 0
    for i, ref in enumerate(refs):
        assert final[f"r{i}"].outputs[0].token_ids == ref, f"request {i}"
    assert engine.kv_cache.usage().used_tokens == 0
    assert stats.num_running == stats.num_waiting == 0
    assert stats.max_concurrent_seqs <= 4


def test_cache_too_small_for_all_requests_completes_everything(tiny, backend):
    engine = make_engine(tiny, backend, memory_bytes=96 * BYTES_PER_TOKEN, max_model_len=64,
                         max_num_seqs=8)
    prompts = random_prompts(len(tiny["tokenizer"]), [20, 24, 16, 30, 12, 28, 22, 18], seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(30), prompt_token_ids=p)
    # all at once would need sum(prompt + 30) = 350 tokens > 96
    final = run_all(engine)
    assert sorted(final) == sorted(f"r{i}" for i in range(8))
    for i, p in enumerate(prompts):
        out = final[f"r{i}"].outputs[0]
        assert len(out.token_ids) == min(30, 64 - len(p)) and out.finish_reason == "length"
    stats = engine.get_stats()
    assert stats.num_preempted_total > 0
    assert stats.kv_usage.used_tokens == 0 and stats.kv_usage.num_seqs == 0
    assert stats.alloc_time_s_total > 0 and stats.num_steps > 0


# ---------------------------------------------------------------------- n > 1 through fork
def test_n3_shares_the_prompt_kv(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [120], seed=4)[0]
    engine = make_engine(tiny, backend, memory_bytes=1024 * BYTES_PER_TOKEN)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    engine.add_request("n3", None, params, prompt_token_ids=prompt)
    peak = {"bytes": 0, "seqs": 0}

    def watch(e):
        u = e.kv_cache.usage()
        peak["bytes"] = max(peak["bytes"], u.allocated_bytes)
        peak["seqs"] = max(peak["seqs"], u.num_seqs)

    final = run_all(engine, on_step=watch)
    outs = final["n3"].outputs
    assert [c.index for c in outs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in outs)
    assert len({tuple(c.token_ids) for c in outs}) > 1          # independent samples
    assert peak["seqs"] == 3
    one_copy = (len(prompt) + 8) * BYTES_PER_TOKEN
    assert peak["bytes"] < 2 * one_copy, (peak, one_copy)        # far below three copies
    assert engine.get_stats().num_prompt_tokens_total == len(prompt)   # prefilled once
    assert engine.kv_cache.usage().used_tokens == 0


def test_n3_greedy_children_equal_parent(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [21], seed=5)[0]
    ref = hf_greedy(tiny["hf"], prompt, 12)
    engine = make_engine(tiny, backend)
    engine.add_request("g", None, greedy(12, n=3), prompt_token_ids=prompt)
    outs = run_all(engine)["g"].outputs
    assert [c.token_ids for c in outs] == [ref, ref, ref]


# ---------------------------------------------------------------------- abort
def test_abort_frees_kv_at_any_point(tiny, backend):
    engine = make_engine(tiny, backend, max_num_batched_tokens=32)
    prompts = random_prompts(len(tiny["tokenizer"]), [80, 10, 10], seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(50), prompt_token_ids=p)
    engine.step()                                   # r0 mid-prefill (32 of 80 tokens)
    assert engine.kv_cache.usage().num_seqs == 1
    engine.abort_request("r0")
    assert engine.kv_cache.usage().used_tokens == 0
    engine.abort_request("r0")                      # idempotent
    outs = {o.request_id: o for o in engine.step()}
    assert outs["r0"].finished and outs["r0"].outputs[0].finish_reason == "abort"
    for _ in range(3):
        engine.step()
    before = engine.kv_cache.usage().used_tokens
    assert before > 0
    engine.abort_request("r1")                      # while decoding
    engine.abort_request("r-unknown")               # ignored
    assert engine.kv_cache.usage().used_tokens < before
    final = run_all(engine)
    assert final["r1"].outputs[0].finish_reason == "abort"
    assert final["r2"].outputs[0].finish_reason == "length"
    assert engine.kv_cache.usage().used_tokens == 0 and not engine.has_unfinished_requests()


def test_abort_waiting_request(tiny, backend):
    engine = make_engine(tiny, backend, max_num_seqs=1)
    p = random_prompts(len(tiny["tokenizer"]), [8, 8], seed=7)
    engine.add_request("a", None, greedy(4), prompt_token_ids=p[0])
    engine.add_request("b", None, greedy(4), prompt_token_ids=p[1])
    engine.step()
    assert engine.get_stats().num_waiting == 1
    engine.abort_request("b")
    assert engine.num_unfinished_requests() == 1
    final = run_all(engine)
    assert final["b"].outputs[0].finish_reason == "abort" and final["b"].outputs[0].token_ids == []
    assert final["a"].outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_per_request(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [12], seed=8)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)

    def sample(extra: int) -> list[int]:
        engine = make_engine(tiny, backend, seed=extra)
        for j, p in enumerate(random_prompts(len(tiny["tokenizer"]), [9] * extra, seed=99)):
            engine.add_request(f"other{j}", None, SamplingParams(temperature=1.0, max_tokens=10),
                               prompt_token_ids=p)
        engine.add_request("me", None, params, prompt_token_ids=prompt)
        return run_all(engine)["me"].outputs[0].token_ids

    alone, batched = sample(0), sample(3)
    assert alone == batched and len(alone) == 16
    engine = make_engine(tiny, backend)
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=16,
                           ignore_eos=True)
    engine.add_request("x", None, other, prompt_token_ids=prompt)
    assert run_all(engine)["x"].outputs[0].token_ids != alone


def test_max_tokens_and_ignore_eos(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [10], seed=9)[0]
    ref = hf_greedy(tiny["hf"], prompt, 12)
    engine = make_engine(tiny, backend)
    engine.eos_token_ids = (ref[4],)                # pretend the 5th greedy token is EOS
    engine.add_request("eos", None, SamplingParams(temperature=0, max_tokens=12), prompt_token_ids=prompt)
    engine.add_request("ign", None, greedy(12), prompt_token_ids=prompt)
    engine.add_request("len", None, greedy(3), prompt_token_ids=prompt)
    final = run_all(engine)
    eos_at = ref.index(ref[4])
    assert final["eos"].outputs[0].token_ids == ref[:eos_at + 1]
    assert final["eos"].outputs[0].finish_reason == "stop"
    assert final["eos"].outputs[0].stop_reason is None
    assert final["ign"].outputs[0].token_ids == ref
    assert final["len"].outputs[0].token_ids == ref[:3]
    assert final["len"].outputs[0].finish_reason == "length"


def test_stop_token_ids(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [10], seed=10)[0]
    ref = hf_greedy(tiny["hf"], prompt, 12)
    stop_id = ref[6]
    engine = make_engine(tiny, backend)
    engine.add_request("s", None, greedy(12, stop_token_ids=[stop_id]), prompt_token_ids=prompt)
    out = run_all(engine)["s"].outputs[0]
    k = ref.index(stop_id)
    assert out.token_ids == ref[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    tok = tiny["tokenizer"]
    assert out.text == tok.decode(ref[:k], skip_special_tokens=True)   # stop token's text left out


def test_stop_strings_truncate_and_hold_back(tiny, backend):
    tok = tiny["tokenizer"]
    prompt = tok.encode("The capital of France is")
    engine = make_engine(tiny, backend)
    engine.add_request("full", None, greedy(40), prompt_token_ids=prompt)
    full = run_all(engine)["full"].outputs[0].text
    assert len(full) > 12
    stop = full[8:11]
    idx = full.find(stop)
    engine = make_engine(tiny, backend)
    engine.add_request("s", None, greedy(40, stop=[stop, "\x00never"]), prompt_token_ids=prompt)
    texts = []
    final = run_all(engine, on_step=None)
    out = final["s"].outputs[0]
    assert out.text == full[:idx]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # streamed texts never contain the stop string (they are prefixes of the final text)
    engine = make_engine(tiny, backend)
    engine.add_request("t", None, greedy(40, stop=stop), prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert all(full[:idx].startswith(t) for t in texts) and texts[-1] == full[:idx]


def test_incremental_text_equals_full_decode(tiny, backend):
    tok = tiny["tokenizer"]
    engine = make_engine(tiny, backend)
    prompts = ["Hello world!", "Paged attention stores", "0123"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(30))
    final = run_all(engine)
    for i, p in enumerate(prompts):
        out = final[f"r{i}"]
        assert out.prompt == p and out.prompt_token_ids == tok.encode(p)
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


# ---------------------------------------------------------------------- prefix caching
def test_prefix_cache_hit_is_not_recomputed(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [100], seed=11)[0]
    ref = hf_greedy(tiny["hf"], prompt, 10)
    engine = make_engine(tiny, backend)
    engine.add_request("first", None, greedy(10), prompt_token_ids=prompt)
    first = run_all(engine)["first"]
    computed_before = engine.get_stats().num_prompt_tokens_total
    engine.add_request("second", None, greedy(10), prompt_token_ids=prompt)
    second = run_all(engine)["second"]
    stats = engine.get_stats()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0 and second.num_cached_tokens % 8 == 0
    assert stats.num_prompt_tokens_total - computed_before == len(prompt) - second.num_cached_tokens
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == ref
    assert stats.prefix_hit_rate > 0


def test_prefix_caching_disabled(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [64], seed=12)[0]
    engine = make_engine(tiny, backend, enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(rid, None, greedy(4), prompt_token_ids=prompt)
        assert run_all(engine)[rid].num_cached_tokens == 0


def test_cache_salt_isolates_prefix_cache(tiny, backend):
    """Issue 9: a request's ``cache_salt`` reaches the KV cache's ``extra_key``, so tenants with
    different salts (or salted vs unsalted) never share a cached prefix; the same salt does."""
    prompt = random_prompts(len(tiny["tokenizer"]), [64], seed=13)[0]
    ref = hf_greedy(tiny["hf"], prompt, 4)
    engine = make_engine(tiny, backend)

    def cached(rid, salt):
        engine.add_request(rid, None, greedy(4), prompt_token_ids=prompt, cache_salt=salt)
        out = run_all(engine)[rid]
        assert out.outputs[0].token_ids == ref
        return out.num_cached_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("b1", "tenant-b") == 0          # another salt: no hit
    assert cached("a2", "tenant-a") > 0           # same salt: hit
    assert cached("n1", None) == 0                # no salt vs salted: no hit
    assert cached("n2", None) > 0
    engine.kv_cache.check_integrity()
    for bad in ("", 5, b"x", ["a"]):
        with pytest.raises(ValueError, match="cache_salt"):
            engine.add_request("bad", None, greedy(4), prompt_token_ids=prompt, cache_salt=bad)
    assert engine.num_unfinished_requests() == 0


def test_offline_llm_prompt_dicts_take_cache_salt(tiny, backend):
    from vmkv import LLM

    opts = dict(BACKENDS[backend])
    kv_backend = opts.pop("kv_backend")
    llm = LLM(tiny["path"], kv_backend=kv_backend, device="cpu", max_model_len=128,
              memory_bytes=512 * BYTES_PER_TOKEN, **opts)
    ids = random_prompts(len(tiny["tokenizer"]), [48], seed=14)[0]
    text = "The capital of France is Paris. The capital of Italy is Rome. " * 2
    p = greedy(2)
    for prompt in ({"prompt_token_ids": ids}, {"prompt": text}):
        first = llm.generate({**prompt, "cache_salt": "x"}, p, use_tqdm=False)[0]
        other = llm.generate({**prompt, "cache_salt": "y"}, p, use_tqdm=False)[0]
        same = llm.generate({**prompt, "cache_salt": "x"}, p, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
        assert same.num_cached_tokens > 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 3}, p, use_tqdm=False)
    # the same rule as the server's: a lone surrogate is not text (the server answers 400)
    with pytest.raises(ValueError, match="cache_salt contains a lone UTF-16 surrogate"):
        llm.generate({"prompt": "a", "cache_salt": "\ud800"}, p, use_tqdm=False)
    # a wrong argument type is named, not an AttributeError/TypeError from deep inside
    with pytest.raises(TypeError, match="prompts must be a str, a prompt dict or a list of them, got NoneType"):
        llm.generate(None, p, use_tqdm=False)
    with pytest.raises(TypeError, match="params .sampling_params. must be a SamplingParams, a list of them or "
                                        "None, got dict"):
        llm.generate("a", {"max_tokens": 1}, use_tqdm=False)
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        llm.generate(["a"], [{"max_tokens": 1}], use_tqdm=False)
    assert llm.engine.num_unfinished_requests() == 0


# ---------------------------------------------------------------------- validation, stats, metrics
def test_request_validation(tiny, backend):
    engine = make_engine(tiny, backend, max_model_len=32)
    with pytest.raises(PromptTooLongError, match="32") as e:
        engine.add_request("long", None, greedy(4), prompt_token_ids=[5] * 32)
    assert (e.value.prompt_len, e.value.max_model_len) == (32, 32)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", "", greedy(4))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", None, greedy(4), prompt_token_ids=[])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("v", None, greedy(4), prompt_token_ids=[10 ** 6])
    engine.add_request("dup", None, greedy(4), prompt_token_ids=[5, 6])
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", None, greedy(4), prompt_token_ids=[5, 6])
    # max_model_len caps the output: 31 prompt tokens leave room for one
    engine.add_request("edge", None, greedy(10), prompt_token_ids=[5] * 31)
    final = run_all(engine)
    assert len(final["edge"].outputs[0].token_ids) == 1
    assert final["edge"].outputs[0].finish_reason == "length"


def test_budget_too_small_for_max_model_len_is_rejected(tiny, backend):
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(tiny, backend, memory_bytes=64 * BYTES_PER_TOKEN, max_model_len=256)
    # without an explicit max_model_len the default (the model's 1024) is lowered to fit
    engine = make_engine(tiny, backend, memory_bytes=300 * BYTES_PER_TOKEN, max_model_len=None)
    assert 256 <= engine.max_model_len <= 300
    assert engine.kv_cache.usage().free_tokens >= engine.max_model_len
    engine = make_engine(tiny, backend, max_model_len=None, memory_bytes=None)   # 256 MiB on CPU
    assert engine.max_model_len == 1024
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine2 = make_engine(tiny, backend, max_num_seqs=2)
        engine2.add_request("n", None, greedy(2, n=3), prompt_token_ids=[5, 6])


def test_metrics_and_stats(tiny, backend):
    engine = make_engine(tiny, backend)
    engine.add_request("m", None, greedy(5), prompt_token_ids=[5, 6, 7], arrival_time=1.0)
    out = run_all(engine)["m"]
    m = out.metrics
    assert m.arrival_time == 1.0
    assert m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert len(m.token_times) == 5
    s = engine.get_stats()
    assert s.num_steps == 5 and s.num_generation_tokens_total == 5 and s.num_finished_total == 1
    assert s.step_time_s_total >= s.last_step_time_s > 0
    assert s.max_concurrent_seqs == 1


def test_chat_template_and_offline_llm(tiny, backend):
    from vmkv import LLM, SamplingParams as SP

    opts = dict(BACKENDS[backend])
    llm = LLM(tiny["path"], device="cpu", max_model_len=256, memory_bytes=512 * BYTES_PER_TOKEN,
              **opts)
    tok = tiny["tokenizer"]
    msgs = [{"role": "user", "content": "Hello world!"}]
    outs = llm.chat(msgs, SP(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    want = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)
    assert outs[0].prompt_token_ids == want
    assert outs[0].outputs[0].token_ids == hf_greedy(tiny["hf"], want, 6)
    outs = llm.generate(["Hello", {"prompt_token_ids": [5, 6, 7]}],
                        sampling_params=SP(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello", None]
    assert outs[0].prompt_token_ids == tok.encode("Hello")
    assert outs[1].outputs[0].token_ids == hf_greedy(tiny["hf"], [5, 6, 7], 3)
    per_prompt = llm.generate(["a", "b"], [SP(max_tokens=1), SP(max_tokens=2, ignore_eos=True)],
                              use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in per_prompt][1] == 2
    with pytest.raises(ValueError):
        llm.chat([{"role": "user"}])
    with pytest.raises(ValueError):
        llm.generate([1, 2, 3])
    assert not llm.engine.has_unfinished_requests()


def test_offline_api_new_user_inputs(tiny, backend, monkeypatch):
    """Found by a new-user pass over the README's offline API."""
    import numpy as np

    from vmkv import LLM, SamplingParams as SP

    opts = dict(BACKENDS[backend])
    kv_backend = opts.pop("kv_backend")
    # `backend=` (the name of `vmkv generate --backend` and create_kv_cache) works like kv_backend=
    llm = LLM(tiny["path"], backend=kv_backend, device="cpu", max_model_len=64,
              memory_bytes=512 * BYTES_PER_TOKEN, **opts)
    assert llm.engine.kv_cache.backend == kv_backend
    with pytest.raises(TypeError, match="once"):
        LLM(tiny["path"], kv_backend="vmem", backend="paged")
    p = SP(temperature=0, max_tokens=3, ignore_eos=True)
    # a bad prompt anywhere in the list rejects the call and leaves nothing queued or holding KV
    for bad in ("", {"prompt_token_ids": []}, {"prompt_token_ids": [10 ** 6]}, "water " * 100):
        with pytest.raises(ValueError):
            llm.generate(["Hello", {"prompt_token_ids": [5, 6, 7]}, bad], p, use_tqdm=False)
        assert llm.engine.num_unfinished_requests() == 0 and llm.engine.kv_cache.usage().num_seqs == 0
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)
    assert len(outs) == 1 and outs[0].outputs[0].token_ids == hf_greedy(tiny["hf"], [5, 6, 7], 3)
    # token ids must be integers: no silent int(1.5); numpy integers are fine
    for bad_ids in ([5, 1.5], ["a"], [True, 5]):
        with pytest.raises(ValueError, match="integers"):
            llm.generate({"prompt_token_ids": bad_ids}, p, use_tqdm=False)
    assert llm.generate({"prompt_token_ids": np.array([5, 6, 7])}, p, use_tqdm=False)[0].prompt_token_ids \
        == [5, 6, 7]
    with pytest.raises(TypeError, match="once"):
        llm.generate("Hello", p, sampling_params=p)
    # chat accepts OpenAI text content parts, like the server
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                   {"type": "text", "text": "world!"}]}], p, use_tqdm=False)
    plain = llm.chat([{"role": "user", "content": "Hello\nworld!"}], p, use_tqdm=False)
    assert parts[0].prompt_token_ids == plain[0].prompt_token_ids
    assert parts[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="text"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    # megabytes of text are rejected from their length, without running the tokenizer
    monkeypatch.setattr(llm.engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(PromptTooLongError, match="at least") as e:
        llm.generate("water " * 200_000, p, use_tqdm=False)
    assert e.value.prompt_len >= 64 and e.value.max_model_len == 64
    with pytest.raises(PromptTooLongError, match="at least"):
        llm.chat([{"role": "user", "content": "water " * 200_000}], p, use_tqdm=False)
    assert llm.engine.num_unfinished_requests() == 0


def test_cli_generate(tiny, backend, capsys):
    from vmkv.cli import main

    tok = tiny["tokenizer"]
    opts = ["--driver", "host", "--page-size-bytes", "4KiB"] if backend == "vmem" else []
    common = ["generate", "--backend", backend, "--model", tiny["path"], "--device", "cpu",
              "--memory-bytes", "256KiB", "--max-model-len", "256", "--max-tokens", "6",
              "--ignore-eos", *opts]
    assert main([*common, "--prompt", "Hello world!"]) == 0
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello world!"}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    want = tok.decode(hf_greedy(tiny["hf"], chat_ids, 6), skip_special_tokens=True)
    assert capsys.readouterr().out == want + "\n"
    assert main([*common, "--no-chat", "--no-stream", "--prompt", "Hello world!"]) == 0
    want = tok.decode(hf_greedy(tiny["hf"], tok.encode("Hello world!"), 6), skip_special_tokens=True)
    assert capsys.readouterr().out == want + "\n"
    assert main([*common, "--prompt", "x", "--temperature", "9"]) == 2
    assert "temperature" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_under_pressure(tiny, backend, seed):
    """Mixed lengths, shared prefixes, n=2, aborts, a tight cache and a small step budget: every
    step keeps the cache consistent, every request finishes, greedy outputs equal a run with
    a roomy cache (itself checked against transformers above), and no KV is left behind."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(tiny["tokenizer"])
    shared = random_prompts(vocab, [40], seed=100 + seed)[0]
    reqs = []
    for i in range(12):
        n_tok = int(torch.randint(4, 50, (1,), generator=g))
        p = random_prompts(vocab, [n_tok], seed=1000 * seed + i)[0]
        if i % 3 == 0:
            p = shared + p[:10]
        params = greedy(int(torch.randint(3, 30, (1,), generator=g)), n=2 if i % 4 == 1 else 1)
        reqs.append((f"r{i}", p, params))
    aborted = {"r3", "r8"}

    def run(engine, abort: bool):
        for rid, p, params in reqs:
            engine.add_request(rid, None, params, prompt_token_ids=p)
        final, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if abort and steps in (3, 9):
                engine.abort_request("r3" if steps == 3 else "r8")
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            engine.kv_cache.check_integrity()
        return final

    roomy = run(make_engine(tiny, "paged", memory_bytes=2048 * BYTES_PER_TOKEN), abort=False)
    engine = make_engine(tiny, backend, memory_bytes=160 * BYTES_PER_TOKEN, max_model_len=128,
                         max_num_batched_tokens=24, max_num_seqs=6)
    tight = run(engine, abort=True)
    assert sorted(tight) == sorted(r[0] for r in reqs)
    for rid, _, params in reqs:
        outs = tight[rid].outputs
        assert len(outs) == params.n
        if rid in aborted:
            assert all(c.finish_reason == "abort" for c in outs)
            continue
        assert [c.token_ids for c in outs] == [c.token_ids for c in roomy[rid].outputs], rid
    stats = engine.get_stats()
    assert stats.num_preempted_total > 0 and stats.num_prefill_chunks_total > 0
    assert stats.kv_usage.used_tokens == 0 and stats.kv_usage.num_seqs == 0
