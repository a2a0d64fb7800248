"""Micro-benchmark of the host side of one engine step: ``KVCache.extend`` + ``KVCache.prepare``.

Builds a decode batch like the offline engine comparison (256 sequences of ~1.6k tokens, 32 layers,
prefix caching on with the prompts' token ids) on CPU with a tiny KV shape (1 KV head of head_dim
1, float32), so the KV tensors are small and the time measured is the bookkeeping and metadata
construction, not memory traffic.  Each timed step extends every sequence by one position and
prepares one decode token per sequence, as the engine does.  Not a test: run it as a script::

    python -m vmkv.compare.prepare_bench --backends paged vmem --steps 50 --json out.json

Reported per backend (milliseconds per step): ``extend_ms`` (256 ``extend(seq, 1)`` calls),
``prepare_ms`` (one ``prepare`` of 256 decode entries), medians and p90 over the steps; plus
``prefill_chunk_ms``: one ``prepare`` of a 2048-token prefill chunk of a fresh sequence.
The numbers are host-side costs: compare them as ratios (before/after a change, paged vs vmem).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time

import torch

from vmkv.kvcache import KVCacheSpec, create_kv_cache
from vmkv.kvcache.base import StepSeq
from vmkv.kvcache.registry import backend_options_class


def _backend_options(backend: str):
    """The backend's default options, on the host driver with 4 KiB pages for vmem (CPU timing)."""
    cls = backend_options_class(backend)
    host = {"driver": "host", "page_size_bytes": 4096}
    return cls(**{k: v for k, v in host.items() if k in cls.field_names()})


def bench_backend(backend: str, *, num_seqs: int, prompt_len: int, num_layers: int, steps: int,
                  seed: int = 0) -> dict:
    """Time ``steps`` decode steps of ``num_seqs`` sequences of about ``prompt_len`` tokens.

    Returns:
        dict of medians / p90 in milliseconds and the configuration.
    """
    spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                       device="cpu")
    max_model_len = prompt_len + prompt_len // 8 + steps + 64
    max_model_len = -(-max_model_len // 256) * 256
    rng = random.Random(seed)
    lens = [prompt_len + rng.randint(-prompt_len // 32, prompt_len // 32) for _ in range(num_seqs)]
    budget_tokens = sum(lens) + num_seqs * (steps + 64) + 2 * max_model_len + 4096
    cache = create_kv_cache(backend, spec, max_num_seqs=num_seqs + 1, max_model_len=max_model_len,
                            memory_bytes=spec.kv_bytes(budget_tokens), options=_backend_options(backend))
    for sid, n in enumerate(lens):
        ids = [rng.randrange(32000) for _ in range(n)]
        cache.allocate(sid, n, token_ids=ids)
    # the prompts' K/V: one prefill prepare per sequence (not timed)
    for sid, n in enumerate(lens):
        cache.prepare([StepSeq(sid, 0, n)])

    extend_ms, prepare_ms = [], []
    computed = list(lens)
    for _ in range(steps):
        t0 = time.perf_counter()
        for sid in range(num_seqs):
            cache.extend(sid, 1)
        t1 = time.perf_counter()
        cache.prepare([StepSeq(sid, computed[sid], 1) for sid in range(num_seqs)])
        t2 = time.perf_counter()
        for sid in range(num_seqs):
            computed[sid] += 1
        extend_ms.append((t1 - t0) * 1e3)
        prepare_ms.append((t2 - t1) * 1e3)

    # a prefill chunk of a fresh sequence
    chunk = min(2048, max_model_len)
    cache.allocate(num_seqs, chunk, token_ids=[rng.randrange(32000) for _ in range(chunk)])
    prefill_ms = []
    for _ in range(5):
        t0 = time.perf_counter()
        cache.prepare([StepSeq(num_seqs, 0, chunk)])
        prefill_ms.append((time.perf_counter() - t0) * 1e3)
    cache.close()

    def p90(xs):
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    return {
        "backend": backend, "num_seqs": num_seqs, "prompt_len": prompt_len,
        "num_layers": num_layers, "steps": steps,
        "extend_ms_median": statistics.median(extend_ms), "extend_ms_p90": p90(extend_ms),
        "prepare_ms_median": statistics.median(prepare_ms), "prepare_ms_p90": p90(prepare_ms),
        "prefill_chunk_tokens": chunk, "prefill_chunk_ms_median": statistics.median(prefill_ms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["paged", "vmem"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1600)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    rows = [bench_backend(b, num_seqs=args.num_seqs, prompt_len=args.prompt_len,
                          num_layers=args.num_layers, steps=args.steps) for b in args.backends]
    for r in rows:
        print(f"{r['backend']:>6}: extend {r['extend_ms_median']:7.3f} ms (p90 {r['extend_ms_p90']:.3f})"
              f"  prepare {r['prepare_ms_median']:7.3f} ms (p90 {r['prepare_ms_p90']:.3f})"
              f"  prefill {r['prefill_chunk_tokens']} tokens {r['prefill_chunk_ms_median']:.3f} ms")
    if args.json:
        env = {"python": sys.version.split()[0], "torch": torch.__version__,
               "platform": platform.platform(), "processor": platform.processor()}
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
