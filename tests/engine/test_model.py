"""Model tests: our Llama-family decoder against transformers, through both KV backends.

Tiny random checkpoints are made inside the tests with ``save_pretrained`` (no download); GGUF files
are written with ``gguf.GGUFWriter`` (F32, Q8_0 and Q4_1 tensors, llama.cpp's Q/K permutation, a
byte-level BPE tokenizer and a chat template).  The default SmolLM2 test is marked ``slow``.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from vmkv.kvcache import StepSeq, create_kv_cache
from vmkv.model import (
    SHAPES,
    LlamaForCausalLM,
    ModelConfig,
    UnsupportedModelError,
    load_model,
    random_model,
)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

BACKENDS = ["paged", "vmem"]
ATOL = RTOL = 2e-4
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: one intra-op thread avoids OpenMP spin contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------- helpers
def make_cache(backend: str, config: ModelConfig, *, max_num_seqs: int = 4, max_model_len: int = 64):
    spec = config.kv_spec("cpu", torch.float32)
    options = {"driver": "host"} if backend == "vmem" else {}
    memory_bytes = max(1 << 20, 2 * spec.kv_bytes(max_num_seqs * max_model_len))
    return create_kv_cache(backend, spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           memory_bytes=memory_bytes, **options)


def run_step(model, cache, tokens: dict, batch: list[StepSeq]) -> torch.Tensor:
    """One engine-like step: prepare once, then the model's forward over the batch."""
    meta = cache.prepare(batch)
    ids = torch.tensor([t for e in batch
                        for t in tokens[e.seq_id][e.num_computed_tokens:e.num_computed_tokens + e.num_new_tokens]])
    return model(ids, meta.positions, cache, meta)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_kv(hf_model, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' cached K and V per layer, each ``[num_tokens, num_kv_heads, head_dim]``."""
    with torch.no_grad():
        cache = hf_model(torch.tensor([token_ids]), use_cache=True).past_key_values
    return [(lc.keys[0].transpose(0, 1), lc.values[0].transpose(0, 1)) for lc in cache.layers]


def randomize_(hf_model, seed: int = 0) -> None:
    """Non-trivial weights: unit-scale projections, norms near 1, non-zero biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


def tiny_hf_model(variant: str, vocab_size: int = 128):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if variant == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif variant == "llama3_tied":
        cfg = transformers.LlamaConfig(
            **common, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32})
        cls = transformers.LlamaForCausalLM
    elif variant == "qwen2_bias":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        cls = transformers.Qwen2ForCausalLM
    elif variant == "mistral_linear":
        cfg = transformers.MistralConfig(
            **common, head_dim=32, sliding_window=None,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
        cls = transformers.MistralForCausalLM
    else:
        raise AssertionError(variant)
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    randomize_(model)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def check_against_hf(model, hf_model, backend: str) -> None:
    """Full prefill of every position, then chunked prefill + decode of two interleaved sequences."""
    config = model.config
    gen = torch.Generator().manual_seed(1)
    tokens = {0: torch.randint(0, config.vocab_size, (16,), generator=gen).tolist(),
              1: torch.randint(0, config.vocab_size, (10,), generator=gen).tolist()}
    ref = {s: hf_logits(hf_model, t) for s, t in tokens.items()}

    # (1) one prefill of sequence 0: logits at every position (forward_hidden + compute_logits)
    with make_cache(backend, config) as cache:
        cache.allocate(5, 16)
        meta = cache.prepare([StepSeq(5, 0, 16)])
        hidden = model.forward_hidden(torch.tensor(tokens[0]), meta.positions, cache, meta)
        torch.testing.assert_close(model.compute_logits(hidden), ref[0], atol=ATOL, rtol=RTOL)

    # (2) chunked prefill (0: 5+5+3 prompt tokens; 1: 7 at once) mixed with decode steps
    with make_cache(backend, config) as cache:
        cache.allocate(0, 13)
        cache.allocate(1, 7)
        steps = [[StepSeq(0, 0, 5)],
                 [StepSeq(0, 5, 5), StepSeq(1, 0, 7)],
                 [StepSeq(1, 7, 1), StepSeq(0, 10, 3)],
                 [StepSeq(0, 13, 1), StepSeq(1, 8, 1)],
                 [StepSeq(0, 14, 1), StepSeq(1, 9, 1)],
                 [StepSeq(0, 15, 1)]]
        for batch in steps:
            for e in batch:
                grow = e.num_computed_tokens + e.num_new_tokens - cache.seq_len(e.seq_id)
                if grow > 0:
                    cache.extend(e.seq_id, grow)
            logits = run_step(model, cache, tokens, batch)
            assert logits.dtype == torch.float32 and logits.shape == (len(batch), config.vocab_size)
            expected = torch.stack([ref[e.seq_id][e.num_computed_tokens + e.num_new_tokens - 1]
                                    for e in batch])
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
        # the cache holds exactly the K/V (after RoPE) that transformers caches, in every layer
        for sid in (0, 1):
            for layer, (k_ref, v_ref) in enumerate(hf_kv(hf_model, tokens[sid])):
                k, v = cache.gather(sid, layer)
                torch.testing.assert_close(k, k_ref, atol=ATOL, rtol=RTOL)
                torch.testing.assert_close(v, v_ref, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------- Hugging Face directories
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["llama", "llama3_tied", "qwen2_bias", "mistral_linear"])
def test_hf_dir_matches_transformers(tmp_path, variant, backend):
    hf_model = tiny_hf_model(variant)
    hf_model.save_pretrained(tmp_path / variant)
    loaded = load_model(str(tmp_path / variant), device="cpu", dtype=None)
    assert loaded.model.dtype == torch.float32 and loaded.tokenizer is None
    assert loaded.name == variant and loaded.source == str(tmp_path / variant)
    cfg = loaded.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (2, 4, 2, 128)
    assert cfg.tie_word_embeddings == (variant == "llama3_tied")
    assert cfg.qkv_bias == (variant == "qwen2_bias")
    assert cfg.head_dim == (32 if variant == "mistral_linear" else 16)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    check_against_hf(loaded.model, hf_model, backend)


def test_hf_dir_sharded_and_errors(tmp_path):
    hf_model = tiny_hf_model("llama")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = load_model(str(tmp_path / "sharded"), device="cpu", dtype=torch.float32)
    with make_cache("paged", loaded.config) as cache:
        cache.allocate(0, 6)
        logits = run_step(loaded.model, cache, {0: [3, 1, 4, 1, 5, 9]}, [StepSeq(0, 0, 6)])
    torch.testing.assert_close(logits[0], hf_logits(hf_model, [3, 1, 4, 1, 5, 9])[-1], atol=ATOL, rtol=RTOL)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path / "empty"), device="cpu")
    cfg = json.loads((tmp_path / "sharded" / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "sharded" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2"):
        load_model(str(tmp_path / "sharded"), device="cpu")


def test_missing_and_misshaped_weights_are_named(tmp_path):
    config = SHAPES["tiny"]
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"q_proj.weight.*shape \(3, 64\)"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 64))])
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.7"):
        model.load_weights([("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64))])
    model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])
    missing = model.missing_weights()
    assert "layers.0.self_attn.qkv_proj.weight[1]" in missing
    assert "layers.0.self_attn.qkv_proj.weight[0]" not in missing


# ---------------------------------------------------------------------- config
def test_config_validation_and_shapes():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=6,
                    num_kv_heads=4, head_dim=8)
    with pytest.raises(UnsupportedModelError, match="supported: default, linear, llama3"):
        ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4,
                    num_kv_heads=4, head_dim=16, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="supported: llama, qwen2"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gpt2"}, {})
    # transformers 4.x keys (rope_theta + rope_scaling with "type"), EOS ids merged from generation_config
    v4 = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
          "intermediate_size": 96, "vocab_size": 32, "rope_theta": 5e5, "eos_token_id": 7,
          "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    cfg = ModelConfig.from_hf_config(v4, {"eos_token_id": [7, 9]})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == (7, 9) and cfg.num_kv_heads == 4 and cfg.head_dim == 16
    # published sizes: Llama-3-8B 8.03B, Qwen2.5-7B 7.62B, SmolLM2-135M 134.5M parameters
    assert round(SHAPES["llama3-8b"].num_params / 1e9, 2) == 8.03
    assert round(SHAPES["qwen2.5-7b"].num_params / 1e9, 2) == 7.62
    assert round(SHAPES["smollm2-135m"].num_params / 1e6, 1) == 134.5
    spec = SHAPES["llama3-8b"].kv_spec("cpu", torch.bfloat16)
    assert spec.bytes_per_token == 128 * 1024  # BENCHMARKS.md: 128 KiB per token
    assert hash(SHAPES["llama3-8b"]) == hash(SHAPES["llama3-8b"].with_overrides())


def test_random_model_deterministic_and_finite_in_bf16():
    a, b = random_model("tiny", device="cpu", seed=3), random_model("tiny", device="cpu", seed=3)
    assert a.tokenizer is None and a.source == "random:tiny"
    for (n1, p1), (_, p2) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p1, p2), n1
    with pytest.raises(ValueError, match="unknown random model shape 'gpt'"):
        random_model("gpt", device="cpu")
    # 32 layers in bf16 (a narrow Llama-3 shape): activations stay finite and O(1)
    deep = SHAPES["llama3-8b"].with_overrides(hidden_size=256, intermediate_size=512, num_heads=8,
                                             num_kv_heads=2, head_dim=32, vocab_size=1000)
    model = LlamaForCausalLM(deep, dtype=torch.bfloat16)
    model.init_random_(0)
    spec = deep.kv_spec("cpu", torch.bfloat16)
    with create_kv_cache("paged", spec, max_num_seqs=1, max_model_len=64, memory_bytes=1 << 22) as cache:
        cache.allocate(0, 48)
        meta = cache.prepare([StepSeq(0, 0, 48)])
        hidden = model.forward_hidden(torch.arange(48) * 7, meta.positions, cache, meta)
        logits = model.compute_logits(hidden)
    assert torch.isfinite(logits).all() and logits.dtype == torch.float32
    assert 0.05 < logits.std().item() < 20


# ---------------------------------------------------------------------- GGUF
TOY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
TOY_TOKENS = TOY_SPECIALS + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"] + [m.replace(" ", "") for m in TOY_MERGES]
TOY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama3_rope_freqs(head_dim, theta, factor, low, high, old_len) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor for Llama-3 scaling (divisors of the base frequencies)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path, hf_model, arch: str, with_tokenizer: bool) -> None:
    """Write ``hf_model`` as llama.cpp would: Q/K rows permuted for "llama", 2-D weights in Q8_0
    (embedding, attention) and Q4_1 (MLP), norms and biases F32.  Replaces ``hf_model``'s weights
    by their quantize->dequantize round trip so it stays the exact reference."""
    from gguf.quants import dequantize, quantize

    Q = gguf.GGMLQuantizationType
    c = hf_model.config
    n_head, n_kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("toy")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if with_tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(TOY_TOKENS)
        w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOY_TOKENS) - 3))
        w.add_token_merges(TOY_MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(TOY_TEMPLATE)
    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(
            head_dim, rope["rope_theta"], rope["factor"], rope["low_freq_factor"],
            rope["high_freq_factor"], rope["original_max_position_embeddings"]))
    state = hf_model.state_dict()
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{idx}.{_GGUF_NAMES[module]}.{kind}"
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            heads = n_head if ".attn_q." in gname else n_kv
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        if data.ndim == 2:
            qtype = Q.Q4_1 if "ffn" in gname else Q.Q8_0
            qdata = quantize(data, qtype)
            w.add_tensor(gname, qdata, raw_dtype=qtype)
            data_rt = dequantize(qdata, qtype).reshape(data.shape)
            if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):  # undo for the reference
                heads = n_head if ".attn_q." in gname else n_kv
                data_rt = data_rt.reshape(heads, data.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(data.shape)
            with torch.no_grad():
                t.copy_(torch.from_numpy(np.ascontiguousarray(data_rt)))
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant,arch", [("llama", "llama"), ("llama3_tied", "llama"),
                                          ("qwen2_bias", "qwen2")])
def test_gguf_matches_transformers(tmp_path, monkeypatch, variant, arch, backend):
    monkeypatch.setenv("VMKV_CACHE_DIR", str(tmp_path / "cache"))
    with_tokenizer = variant == "llama"
    hf_model = tiny_hf_model(variant, vocab_size=len(TOY_TOKENS) if with_tokenizer else 128)
    path = tmp_path / f"toy-{variant}.Q8_0.gguf"
    write_gguf(path, hf_model, arch, with_tokenizer)
    loaded = load_model(str(path), device="cpu", dtype=None)
    cfg = loaded.config
    assert loaded.name == f"toy-{variant}.Q8_0"
    assert cfg.tie_word_embeddings == (variant == "llama3_tied") and cfg.qkv_bias == (arch == "qwen2")
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3_freq_factors" if variant == "llama3_tied" else None)
    check_against_hf(loaded.model, hf_model, backend)
    if with_tokenizer:
        tok = loaded.tokenizer
        assert tok.convert_ids_to_tokens(tok.encode("hello world!")) == ["hello", "Ġw", "o", "r", "l", "d", "!"]
        assert tok.eos_token == "<|im_end|>" and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        # the converted tokenizer is cached and reused
        assert list((tmp_path / "cache" / "tokenizers").iterdir())
        again = load_model(str(path), device="cpu").tokenizer
        assert again.encode("hello world!") == tok.encode("hello world!")
    else:
        assert loaded.tokenizer is None


def test_gguf_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'gpt2'; supported: llama, qwen2"):
        load_model(str(tmp_path / "g.gguf"), device="cpu")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        load_model(str(tmp_path / "bad.gguf"), device="cpu")


# ---------------------------------------------------------------------- default model (real SmolLM2)
@pytest.fixture(scope="module")
def default_model():
    return load_model(None, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_model_knows_paris(default_model, backend):
    loaded = default_model
    cfg = loaded.config
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    assert (cfg.hidden_size, cfg.head_dim, cfg.tie_word_embeddings) == (576, 64, True)
    assert cfg.eos_token_ids == (2,) and loaded.tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = loaded.tokenizer.encode("The capital of France is")
    with make_cache(backend, cfg, max_num_seqs=1, max_model_len=32) as cache:
        cache.allocate(0, len(ids))
        logits = run_step(loaded.model, cache, {0: ids}, [StepSeq(0, 0, len(ids))])
    top5 = logits[0].topk(5).indices.tolist()
    assert loaded.tokenizer.encode(" Paris")[0] in top5, loaded.tokenizer.convert_ids_to_tokens(top5)
