"""vmem on the CUDA driver under memory pressure, through the real engine (issue 9).

On the H200, ``vmkv compare engine --backends vmem ... --memory-gib 6`` died in its first steps with
``ValueError: Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)``: Triton's launcher
checks every pointer argument with ``cuPointerGetAttribute``, and the K/V views' first element (slot
0, position 0) lies in a reserved but unmapped page whenever slot 0 holds no page.  The fix: every
reservation starts with a guard page mapped once, and every launch receives that address plus the
view's element offset (``vmkv/vmem/layout.py``, "guard page").  These tests drive vmem on the CUDA
driver where pages are scarce (preemption storms, prefix sharing, fork/copy-on-write, an exhausted
pool, slot 0 unmapped while other slots run, ``cuMemCreate`` failing): every request completes or
fails with a typed error on its own output, the engine never crashes, and greedy outputs equal the
paged backend's.

The model: a random Llama (2 layers, 16 query heads, 8 KV heads x 128 dims, float32 with a large
``initializer_range`` so greedy argmax margins are far above rounding; no download).  Its K/V take
16 KiB per token: 128 tokens per 2 MiB megacache page; per_layer maps 4 pages (8 MiB) per 512 tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import build_tokenizer, random_prompts
from vmkv import KVCacheFullError, KVCacheSpec, StepSeq
from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams
from vmkv.kernels.reference import attention_one_seq_ref
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: caches get CheckedDriver

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DRIVER = "cuda"
MIB = 1 << 20
PAGE = 2 * MIB
MAX_LEN = 1024
LAYOUTS = ["megacache", "per_layer"]
#: bytes of one 2 MiB-page unit per layout, and tokens it holds
UNIT_BYTES = {"megacache": PAGE, "per_layer": 4 * PAGE}
UNIT_TOKENS = {"megacache": 128, "per_layer": 512}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama-pressure")
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2 * MAX_LEN,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.25,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def _engine(model_dir: str, backend: str, memory_bytes: int, layout: str = "megacache",
            **knobs) -> LLMEngine:
    opts = {"driver": DRIVER, "layout": layout, "page_size_bytes": PAGE} if backend == "vmem" else {}
    knobs = {"max_model_len": MAX_LEN, "max_num_batched_tokens": 256, "max_num_seqs": 8, **knobs}
    cfg = EngineConfig.from_args(model_dir, backend, DEVICE, "float32", memory_bytes=memory_bytes,
                                 **opts, **knobs)
    return LLMEngine(cfg)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Add the requests, step until none is unfinished (a crash fails the test), check the cache."""
    for rid, prompt, params in requests:
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    final = {}
    for _ in range(20_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    assert set(final) == {rid for rid, _, _ in requests}
    cache = engine.kv_cache
    assert cache.usage().used_tokens == 0
    cache.check_integrity()
    return final


def _error(out) -> str | None:
    """Why the request failed (``RequestOutput.error``), or None."""
    return getattr(out, "error", None)


def _tokens(final: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in final.items()}


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def _storm_requests(vocab: int) -> list:
    lengths = [300, 40, 560, 120, 450, 90, 610, 200, 350, 70, 500, 260]
    prompts = random_prompts(vocab, lengths, seed=7)
    out_lens = [120, 200, 64, 180, 150, 100, 90, 220, 130, 160, 110, 140]
    return [(f"s{i}", p, _greedy(m)) for i, (p, m) in enumerate(zip(prompts, out_lens))]


@pytest.fixture(scope="module")
def paged_storm(model_dir):
    """The storm's outputs on the paged backend with room for everything (the reference)."""
    engine = _engine(model_dir, "paged", 64 * MIB)
    final = _run(engine, _storm_requests(engine.model_config.vocab_size))
    assert all(_error(out) is None for out in final.values())
    engine.close()
    return _tokens(final)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preemption_storm_with_a_small_budget_matches_paged(model_dir, paged_storm, layout):
    """12 requests, 8 slots, KV for about 1.5 of the longest sequences: pages are reclaimed from freed
    and preempted slots (slot 0's included) while the rest run; every request completes."""
    budget = {"megacache": 10 * PAGE, "per_layer": 3 * UNIT_BYTES["per_layer"]}[layout]
    engine = _engine(model_dir, "vmem", budget, layout)
    final = _run(engine, _storm_requests(engine.model_config.vocab_size))
    assert all(_error(out) is None for out in final.values()), {r: _error(o) for r, o in final.items()}
    assert _tokens(final) == paged_storm
    stats = engine.get_stats()
    assert stats.num_preempted_total > 0
    assert engine.kv_cache.vmm_stats()["num_reclaimed_pages"] > 0
    engine.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_sharing_and_fork_copy_on_write_match_paged(model_dir, layout):
    """Prompts sharing a 2-unit prefix (page sharing) with n=3 (fork; the first write into the shared
    last page copies it) on a tight budget; outputs equal paged's.  The first prompt runs alone, so
    the others find its prefix cached."""
    ut = UNIT_TOKENS[layout]
    vocab = len(build_tokenizer())
    shared = random_prompts(vocab, [2 * ut], seed=11)[0]
    tails = random_prompts(vocab, [5, 37, 64, 90, 3], seed=12)
    requests = [(f"p{i}", shared + t, _greedy(48, n=3)) for i, t in enumerate(tails)]
    reference = _engine(model_dir, "paged", 64 * MIB, max_model_len=2 * ut + 160)
    want = {**_tokens(_run(reference, requests[:1])), **_tokens(_run(reference, requests[1:]))}
    reference.close()
    budget = {"megacache": 12 * PAGE, "per_layer": 8 * UNIT_BYTES["per_layer"]}[layout]
    engine = _engine(model_dir, "vmem", budget, layout, max_model_len=2 * ut + 160)
    final = {**_run(engine, requests[:1]), **_run(engine, requests[1:])}
    assert all(_error(out) is None for out in final.values()), {r: _error(o) for r, o in final.items()}
    assert _tokens(final) == want
    assert all(len(c) == 48 for out in want.values() for c in out)
    usage = engine.kv_cache.usage()
    assert usage.prefix_hit_tokens > 0 and usage.num_cow_copies > 0
    engine.close()


def _spec() -> KVCacheSpec:
    return KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=DEVICE)


