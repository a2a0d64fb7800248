"""Fused small ops (kernels/fused_ops.py) against float64 references, and the model running them.

The kernels run natively on CUDA and under ``TRITON_INTERPRET=1`` on CPU (tests/conftest.py sets it), so
the default shapes are small; ``gpu`` tests repeat them at Llama-3-8B sizes (hidden 4096, intermediate
14336, 32 query heads, 8 KV heads, head_dim 128) and capture them in a CUDA graph.  Every check uses
fresh random inputs, poisons outputs (NaN) where the kernel allocates nothing, and compares with the torch
reference evaluated in float64.  The model test runs the decoder with the fused ops against the eager
code they replaced (written out below with ``rms_norm``, ``apply_rope`` and ``F.silu``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vmkv.kernels import _checks, fused_ops
from vmkv.kernels import fused_reference as ref
from vmkv.kvcache import StepSeq, create_kv_cache
from vmkv.model import LlamaForCausalLM, ModelConfig
from vmkv.model.llama import apply_rope, rms_norm

pytestmark = pytest.mark.triton

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
if not _checks.triton_can_run(DEVICE):  # pragma: no cover - depends on the installation
    pytest.skip("Triton cannot run here (no triton, or CPU without TRITON_INTERPRET=1)",
                allow_module_level=True)
#: kernels compiled for the GPU (not the CPU interpreter, which casts fp32 -> bf16 by truncation)
NATIVE = DEVICE.type == "cuda" and not _checks.interpreter_enabled()

# (atol, rtol) per dtype against a float64 reference (bf16: 8 mantissa bits, fp16: 11)
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3), torch.float32: (2e-5, 2e-5)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, gen, scale: float = 1.0, device=None) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(dtype=dtype, device=device or DEVICE)


def _assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "some output elements were never written (NaN left)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=atol, rtol=rtol)


def _assert_model_dtype_sum(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernel's residual equals the eager add in the model dtype: bit for bit when compiled; the CPU
    interpreter rounds fp32 -> bf16 toward zero, so there it may be one bf16 ulp below."""
    if NATIVE or actual.dtype != torch.bfloat16:
        assert torch.equal(actual, expected), (actual - expected).abs().max()
    else:
        torch.testing.assert_close(actual, expected, atol=0.0, rtol=2.0 ** -7)


def _rows(num_tokens: int, width: int, dtype, gen, *, strided: bool, scale: float = 1.0, device=None):
    """``[num_tokens, width]`` random rows, contiguous or a column slice of a wider buffer."""
    if not strided:
        return _randn(num_tokens, width, dtype=dtype, gen=gen, scale=scale, device=device)
    return _randn(num_tokens, width + 24, dtype=dtype, gen=gen, scale=scale, device=device)[:, 8:8 + width]


def _norm_weight(hidden: int, dtype, gen, device=None) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype=dtype, device=device or DEVICE)


