"""A tiny random Llama saved with transformers' ``save_pretrained`` (no download), its tokenizer,
and helpers the engine tests share.

The tokenizer is a byte-level BPE trained in-process on a few sentences (vocab ~300), wrapped in a
``PreTrainedTokenizerFast`` with ``<s>``/``</s>`` and a small chat template.  The model is
``transformers.LlamaForCausalLM`` with 2 layers, 4 query heads, 2 KV heads (GQA), head_dim 16,
weights drawn with a large ``initializer_range`` so greedy argmax margins are far above float32
noise (greedy token-for-token comparisons are then meaningful).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vmkv.engine.config import EngineConfig
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A quick brown fox jumps over the lazy dog, again and again.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Virtual memory maps physical pages into a contiguous reservation.",
    "Hello world! How are you today? I am fine, thank you.",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_llama(path: Path, seed: int = 0, max_position_embeddings: int = 1024):
    """Save a tiny random ``LlamaForCausalLM`` + tokenizer into ``path``; returns (hf_model, tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.25,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None     # reference runs never stop early
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return model, tokenizer


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` (no EOS stop): the new token ids."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0, low: int = 3) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids >= ``low`` skip the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------- engine fixtures
# Every engine behaviour runs on both KV backends: ``paged`` and ``vmem`` (host driver, 4 KiB pages, so a
# megacache page holds 8 tokens of the tiny model: ``bytes_per_token = 2 layers x 2 (K,V) x 2 heads x 16 x
# 4 bytes = 512``).  The fixtures are imported by name into the modules that use them (module scope there).
BYTES_PER_TOKEN = 512
BACKENDS = {
    "paged": {"kv_backend": "paged"},
    "vmem": {"kv_backend": "vmem", "driver": "host", "page_size_bytes": 4096},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine run ~30x faster on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vmkv.model import load_model

    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model, tokenizer = make_tiny_llama(path)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    return {"path": str(path), "hf": hf_model, "tokenizer": tokenizer, "loaded": loaded}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return request.param


def make_engine(tiny, backend: str, **knobs) -> LLMEngine:
    opts = dict(BACKENDS[backend])
    kv_backend = opts.pop("kv_backend")
    knobs = {"max_model_len": 256, "memory_bytes": 512 * BYTES_PER_TOKEN, **opts, **knobs}
    cfg = EngineConfig.from_args(tiny["path"], kv_backend, "cpu", "float32", **knobs)
    return LLMEngine(cfg, loaded=tiny["loaded"])


def run_all(engine: LLMEngine, on_step=None) -> dict:
    """Step until done; returns request_id -> final RequestOutput; checks outputs are append-only."""
    final, seen = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                prev_text, prev_ids = seen.get((out.request_id, c.index), ("", []))
                assert c.text.startswith(prev_text), (prev_text, c.text)
                assert c.token_ids[:len(prev_ids)] == prev_ids
                seen[(out.request_id, c.index)] = (c.text, list(c.token_ids))
            if out.finished:
                final[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return final


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