def _cache(layout: str, num_units: int, max_num_seqs: int = 4):
    from vmkv.vmem import VMemKVCache

    spec = _spec()
    # bf16: 8 KiB per token in megacache (256 tokens per page), 2 KiB per reservation row in per_layer
    unit_bytes = PAGE * (1 if layout == "megacache" else 2 * spec.num_layers)
    return spec, VMemKVCache(spec, max_num_seqs=max_num_seqs, max_model_len=4096, driver=DRIVER,
                             memory_bytes=num_units * unit_bytes, layout=layout, page_size_bytes=PAGE,
                             enable_prefix_caching=False)


def _step(c, spec, batch, written: dict, seed: int) -> None:
    """prepare + write_kv + attention (Triton on CUDA) for every layer, checked against the reference."""
    meta = c.prepare(batch)
    g = torch.Generator(device=spec.device).manual_seed(seed)
    num_heads = 2 * spec.num_kv_heads
    for layer in range(spec.num_layers):
        shape = (meta.num_tokens, spec.num_kv_heads, spec.head_dim)
        k = torch.randn(shape, generator=g, device=spec.device).to(spec.dtype)
        v = torch.randn(shape, generator=g, device=spec.device).to(spec.dtype)
        q = torch.randn((meta.num_tokens, num_heads, spec.head_dim), generator=g,
                        device=spec.device).to(spec.dtype)
        c.write_kv(layer, k, v, meta)
        out = c.attention(layer, q, meta)
        start = 0
        for e in batch:
            n = e.num_new_tokens
            ok, ov = written.get((e.seq_id, layer), (k[:0], v[:0]))
            ok, ov = torch.cat([ok, k[start:start + n]]), torch.cat([ov, v[start:start + n]])
            written[(e.seq_id, layer)] = (ok, ov)
            ref = attention_one_seq_ref(q[start:start + n].float(), ok.float(), ov.float(),
                                        e.num_computed_tokens, spec.head_dim ** -0.5)
            torch.testing.assert_close(out[start:start + n].float(), ref, atol=2e-2, rtol=2e-2)
            start += n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slot0_unmapped_while_other_slots_run(layout):
    """The crash itself: slot 0's pages go to the sequence in slot 1, so the views' base address is
    reserved but unmapped; prefill and decode launches (Triton) still run and are correct."""
    spec, c = _cache(layout, num_units=3)
    ut = c.unit_tokens
    c.allocate("a", ut)
    c.allocate("b", ut)
    assert (c.slot_of("a"), c.slot_of("b")) == (0, 1)
    written: dict = {}
    _step(c, spec, [StepSeq("a", 0, ut), StepSeq("b", 0, ut)], written, seed=1)
    c.free("a")
    c.extend("b", 2 * ut - 1)                   # reclaims slot 0's unit (after a's last read)
    states = {c.driver.page_state(c.key_view(layer).data_ptr()) for layer in range(spec.num_layers)}
    assert states == {"unmapped"}               # what Triton's launcher refused before the fix
    c.check_integrity()
    _step(c, spec, [StepSeq("b", ut, 2 * ut - 2)], written, seed=2)      # chunked prefill
    c.extend("b", 1)
    _step(c, spec, [StepSeq("b", 3 * ut - 2, 1)], written, seed=3)       # decode
    torch.cuda.synchronize()
    for layer in range(spec.num_layers):
        gk, gv = c.gather("b", layer)
        ok, ov = written[("b", layer)]
        assert torch.equal(gk[:ok.shape[0]], ok) and torch.equal(gv[:ov.shape[0]], ov)
    with pytest.raises(KVCacheFullError):       # every page is b's now
        c.allocate("c", ut + 1)
    c.free("b")
    c.allocate("c", 5)
    _step(c, spec, [StepSeq("c", 0, 5)], written, seed=4)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pool_exhaustion_is_a_typed_error_and_state_is_unchanged(layout):
    """Fill every page; the next allocate/extend raises KVCacheFullError, nothing changes, and the
    kernels keep running on the live sequences; after frees everything is reusable."""
    spec, c = _cache(layout, num_units=4, max_num_seqs=4)
    ut = c.unit_tokens
    written: dict = {}
    for i, n in enumerate([2 * ut, ut, ut]):
        c.allocate(i, n)
    _step(c, spec, [StepSeq(0, 0, 2 * ut), StepSeq(1, 0, ut), StepSeq(2, 0, ut)], written, seed=5)
    before = c.usage()
    with pytest.raises(KVCacheFullError):
        c.allocate(3, 1)
    with pytest.raises(KVCacheFullError):
        c.extend(1, 1)
    assert c.usage() == before
    c.check_integrity()
    c.free(0)                                   # its 2 units stay mapped until someone needs them
    c.extend(1, 1)
    _step(c, spec, [StepSeq(1, ut, 1)], written, seed=7)
    c.allocate(3, ut)
    _step(c, spec, [StepSeq(3, 0, ut)], written, seed=8)
    torch.cuda.synchronize()
    for (seq, layer), (ok, ov) in written.items():
        if seq in (1, 2, 3):
            gk, gv = c.gather(seq, layer)
            assert torch.equal(gk[:ok.shape[0]], ok) and torch.equal(gv[:ov.shape[0]], ov)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cumemcreate_failure_fails_requests_not_the_engine(model_dir, layout, monkeypatch):
    """Every third cuMemCreate fails with CUDA_ERROR_OUT_OF_MEMORY: each request completes or
    finishes with its error set; the engine never raises, its cache stays consistent, and once
    cuMemCreate works again a request completes with paged's greedy output."""
    from vmkv.vmem.driver import VMMError

    budget = {"megacache": 16 * PAGE, "per_layer": 4 * UNIT_BYTES["per_layer"]}[layout]
    engine = _engine(model_dir, "vmem", budget, layout)
    driver = engine.kv_cache.driver
    real_create = driver.create_page
    calls = {"n": 0, "failed": 0, "on": True}

    def flaky_create_page():
        calls["n"] += 1
        if calls["on"] and calls["n"] % 3 == 0:
            calls["failed"] += 1
            raise VMMError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", "injected by the test")
        return real_create()

    monkeypatch.setattr(driver, "create_page", flaky_create_page)
    requests = _storm_requests(engine.model_config.vocab_size)
    final = _run(engine, requests)
    assert calls["failed"] > 0
    lengths = {rid: p.max_tokens for rid, _, p in requests}
    for rid, out in final.items():
        if _error(out) is None:
            assert all(len(c.token_ids) == lengths[rid] for c in out.outputs), rid
        else:
            assert "cuMemCreate" in _error(out) or "KV" in _error(out), _error(out)
            assert all(c.finish_reason in ("error", "length") for c in out.outputs)
    calls["on"] = False
    prompt = random_prompts(engine.model_config.vocab_size, [300], seed=21)[0]
    after = _run(engine, [("after", prompt, _greedy(40))])
    reference = _engine(model_dir, "paged", 64 * MIB)
    want = _run(reference, [("after", prompt, _greedy(40))])
    reference.close()
    assert _error(after["after"]) is None and _tokens(after) == _tokens(want)
    engine.close()