def _inv_freq(head_dim: int, theta: float = 500000.0, device=None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return (1.0 / theta ** exponents).to(device or DEVICE)


# ------------------------------------------------------------------------------------------ RMSNorm
# hidden sizes: tiny, non-powers of two (96, 1000), and a 4096 row; strided rows come from a wider buffer
NORM_SHAPES = [(1, 64), (7, 96), (5, 1000), (3, 4096)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("num_tokens,hidden", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(num_tokens, hidden, dtype, strided):
    gen = _gen(hidden + num_tokens)
    x = _rows(num_tokens, hidden, dtype, gen, strided=strided, scale=3.0)
    w = _norm_weight(hidden, dtype, gen)
    x_before = x.clone()
    out = fused_ops.rms_norm(x, w, EPS, impl="triton")
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype and out.is_contiguous()
    _assert_close(out, ref.rms_norm_ref(x.double(), w.double(), EPS), dtype)
    assert torch.equal(x, x_before), "rms_norm must not write its input"


@pytest.mark.parametrize("tile", [None, 64], ids=["one-tile", "looped"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("num_tokens,hidden", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(monkeypatch, num_tokens, hidden, dtype, strided, tile):
    """``residual += x`` in the model dtype, then the norm of the new residual; ``looped`` caps the
    tile at 64 columns, so rows wider than that take the two-pass path of very wide hidden sizes."""
    if tile is not None:
        monkeypatch.setattr(fused_ops, "NORM_MAX_BLOCK", tile)
    gen = _gen(7 * hidden + num_tokens)
    x = _rows(num_tokens, hidden, dtype, gen, strided=strided)
    residual = _rows(num_tokens, hidden, dtype, gen, strided=strided, scale=4.0)
    w = _norm_weight(hidden, dtype, gen)
    expected_residual = residual + x                       # the eager add, rounded to the model dtype
    x_before = x.clone()
    out = fused_ops.fused_add_rms_norm(x, residual, w, EPS, impl="triton")
    _assert_model_dtype_sum(residual, expected_residual)
    assert torch.equal(x, x_before), "fused_add_rms_norm must not write x"
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    _assert_close(out, ref.rms_norm_ref(residual.double(), w.double(), EPS), dtype)


def test_norms_of_zero_tokens_launch_nothing():
    w = torch.ones(32, device=DEVICE)
    x, residual = torch.empty(0, 32, device=DEVICE), torch.empty(0, 32, device=DEVICE)
    assert fused_ops.rms_norm(x, w, EPS, impl="triton").shape == (0, 32)
    assert fused_ops.fused_add_rms_norm(x, residual, w, EPS, impl="triton").shape == (0, 32)


# ------------------------------------------------------------------------------------------ RoPE
# (num_heads, num_kv_heads, head_dim): GQA 2:1, SmolLM2's 9/3 (non-power-of-two heads), 128, and 80
ROPE_SHAPES = [(4, 2, 64), (9, 3, 64), (8, 2, 128), (4, 4, 80)]


def _qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen, *, views: bool):
    """q, k (and the buffer holding them): views into one fused qkv row ``[q | k | v]`` as the model
    passes them, or separate contiguous tensors."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if views:
        buf = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
        q = buf[:, :q_size].view(num_tokens, num_heads, head_dim)
        k = buf[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        return buf, q, k
    q = _randn(num_tokens, num_heads, head_dim, dtype=dtype, gen=gen)
    k = _randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    return None, q, k


@pytest.mark.parametrize("views", [True, False], ids=["qkv-views", "contiguous"])
@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", ROPE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_reference(num_tokens, num_heads, num_kv_heads, head_dim, dtype, views):
    gen = _gen(num_heads * head_dim + num_tokens)
    buf, q, k = _qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen, views=views)
    # positions up to 128k: angles far outside [-pi, pi] (the kernel's cos/sin reduce the range exactly)
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen)
    positions[0] = 0
    positions = positions.to(DEVICE)
    inv_freq = _inv_freq(head_dim)
    q64, k64 = q.double(), k.double()
    ref.rotary_embedding_ref(positions, q64, k64, inv_freq)
    v_before = None if buf is None else buf[:, q.shape[1] * head_dim + k.shape[1] * head_dim:].clone()
    fused_ops.rotary_embedding(positions, q, k, inv_freq, impl="triton")
    _assert_close(q, q64, dtype)
    _assert_close(k, k64, dtype)
    if buf is not None:
        v = buf[:, q.shape[1] * head_dim + k.shape[1] * head_dim:]
        assert torch.equal(v, v_before), "rotary_embedding wrote outside q and k"


def test_rotary_embedding_takes_int32_positions_and_zero_tokens():
    gen = _gen(3)
    _, q, k = _qkv(5, 4, 2, 32, torch.float32, gen, views=True)
    positions = torch.tensor([0, 1, 7, 4095, 70000], dtype=torch.int32, device=DEVICE)
    q64, k64 = q.double(), k.double()
    ref.rotary_embedding_ref(positions, q64, k64, _inv_freq(32))
    fused_ops.rotary_embedding(positions, q, k, _inv_freq(32), impl="triton")
    _assert_close(q, q64, torch.float32)
    _assert_close(k, k64, torch.float32)
    empty_q, empty_k = torch.empty(0, 4, 32, device=DEVICE), torch.empty(0, 2, 32, device=DEVICE)
    fused_ops.rotary_embedding(torch.empty(0, dtype=torch.int64, device=DEVICE), empty_q, empty_k,
                               _inv_freq(32), impl="triton")


def test_rotary_embedding_equals_eager_apply_rope():
    """The reference (the model's CPU path) computes what the eager ``apply_rope`` with per-step cos/sin
    tensors did, in float32."""
    gen = _gen(5)
    num_tokens, head_dim = 9, 64
    _, q, k = _qkv(num_tokens, 6, 2, head_dim, torch.float32, gen, views=True)
    positions = torch.arange(100, 100 + num_tokens, device=DEVICE) * 37
    inv_freq = _inv_freq(head_dim, theta=10000.0)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    q_eager, k_eager = apply_rope(q, emb.cos(), emb.sin()), apply_rope(k, emb.cos(), emb.sin())
    fused_ops.rotary_embedding(positions, q, k, inv_freq, impl="torch")
    torch.testing.assert_close(q, q_eager, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k_eager, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------ SiLU-and-mul
# intermediate sizes: tiny, non-powers of two, and 2500 > SILU_BLOCK (several column tiles per row)
SILU_SHAPES = [(1, 64), (5, 200), (3, 1376), (2, 2500)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("num_tokens,inter", SILU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(num_tokens, inter, dtype, strided):
    gen = _gen(inter + num_tokens)
    gate_up = _rows(num_tokens, 2 * inter, dtype, gen, strided=strided, scale=4.0)  # silu's tails too
    out = fused_ops.silu_and_mul(gate_up, impl="triton")
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    _assert_close(out, ref.silu_and_mul_ref(gate_up.double()), dtype)


# ------------------------------------------------------------------------------------------ dispatch
def test_auto_picks_triton_on_cuda_and_the_reference_elsewhere(monkeypatch):
    """``auto`` launches on CUDA; elsewhere (the CPU model path) it is exactly the torch reference."""
    launched = []

    def spy(name):
        real = getattr(fused_ops, name)

        def launch(*args):
            launched.append(name)
            return real(*args)
        monkeypatch.setattr(fused_ops, name, launch)

    for name in ("_launch_norm", "_launch_rotary", "_launch_silu_and_mul"):
        spy(name)
    gen = _gen(11)
    x = _rows(3, 48, torch.float32, gen, strided=False)
    residual = _rows(3, 48, torch.float32, gen, strided=False)
    w = _norm_weight(48, torch.float32, gen)
    gate_up = _rows(3, 64, torch.float32, gen, strided=False)
    _, q, k = _qkv(3, 4, 2, 16, torch.float32, gen, views=True)
    positions = torch.arange(3, device=DEVICE)
    res_ref, q_ref, k_ref = residual.clone(), q.clone(), k.clone()

    out = fused_ops.rms_norm(x, w, EPS)
    added = fused_ops.fused_add_rms_norm(x, residual, w, EPS)
    fused_ops.rotary_embedding(positions, q, k, _inv_freq(16))
    act = fused_ops.silu_and_mul(gate_up)
    if DEVICE.type == "cuda":
        assert sorted(launched) == sorted(["_launch_norm", "_launch_norm", "_launch_rotary",
                                           "_launch_silu_and_mul"])
        return
    assert launched == []
    assert torch.equal(out, ref.rms_norm_ref(x, w, EPS))
    assert torch.equal(added, ref.fused_add_rms_norm_ref(x, res_ref, w, EPS))
    assert torch.equal(residual, res_ref)
    ref.rotary_embedding_ref(positions, q_ref, k_ref, _inv_freq(16))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(act, ref.silu_and_mul_ref(gate_up))
    # the spies see launches (so ``launched == []`` above says something): impl="triton" launches each
    fused_ops.rms_norm(x, w, EPS, impl="triton")
    fused_ops.rotary_embedding(positions, q, k, _inv_freq(16), impl="triton")
    fused_ops.silu_and_mul(gate_up, impl="triton")
    assert launched == ["_launch_norm", "_launch_rotary", "_launch_silu_and_mul"]


def test_auto_sends_float64_to_the_reference():
    gen = _gen(12)
    x = _rows(2, 40, torch.float64, gen, strided=False)
    w = _norm_weight(40, torch.float64, gen)
    assert fused_ops.rms_norm(x, w, EPS).dtype == torch.float64
    assert fused_ops.silu_and_mul(_rows(2, 40, torch.float64, gen, strided=False)).dtype == torch.float64


BAD_INPUTS = ("bad impl", "x 3-d", "weight size", "weight dtype", "x float64", "x columns strided",
              "residual shape", "odd head_dim", "k dtype", "inv_freq shape", "inv_freq dtype",
              "positions shape", "positions float", "gate_up odd")


def _bad_calls() -> dict:
    """name -> (call, the ValueError's message pattern)."""
    f32, dev = torch.float32, DEVICE
    x, w = torch.randn(3, 32, device=dev), torch.ones(32, device=dev)
    q, k = torch.randn(3, 4, 16, device=dev), torch.randn(3, 2, 16, device=dev)
    pos, inv = torch.arange(3, device=dev), _inv_freq(16)
    cases = [
        ("bad impl", lambda: fused_ops.rms_norm(x, w, EPS, impl="cuda"), "impl must be one of"),
        ("x 3-d", lambda: fused_ops.rms_norm(x[None], w, EPS, impl="triton"), "x must have 2 dimensions"),
        ("weight size", lambda: fused_ops.rms_norm(x, w[:16], EPS, impl="triton"), "weight has 16 elements"),
        ("weight dtype", lambda: fused_ops.rms_norm(x, w.half(), EPS, impl="triton"), "cast the weight"),
        ("x float64", lambda: fused_ops.rms_norm(x.double(), w.double(), EPS, impl="triton"),
         "x has dtype torch.float64"),
        ("x columns strided", lambda: fused_ops.rms_norm(x[:, ::2], w[:16], EPS, impl="triton"),
         "stride\\(-1\\) is 2"),
        ("residual shape", lambda: fused_ops.fused_add_rms_norm(x, x[:2].clone(), w, EPS, impl="triton"),
         "residual is \\(2, 32\\)"),
        ("odd head_dim", lambda: fused_ops.rotary_embedding(pos, q[..., :15], k[..., :15], inv[:7],
                                                            impl="triton"), "head_dim must be even"),
        ("k dtype", lambda: fused_ops.rotary_embedding(pos, q, k.to(f32).half(), inv, impl="triton"),
         "in q's dtype"),
        ("inv_freq shape", lambda: fused_ops.rotary_embedding(pos, q, k, inv[:4], impl="triton"),
         "inv_freq must be a contiguous float32 \\[8\\]"),
        ("inv_freq dtype", lambda: fused_ops.rotary_embedding(pos, q, k, inv.double(), impl="triton"),
         "inv_freq must be a contiguous float32"),
        ("positions shape", lambda: fused_ops.rotary_embedding(pos[:2], q, k, inv, impl="triton"),
         "positions must have shape \\(3,\\)"),
        ("positions float", lambda: fused_ops.rotary_embedding(pos.float(), q, k, inv, impl="triton"),
         "positions must be int32 or int64"),
        ("gate_up odd", lambda: fused_ops.silu_and_mul(x[:, :31], impl="triton"), "odd width 31"),
    ]
    return {name: (call, message) for name, call, message in cases}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_wrappers_reject_bad_inputs_on_the_host(case):
    """ValueError naming the argument and the value, before any launch."""
    calls = _bad_calls()
    assert set(calls) == set(BAD_INPUTS)
    call, message = calls[case]
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------------ the model
def eager_logits(model: LlamaForCausalLM, input_ids, positions, kv_cache, meta) -> torch.Tensor:
    """The decoder as it ran before the fused ops: every small op an eager torch op, cos/sin computed
    once per step in float32 and cast to the model dtype, ``x = x + sublayer(rms_norm(x))``."""
    cfg, eps = model.config, model.config.rms_norm_eps
    x = F.embedding(input_ids, model.embed_tokens.weight)
    freqs = positions.to(torch.float32)[:, None] * model.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    n = x.shape[0]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = rms_norm(x, layer.input_layernorm.weight, eps)
        q, k, v = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias).split(
            [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.reshape(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.reshape(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim).contiguous()
        kv_cache.write_kv(attn.layer_idx, k, v, meta)
        out = kv_cache.attention(attn.layer_idx, q, meta, scale=attn.scale)
        x = x + F.linear(out.reshape(n, cfg.q_size), attn.o_proj.weight, attn.o_proj.bias)
        h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
        gate, up = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
    x = rms_norm(x, model.norm.weight, eps)
    return model.compute_logits(x[meta.last_token_indices])


# chunked prefill (0: 5 + 5 + 3 prompt tokens; 1: 7 at once) mixed with decode steps
STEPS = [[StepSeq(0, 0, 5)],
         [StepSeq(0, 5, 5), StepSeq(1, 0, 7)],
         [StepSeq(1, 7, 1), StepSeq(0, 10, 3)],
         [StepSeq(0, 13, 1), StepSeq(1, 8, 1)],
         [StepSeq(0, 14, 1), StepSeq(1, 9, 1)]]


def _make_cache(backend: str, model: LlamaForCausalLM):
    device = model.device
    spec = model.config.kv_spec(device.type, model.dtype)
    if backend == "vmem":
        options = {"driver": "cuda" if device.type == "cuda" else "host"}
    else:
        options = {}
    return create_kv_cache(backend, spec, max_num_seqs=4, max_model_len=64, memory_bytes=64 << 20, **options)


def run_steps(forward, model: LlamaForCausalLM, backend: str, tokens: dict) -> list[torch.Tensor]:
    """Logits of every step of :data:`STEPS`; ``forward(ids, positions, cache, meta)``."""
    out = []
    with _make_cache(backend, model) as cache:
        cache.allocate(0, 13)
        cache.allocate(1, 7)
        for batch in STEPS:
            for e in batch:
                grow = e.num_computed_tokens + e.num_new_tokens - cache.seq_len(e.seq_id)
                if grow > 0:
                    cache.extend(e.seq_id, grow)
            meta = cache.prepare(batch)
            ids = [t for e in batch for t in
                   tokens[e.seq_id][e.num_computed_tokens:e.num_computed_tokens + e.num_new_tokens]]
            ids = torch.tensor(ids, device=model.device)
            out.append(forward(ids, meta.positions, cache, meta))
    return out


def _tokens(config: ModelConfig) -> dict:
    gen = _gen(21)
    return {s: torch.randint(0, config.vocab_size, (16,), generator=gen).tolist() for s in (0, 1)}


def _models(config: ModelConfig, device, dtype, impls) -> dict:
    """One model per ``ops_impl``, all with the same seeded weights."""
    out = {}
    for impl in impls:
        m = LlamaForCausalLM(config, device=device, dtype=dtype, ops_impl=impl)
        m.init_random_(seed=3)
        out[impl] = m.eval()
    return out


# 6 query heads over 2 KV heads, non-power-of-two hidden (96) and intermediate (200), biases on q/k/v
TINY = ModelConfig(vocab_size=97, hidden_size=96, intermediate_size=200, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, qkv_bias=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8})


@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_model_with_fused_ops_matches_the_eager_path(backend):
    """float32 on CPU (kernels under the interpreter) or CUDA: the decoder with the Triton kernels, and
    with their torch references (the CPU path), gives the eager decoder's logits."""
    models = _models(TINY, DEVICE, torch.float32, ("triton", "torch"))
    tokens = _tokens(TINY)
    eager = run_steps(lambda *a: eager_logits(models["torch"], *a), models["torch"], backend, tokens)
    for impl, tol in (("torch", 1e-5), ("triton", 1e-4)):
        fused = run_steps(models[impl], models[impl], backend, tokens)
        for step, (got, want) in enumerate(zip(fused, eager)):
            assert got.shape == (len(STEPS[step]), TINY.vocab_size)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                       msg=lambda m: f"ops_impl={impl} step {step}: {m}")


def test_model_rejects_an_unknown_ops_impl():
    with pytest.raises(ValueError, match="ops_impl must be one of"):
        LlamaForCausalLM(TINY, ops_impl="cuda")


# ------------------------------------------------------------------------------------------ GPU
# Llama-3-8B widths
L3_HIDDEN, L3_INTER, L3_HEADS, L3_KV_HEADS, L3_HEAD_DIM = 4096, 14336, 32, 8, 128
CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 37, 256, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_llama3_8b_sizes_on_cuda(num_tokens, dtype):
    gen = _gen(num_tokens)
    x = _rows(num_tokens, L3_HIDDEN, dtype, gen, strided=False, device=CUDA)
    residual = _rows(num_tokens, L3_HIDDEN, dtype, gen, strided=False, scale=4.0, device=CUDA)
    w = _norm_weight(L3_HIDDEN, dtype, gen, device=CUDA)
    _assert_close(fused_ops.rms_norm(x, w, EPS), ref.rms_norm_ref(x.double(), w.double(), EPS), dtype)
    expected_residual = residual + x
    out = fused_ops.fused_add_rms_norm(x, residual, w, EPS)
    assert torch.equal(residual, expected_residual), "the residual must be the eager add, bit for bit"
    _assert_close(out, ref.rms_norm_ref(residual.double(), w.double(), EPS), dtype)

    q_size, kv_size = L3_HEADS * L3_HEAD_DIM, L3_KV_HEADS * L3_HEAD_DIM
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen, device=CUDA)
    q = qkv[:, :q_size].view(num_tokens, L3_HEADS, L3_HEAD_DIM)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, L3_KV_HEADS, L3_HEAD_DIM)
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen).to(CUDA)
    inv_freq = _inv_freq(L3_HEAD_DIM, device=CUDA)
    q64, k64 = q.double(), k.double()
    ref.rotary_embedding_ref(positions, q64, k64, inv_freq)
    fused_ops.rotary_embedding(positions, q, k, inv_freq)
    _assert_close(q, q64, dtype)
    _assert_close(k, k64, dtype)

    gate_up = _rows(num_tokens, 2 * L3_INTER, dtype, gen, strided=False, scale=4.0, device=CUDA)
    _assert_close(fused_ops.silu_and_mul(gate_up), ref.silu_and_mul_ref(gate_up.double()), dtype)


@pytest.mark.gpu
def test_fused_ops_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs copied into the static buffers: no host sync, no
    shape that depends on device values."""
    dtype, num_tokens = torch.bfloat16, 8
    gen = _gen(31)
    q_size, kv_size = L3_HEADS * L3_HEAD_DIM, L3_KV_HEADS * L3_HEAD_DIM
    x = torch.zeros(num_tokens, L3_HIDDEN, dtype=dtype, device=CUDA)
    residual = torch.zeros_like(x)
    qkv = torch.zeros(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=CUDA)
    gate_up = torch.zeros(num_tokens, 2 * L3_INTER, dtype=dtype, device=CUDA)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=CUDA)
    w = _norm_weight(L3_HIDDEN, dtype, gen, device=CUDA)
    inv_freq = _inv_freq(L3_HEAD_DIM, device=CUDA)
    q = qkv[:, :q_size].view(num_tokens, L3_HEADS, L3_HEAD_DIM)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, L3_KV_HEADS, L3_HEAD_DIM)

    def step():
        normed = fused_ops.fused_add_rms_norm(x, residual, w, EPS)
        fused_ops.rotary_embedding(positions, q, k, inv_freq)
        return normed, fused_ops.silu_and_mul(gate_up)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                          # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, act = step()

    for seed in (1, 2):
        g = _gen(seed)
        new = {"x": _randn(num_tokens, L3_HIDDEN, dtype=dtype, gen=g, device=CUDA),
               "res": _randn(num_tokens, L3_HIDDEN, dtype=dtype, gen=g, device=CUDA),
               "qkv": _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=g, device=CUDA),
               "gu": _randn(num_tokens, 2 * L3_INTER, dtype=dtype, gen=g, device=CUDA),
               "pos": torch.randint(0, 8192, (num_tokens,), generator=g).to(CUDA)}
        for static, value in ((x, new["x"]), (residual, new["res"]), (qkv, new["qkv"]),
                              (gate_up, new["gu"]), (positions, new["pos"])):
            static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        exp_res = new["res"] + new["x"]
        assert torch.equal(residual, exp_res)
        _assert_close(normed, ref.rms_norm_ref(exp_res.double(), w.double(), EPS), dtype)
        q64 = new["qkv"][:, :q_size].view(num_tokens, L3_HEADS, L3_HEAD_DIM).double()
        k64 = new["qkv"][:, q_size:q_size + kv_size].view(num_tokens, L3_KV_HEADS, L3_HEAD_DIM).double()
        ref.rotary_embedding_ref(new["pos"], q64, k64, inv_freq)
        _assert_close(q, q64, dtype)
        _assert_close(k, k64, dtype)
        _assert_close(act, ref.silu_and_mul_ref(new["gu"].double()), dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_bf16_model_at_llama3_8b_widths_on_cuda(backend):
    """Two layers at Llama-3-8B widths in bf16: the fused decoder is as close to a float32 run as the
    eager bf16 decoder is, and close to it.  (The fused kernels round once per op, in float32 inside;
    the eager path rounds cos/sin, the rotation and silu's product to bf16 step by step.)"""
    config = ModelConfig(vocab_size=1024, hidden_size=L3_HIDDEN, intermediate_size=L3_INTER, num_layers=2,
                         num_heads=L3_HEADS, num_kv_heads=L3_KV_HEADS, head_dim=L3_HEAD_DIM,
                         rms_norm_eps=1e-5, rope_theta=500000.0)
    models = _models(config, CUDA, torch.bfloat16, ("auto", "torch"))
    truth_model = LlamaForCausalLM(config, device=CUDA, dtype=torch.float32, ops_impl="torch")
    truth_model.load_state_dict(models["auto"].state_dict())
    tokens = _tokens(config)
    truth = run_steps(truth_model, truth_model, backend, tokens)
    fused = run_steps(models["auto"], models["auto"], backend, tokens)
    reference = run_steps(models["torch"], models["torch"], backend, tokens)
    eager = run_steps(lambda *a: eager_logits(models["auto"], *a), models["auto"], backend, tokens)
    for step in range(len(STEPS)):
        err_fused, err_eager = _rel(fused[step], truth[step]), _rel(eager[step], truth[step])
        msg = (f"step {step}: fused vs fp32 {err_fused:.2e}, eager vs fp32 {err_eager:.2e}, "
               f"fused vs eager {_rel(fused[step], eager[step]):.2e}, "
               f"fused vs torch reference {_rel(fused[step], reference[step]):.2e}")
        print(msg)
        assert err_fused <= 1.5 * err_eager + 2e-3, msg
        assert _rel(fused[step], eager[step]) < 3e-2, msg
        assert _rel(fused[step], reference[step]) < 1e-2, msg
