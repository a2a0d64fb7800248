"""CPU prefill benchmark: one N-token prompt on each KV backend vs one transformers forward pass.

Builds the engine with random ``smollm2-135m``-shape weights (fp32, CPU, chunked prefill off with a
step budget covering the prompt, prefix caching off so repeats recompute) and times the step that
prefills an N-token prompt and samples one token.  The peer is ``transformers.LlamaForCausalLM``
built from the same config with its own random weights, ``attn_implementation="sdpa"``, one forward
over the same token ids (``use_cache=False``, ``logits_to_keep=1``: logits of the last position
only, like the engine).  Outputs are not compared (different weights); it is a timing peer.
Not a test: run it as a script::

    python -m vmkv.compare.cpu_prefill_bench --n 1024 4095 --out docs/results/cpu/prefill_sdpa

Prints seconds per backend and the ratio to transformers (best of ``--repeats`` after one warm-up),
and writes ``prefill_sdpa.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from vmkv.engine import EngineConfig, LLMEngine, SamplingParams
from vmkv.model.config import SHAPES

SHAPE = "smollm2-135m"


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def time_engine(backend: str, prompts: list[list[int]], n: int) -> list[float]:
    """Seconds of each prompt's prefill step (the first prompt is a warm-up, not returned)."""
    max_len = n + 8
    c = SHAPES[SHAPE]
    token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4   # fp32 K and V
    engine = LLMEngine(EngineConfig.from_args(
        kv_backend=backend, device="cpu", dtype="float32", random_weights=SHAPE, max_num_seqs=1,
        max_model_len=max_len, max_num_batched_tokens=max_len, enable_chunked_prefill=False,
        enable_prefix_caching=False, memory_bytes=token_bytes * (max_len + 512) + (64 << 20)))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=ids)
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return times[1:]


def time_transformers(prompts: list[list[int]]) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    c = SHAPES[SHAPE]
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids))
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config).to(torch.float32).eval()
    times = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            model(input_ids=x, use_cache=False, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    return times[1:]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[4095], help="prompt lengths (tokens)")
    p.add_argument("--backends", nargs="+", default=["paged", "vmem"])
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point (after one warm-up)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default=None, help="folder for prefill_sdpa.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = SHAPES[SHAPE].vocab_size
    results = []
    for n in args.n:
        prompts = [_prompt(n, vocab, seed) for seed in range(args.repeats + 1)]
        hf = time_transformers(prompts)
        row = {"n": n, "transformers_s": min(hf), "transformers_all_s": hf}
        print(f"N={n}: transformers sdpa forward {min(hf):.3f} s", flush=True)
        for backend in args.backends:
            ts = time_engine(backend, prompts, n)
            row[f"{backend}_s"] = min(ts)
            row[f"{backend}_all_s"] = ts
            row[f"{backend}_ratio"] = min(ts) / min(hf)
            print(f"N={n}: {backend} prefill step {min(ts):.3f} s, {min(ts) / min(hf):.2f}x transformers",
                  flush=True)
        results.append(row)
    doc = {"shape": SHAPE, "dtype": "float32", "device": "cpu", "threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
           "commit": _commit(), "command": " ".join(["python -m vmkv.compare.cpu_prefill_bench"]
                                                     + (argv if argv is not None else sys.argv[1:])),
           "results": results}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "prefill_sdpa.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
