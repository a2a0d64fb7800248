"""Kernel microbenchmarks: attention on paged blocks vs virtually contiguous vmem slots (issue 5).

One run measures, on the same random K/V copied into every layout (BENCHMARKS.md):

1. the device-to-device copy bandwidth (bytes read + written): the ceiling;
2. decode attention (one query token per sequence) over a batch x context grid: our Triton kernel on a
   paged cache (block sizes 16 and 256, shuffled physical blocks), on a vmem megacache (strided
   per-layer views of ``[slots, max_model_len, layers, 2, H, D]``) and on per-layer slot tensors;
   torch SDPA on contiguous ``[B, H, L, D]`` tensors and on both slot views; and
   ``torch.nn.attention.flex_attention`` with a paged block mask (pages of ``--flex-page`` tokens);
3. prefill attention (causal, one sequence of ``L`` tokens): our kernel on each layout vs SDPA's flash
   backend on contiguous tensors and on slot views;
4. optional peers (:mod:`vmkv.compare.kernel_bench_peers`, ``--peers``): when ``flashinfer`` imports, its
   paged decode and paged causal prefill on the same paged K/V and block table as our block-size-16
   variant (skipped with one log line when it does not).

Every variant is checked before it is timed: sequence 0 (decode) or the last 64 queries (prefill)
against the float64 reference, and every element against SDPA.  Timing: ``triton.testing.do_bench``
(median, L2 flushed before every repetition, quantiles 20/80 as the spread).  Writes
``kernel_bench.json`` (environment, every point) ``kernel_bench.md`` and ``kernel_bench.png`` under
``--out``, rewritten as each point finishes (an interrupted run keeps what it measured).  Run:
``python compare/kernel_bench.py --tune --out DIR`` or ``vmkv compare kernels ...``; on CPU
(``TRITON_INTERPRET=1 ... --device cpu``, a functional smoke run) the grid defaults to a few small points
(:data:`GRID_DEFAULTS`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vmkv.kernels import _checks
from vmkv.kernels import reference as ref
from vmkv.kvcache.spec import TORCH_DTYPES

if _checks.triton_available():  # else run() says what to install (a CPU-only install has no triton)
    from vmkv.kernels.decode_attention import choose_num_splits, decode_attention, default_launch
    from vmkv.kernels.prefill_attention import default_config, prefill_attention

logger = logging.getLogger(__name__)

#: the half-precision dtypes the kernels are benchmarked in: a deliberate subset of the one name list
#: (:data:`vmkv.kvcache.dtypes.DTYPE_NAMES`), mapped to torch through it
DTYPES = {name: TORCH_DTYPES[name] for name in ("bf16", "fp16")}
# (block_n, num_warps, num_stages) for decode; (BLOCK_M, BLOCK_N, num_warps, num_stages) for prefill
DECODE_TUNE = [(32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2),
               (128, 8, 2), (128, 8, 3)]
PREFILL_TUNE = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
                (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _points(text: str) -> list[tuple[int, int]]:
    if text in ("", "none"):
        return []
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",")]  # type: ignore[misc]


#: defaults of the grid and shape flags by device type.  CUDA: the measurement grid at Llama-3-8B's
#: attention shape.  CPU, where the Triton kernels run in Triton's interpreter (a functional smoke run;
#: the CUDA grid would run for days there): a few small points, about 30 s on 2 cores.
GRID_DEFAULTS = {
    "cuda": {"batches": "1,4,16,64,128,256", "contexts": "512,1024,4096,8192,32768",
             "prefill_contexts": "1024,2048,4096,8192,16384,32768",
             "flex_points": "64x4096,1x4096,256x4096,16x32768,64x32768", "megacache_layers": 32,
             "num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
    "cpu": {"batches": "1,4", "contexts": "256,512", "prefill_contexts": "256", "flex_points": "2x256",
            "megacache_layers": 2, "num_heads": 4, "num_kv_heads": 1, "head_dim": 128},
}


def _default(name: str) -> str:
    cuda, cpu = GRID_DEFAULTS["cuda"][name], GRID_DEFAULTS["cpu"][name]
    return f"default: {cuda} on cuda, {cpu} on cpu"


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with each grid or shape flag that was not given (None) at its device's default
    (:data:`GRID_DEFAULTS`); a new namespace, ``args`` is left as it is."""
    kind = "cuda" if torch.device(args.device).type == "cuda" else "cpu"
    given = vars(args)
    return argparse.Namespace(**{**given, **{k: v for k, v in GRID_DEFAULTS[kind].items() if given.get(k) is None}})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--out", default="kernel_bench_out", help="output folder for JSON, markdown and PNG (rewritten as "
      "each point finishes: an interrupted run keeps what it measured)")
    a("--batches", help=f"decode batch sizes ({_default('batches')})")
    a("--contexts", help=f"decode context lengths in tokens ({_default('contexts')})")
    a("--max-tokens", type=int, default=2 * 1024 * 1024, help="skip decode points with batch*context above")
    a("--prefill-contexts", help=f"prefill context lengths in tokens ({_default('prefill_contexts')})")
    a("--block-sizes", default="16,256", help="paged block sizes (tokens)")
    a("--flex-points", help="BATCHxCONTEXT decode points that also run flex_attention ('none' to skip; each "
      f"compiles; {_default('flex_points')})")
    a("--flex-page", type=int, default=128, help="page size (tokens) of the flex_attention paged block mask")
    a("--megacache-layers", type=int, help="layers of the megacache reservation (fewer if "
      f"--megacache-budget-gb is exceeded; recorded per point; {_default('megacache_layers')})")
    a("--megacache-budget-gb", type=float, default=64.0)
    a("--num-heads", type=int, help=f"query heads ({_default('num_heads')})")
    a("--num-kv-heads", type=int, help=f"KV heads ({_default('num_kv_heads')})")
    a("--head-dim", type=int, help=f"head size ({_default('head_dim')})")
    a("--dtype", default="bf16", choices=sorted(DTYPES))
    a("--rep-ms", type=int, default=50, help="do_bench repetition budget per variant (ms)")
    a("--tune", action="store_true", help="sweep launch configs at batch 64 x 4096 (decode; split-K waves at "
      "4 x 32768) and 8K (prefill) first and use the best in the grid; default: the kernels' own defaults")
    a("--seed", type=int, default=0)
    a("--device", default="cuda", help="cuda (measurements) or cpu (functional smoke run; needs "
                                        "TRITON_INTERPRET=1 in the environment)")
    a("--peers", default="flashinfer", help="other libraries' kernels timed on the same paged K/V when they "
      "import (comma-separated; 'none' to skip)")
    a("--flashinfer-backend", default="auto", choices=("auto", "fa2", "fa3"),
      help="FlashInfer backend of its tensor-core decode and its prefill (auto: FlashInfer's choice)")


def grid_error(args: argparse.Namespace) -> str | None:
    """Why the grid cannot run, naming the flags (None when it can): every decode and prefill context
    must be a multiple of every paged block size (``--block-sizes``), and the context of every
    ``--flex-points`` point a multiple of ``--flex-page`` (checked only for those points: without them
    flex_attention does not run)."""
    args = resolve_defaults(args)
    block_sizes = _ints(args.block_sizes)
    for flag, value in (("--block-sizes", block_sizes), ("--flex-page", [args.flex_page])):
        bad = [b for b in value if b <= 0]
        if bad:
            return f"{flag} {bad[0]}: a size in tokens must be > 0"
    for flag in ("--contexts", "--prefill-contexts"):
        for ctx in _ints(getattr(args, flag[2:].replace("-", "_"))):
            bad = [bs for bs in block_sizes if ctx % bs]
            if bad:
                return (f"{flag} {ctx} is not a multiple of --block-sizes {bad[0]} (every context must be a "
                        f"multiple of every paged block size: change {flag} or --block-sizes)")
    for batch, ctx in _points(args.flex_points):
        if ctx % args.flex_page:
            return (f"--flex-points {batch}x{ctx}: context {ctx} is not a multiple of --flex-page "
                    f"{args.flex_page} (change the point or --flex-page, or skip flex_attention with "
                    f"--flex-points none)")
    return None


class Timer:
    """Median and 20/80 % quantiles in ms: do_bench on CUDA, wall clock on CPU (smoke runs only)."""

    def __init__(self, device: torch.device, rep_ms: int) -> None:
        self.device, self.rep_ms = device, rep_ms

    def __call__(self, fn, rep_ms: int | None = None) -> dict:
        if self.device.type == "cuda":
            from triton.testing import do_bench
            q = do_bench(fn, warmup=10, rep=rep_ms or self.rep_ms, quantiles=[0.2, 0.5, 0.8])
            return {"ms": q[1], "p20_ms": q[0], "p80_ms": q[2]}
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return {"ms": times[len(times) // 2], "p20_ms": times[0], "p80_ms": times[-1]}


def copy_bandwidth(device: torch.device, timer: Timer) -> dict:
    """Device-to-device copy of a buffer far larger than L2; bytes = read + write."""
    nbytes = (4 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    gbps = 2 * nbytes / (t["ms"] * 1e-3) / 1e9
    del src, dst
    return {"buffer_bytes": nbytes, **t, "gbps": gbps}


# ------------------------------------------------------------------------------------------ layouts
def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """Copy ``[B, L, H, D]`` K/V into a paged cache with shuffled physical blocks; returns
    ``(key_cache, value_cache, block_tables int32 [B, L // block_size])``."""
    b, length, h, d = k.shape
    per_seq = length // block_size
    num_blocks = b * per_seq
    perm = torch.randperm(num_blocks, generator=gen, device="cpu").to(k.device)
    kc = torch.empty(num_blocks, block_size, h, d, dtype=k.dtype, device=k.device)
    vc = torch.empty_like(kc)
    kc[perm] = k.reshape(num_blocks, block_size, h, d)
    vc[perm] = v.reshape(num_blocks, block_size, h, d)
    return kc, vc, perm.view(b, per_seq).to(torch.int32)


def megacache_copy(k: torch.Tensor, v: torch.Tensor, num_layers: int, layer: int = 0):
    """Copy ``[B, L, H, D]`` into layer ``layer`` of a ``[B, L, layers, 2, H, D]`` megacache; returns the
    strided K and V views (and the backing tensor, to keep it alive)."""
    b, length, h, d = k.shape
    mega = torch.empty(b, length, num_layers, 2, h, d, dtype=k.dtype, device=k.device)
    kv, vv = mega[:, :, layer, 0], mega[:, :, layer, 1]
    kv.copy_(k)
    vv.copy_(v)
    return kv, vv, mega


def flex_paged(k: torch.Tensor, v: torch.Tensor, page: int, gen: torch.Generator):
    """K/V as flex_attention's physical pool ``[1, H, num_pages * page, D]`` (shuffled pages) and a
    :class:`BlockMask` whose KV blocks are each sequence's pages (all full), as in
    ``torch.nn.attention.experimental._paged_attention``; the mask_mod keeps eager mode exact."""
    from torch.nn.attention.flex_attention import BlockMask
    b, length, h, d = k.shape
    per_seq = length // page
    num_pages = b * per_seq
    perm = torch.randperm(num_pages, generator=gen, device="cpu").to(k.device)
    kf = torch.empty(1, h, num_pages * page, d, dtype=k.dtype, device=k.device)
    vf = torch.empty_like(kf)
    kf.view(h, num_pages, page, d)[:, perm] = k.reshape(num_pages, page, h, d).permute(2, 0, 1, 3)
    vf.view(h, num_pages, page, d)[:, perm] = v.reshape(num_pages, page, h, d).permute(2, 0, 1, 3)
    owner = torch.empty(num_pages, dtype=torch.int32, device=k.device)
    owner[perm] = (torch.arange(num_pages, device=k.device) // per_seq).to(torch.int32)

    def mask_mod(bi, hi, q_idx, kv_idx):
        return owner[kv_idx // page] == bi

    i32 = dict(dtype=torch.int32, device=k.device)
    mask = BlockMask.from_kv_blocks(
        torch.zeros(b, 1, 1, **i32), torch.zeros(b, 1, 1, per_seq, **i32),
        torch.full((b, 1, 1), per_seq, **i32), perm.view(b, 1, 1, per_seq).to(torch.int32),
        BLOCK_SIZE=(page, page), mask_mod=mask_mod, seq_lengths=(1, num_pages * page),
        compute_q_blocks=False)
    return kf, vf, mask


SDPA_NOTES: dict = {}  # inputs the flash backend refused (then SDPA picks its backend); written to the JSON


def _sdpa_flash(q, k, v, **kw):
    """SDPA restricted to the flash backend; if flash refuses the inputs, SDPA's own choice (noted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    key = f"q{tuple(q.stride())} k{tuple(k.stride())} causal={kw.get('is_causal', False)}"
    if key not in SDPA_NOTES:
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        except RuntimeError as exc:
            SDPA_NOTES[key] = f"flash refused, SDPA default used: {exc}"[:400]
            logger.warning("SDPA flash refused %s: %s", key, exc)
    return F.scaled_dot_product_attention(q, k, v, **kw)


# ------------------------------------------------------------------------------------------ measuring
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args = resolve_defaults(args)
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        self.hq, self.hkv, self.d = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = self.d ** -0.5
        self.timer = Timer(self.device, args.rep_ms)
        self.gen = torch.Generator(device="cpu").manual_seed(args.seed)
        # one launch config for both layouts (the kernel body is shared); None: the kernels' defaults
        self.decode_cfg: tuple | None = None    # (block_n, num_warps, num_stages, waves)
        self.prefill_cfg: tuple | None = None   # (BLOCK_M, BLOCK_N, num_warps, num_stages)
        self.copy_gbps = float("nan")
        self._flex = None
        self.only: set | None = None  # measure only these variants (tuning)
        self.peers: list = []         # kernel_bench_peers.load_peers(...), set by run()

    def randn(self, *shape) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed(int(torch.randint(1 << 30, (1,), generator=self.gen)))
        return torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32).to(self.dtype)

    def wants(self, *variants: str) -> bool:
        return self.only is None or any(v in self.only for v in variants)

    def peer_names(self, kind: str, block_size: int) -> list[str]:
        """Variant names the loaded peers add at ``block_size`` (``kind``: decode or prefill)."""
        return [n for p in self.peers for n in p.variant_names(kind, block_size)]

    def release(self) -> None:
        """Return cached blocks between points (shapes change; avoids fragmentation at 2M tokens)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def flex(self):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention
            self._flex = (torch.compile(flex_attention, dynamic=False) if self.device.type == "cuda"
                          else flex_attention)
        return self._flex

    def measure(self, rows: list, base: dict, variant: str, fn, check, nbytes: int, flops: float = 0.0,
                extra: dict | None = None, rep_ms: int | None = None) -> dict | None:
        if self.only is not None and variant not in self.only:
            return None
        row = {**base, "variant": variant, **(extra or {})}
        try:
            out = fn()
            row.update(check(out))
            if not row["ok"]:
                raise AssertionError(f"wrong result: {row}")
            row.update(self.timer(fn, rep_ms))
            sec = row["ms"] * 1e-3
            row["bytes"] = nbytes
            row["gbps"] = nbytes / sec / 1e9
            row["pct_copy_bw"] = 100.0 * row["gbps"] / self.copy_gbps
            if flops:
                row["tflops"] = flops / sec / 1e12
        except Exception as exc:  # one failing variant must not end the run
            logger.warning("%s %s failed: %s", variant, base, exc)
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        return row

    # ---------------------------------------------------------------------------------- decode
    def decode_point(self, batch: int, ctx: int, rows: list, flex: bool) -> None:
        a, dev = self.args, self.device
        k, v = self.randn(batch, ctx, self.hkv, self.d), self.randn(batch, ctx, self.hkv, self.d)
        q = self.randn(batch, self.hq, self.d)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        slots = torch.arange(batch, dtype=torch.int32, device=dev)
        esize = k.element_size()
        nbytes = 2 * k.numel() * esize + 2 * q.numel() * esize
        ref0 = ref.attention_one_seq_ref(q[:1].double(), k[0].double(), v[0].double(), ctx - 1, self.scale)
        qb = q.unsqueeze(2)  # [B, Hq, 1, D]
        kb, vb = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        sdpa_out = _sdpa_flash(qb, kb, vb, scale=self.scale, enable_gqa=True).squeeze(2)

        def check(out):
            out = out.reshape(batch, self.hq, self.d).float()
            rel0 = ((out[0].double() - ref0[0]).norm() / ref0[0].norm()).item()
            err = (out - sdpa_out.float()).abs().max().item()
            return {"rel_err_seq0_vs_fp64": rel0, "max_abs_diff_vs_sdpa": err, "ok": rel0 < 1e-2 and err < 2e-2}

        base = {"batch": batch, "context": ctx}
        m = lambda *x, **kw: self.measure(rows, base, *x, **kw)  # noqa: E731
        m("sdpa_contiguous", lambda: _sdpa_flash(qb, kb, vb, scale=self.scale, enable_gqa=True), check, nbytes)
        del kb, vb

        def ours(kc, vc, family, **kw):
            if self.decode_cfg is None:  # exactly what the engine's ops path runs
                bn, w, st, waves = default_launch(self.d)
                fn = lambda: decode_attention(q, kc, vc, seq_lens, max_seq_len=ctx, scale=self.scale,  # noqa: E731
                                              **kw)
            else:
                bn, w, st, waves = self.decode_cfg
                splits = choose_num_splits(batch, self.hkv, ctx, dev, bn, waves=waves)
                fn = lambda: decode_attention(q, kc, vc, seq_lens, max_seq_len=ctx, scale=self.scale,  # noqa: E731
                                              num_splits=splits, block_n=bn, num_warps=w, num_stages=st, **kw)
            splits = choose_num_splits(batch, self.hkv, ctx, dev, bn, waves=waves)
            return fn, {"num_splits": splits, "config": [bn, w, st, waves],
                        "config_source": "kernel default" if self.decode_cfg is None else "tuned in this run"}

        for bs in _ints(a.block_sizes):
            if self.wants(f"triton_paged_bs{bs}", *self.peer_names("decode", bs)):
                kc, vc, table = paged_copy(k, v, bs, self.gen)
                fn, ex = ours(kc, vc, "paged", block_tables=table)
                m(f"triton_paged_bs{bs}", fn, check, nbytes, extra=ex)
                for peer in (p for p in self.peers if self.wants(*p.variant_names("decode", bs))):
                    for name, pfn, pex in peer.decode(q, kc, vc, table, ctx, self.scale):
                        m(name, pfn, check, nbytes, extra=pex)
                del kc, vc
        layers = max(1, min(a.megacache_layers, int(a.megacache_budget_gb * 2**30 // (2 * k.numel() * esize))))
        if self.wants("triton_contig_megacache", "sdpa_megacache_view"):
            kc, vc, mega = megacache_copy(k, v, layers)
            fn, ex = ours(kc, vc, "contiguous", slot_indices=slots)
            m("triton_contig_megacache", fn, check, nbytes, extra={**ex, "megacache_layers": layers})
            m("sdpa_megacache_view", lambda: _sdpa_flash(qb, kc.transpose(1, 2), vc.transpose(1, 2),
                                                         scale=self.scale, enable_gqa=True), check, nbytes,
              extra={"megacache_layers": layers})
            del kc, vc, mega
        fn, ex = ours(k, v, "contiguous", slot_indices=slots)
        m("triton_contig_per_layer", fn, check, nbytes, extra=ex)
        m("sdpa_per_layer_view", lambda: _sdpa_flash(qb, k.transpose(1, 2), v.transpose(1, 2), scale=self.scale,
                                                     enable_gqa=True), check, nbytes)
        if flex and ctx % a.flex_page == 0:
            kf, vf, mask = flex_paged(k, v, a.flex_page, self.gen)
            fx = self.flex()
            t0 = time.perf_counter()
            m(f"flex_paged_p{a.flex_page}", lambda: fx(qb, kf, vf, block_mask=mask, scale=self.scale,
                                                        enable_gqa=True), check, nbytes)
            rows[-1]["first_call_incl_compile_s"] = time.perf_counter() - t0
            del kf, vf, mask
        self.release()

    # ---------------------------------------------------------------------------------- prefill
    def prefill_point(self, ctx: int, rows: list, _unused=None) -> None:
        a, dev = self.args, self.device
        k, v = self.randn(1, ctx, self.hkv, self.d), self.randn(1, ctx, self.hkv, self.d)
        q = self.randn(ctx, self.hq, self.d)
        qsl = torch.tensor([0, ctx], dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        slots = torch.zeros(1, dtype=torch.int32, device=dev)
        esize = k.element_size()
        nbytes = 2 * k.numel() * esize + 2 * q.numel() * esize
        flops = 4.0 * self.hq * self.d * ctx * (ctx + 1) / 2
        tail = min(64, ctx)
        ref_tail = ref.attention_one_seq_ref(q[-tail:].double(), k[0].double(), v[0].double(), ctx - tail,
                                             self.scale).float()
        qb = q.unsqueeze(0).transpose(1, 2)  # [1, Hq, L, D] view of the varlen q
        qbc, kb, vb = qb.contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        sdpa_out = _sdpa_flash(qbc, kb, vb, is_causal=True, scale=self.scale, enable_gqa=True)[0].transpose(0, 1)

        def check(out):
            out = out.reshape(ctx, self.hq, self.d) if out.dim() == 3 else out[0].transpose(0, 1)
            rel = ((out[-tail:].float() - ref_tail).norm() / ref_tail.norm()).item()
            err = (out.float() - sdpa_out.float()).abs().max().item()
            return {"rel_err_tail_vs_fp64": rel, "max_abs_diff_vs_sdpa": err, "ok": rel < 1e-2 and err < 3e-2}

        base = {"context": ctx, "batch": 1}
        m = lambda *x, **kw: self.measure(rows, base, *x, flops=flops, **kw)  # noqa: E731
        m("sdpa_flash_contiguous", lambda: _sdpa_flash(qbc, kb, vb, is_causal=True, scale=self.scale,
                                                       enable_gqa=True), check, nbytes)
        del qbc, kb, vb

        def ours(kc, vc, family, **kw):
            cfg = self.prefill_cfg
            return (lambda: prefill_attention(q, kc, vc, qsl, seq_lens, max_query_len=ctx, scale=self.scale,
                                              config=cfg, **kw)), {
                "config": list(cfg or default_config(self.d, ctx, self.dtype)),
                "config_source": "kernel default" if cfg is None else "tuned in this run"}

        for bs in _ints(a.block_sizes):
            if self.wants(f"triton_paged_bs{bs}", *self.peer_names("prefill", bs)):
                kc, vc, table = paged_copy(k, v, bs, self.gen)
                fn, ex = ours(kc, vc, "paged", block_tables=table)
                m(f"triton_paged_bs{bs}", fn, check, nbytes, extra=ex)
                for peer in (p for p in self.peers if self.wants(*p.variant_names("prefill", bs))):
                    for name, pfn, pex in peer.prefill(q, kc, vc, table, ctx, self.scale):
                        m(name, pfn, check, nbytes, extra=pex)
                del kc, vc
        if self.wants("triton_contig_megacache", "sdpa_flash_megacache_view"):
            kc, vc, mega = megacache_copy(k, v, a.megacache_layers)
            fn, ex = ours(kc, vc, "contiguous", slot_indices=slots)
            m("triton_contig_megacache", fn, check, nbytes, extra={**ex, "megacache_layers": a.megacache_layers})
            m("sdpa_flash_megacache_view", lambda: _sdpa_flash(qb, kc.transpose(1, 2), vc.transpose(1, 2),
                                                               is_causal=True, scale=self.scale, enable_gqa=True),
              check, nbytes)
            del kc, vc, mega
        fn, ex = ours(k, v, "contiguous", slot_indices=slots)
        m("triton_contig_per_layer", fn, check, nbytes, extra=ex)
        m("sdpa_flash_per_layer_view", lambda: _sdpa_flash(qb, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                           scale=self.scale, enable_gqa=True), check, nbytes)
        self.release()

    # ---------------------------------------------------------------------------------- tuning
    def tune(self, batch: int, ctx: int, prefill_ctx: int, split_point: tuple[int, int]) -> dict:
        """Pick one decode (block_n, warps, stages) and one prefill tile config for both layouts by the
        sum of paged (block 16) and contiguous (megacache) times; then the split-K waves at a small-batch
        long-context point where splitting matters."""
        pair = ("triton_paged_bs16", "triton_contig_megacache")
        log: dict = {"points": {"decode": [batch, ctx], "split": list(split_point), "prefill": prefill_ctx},
                     "decode": [], "waves": [], "prefill": []}

        def sweep(configs, attr, point, entry):
            best = None
            for cfg in configs:
                setattr(self, attr, cfg)
                rows: list = []
                saved, self.only = self.only, set(pair)
                try:
                    point(rows)
                finally:
                    self.only = saved
                ms = {r["variant"]: r.get("ms") for r in rows}
                total = sum(ms.values()) if len(ms) == 2 and None not in ms.values() else None
                log[entry].append({"config": cfg, "ms": ms})
                if total is not None and (best is None or total < best[1]):
                    best = (cfg, total)
            setattr(self, attr, best[0] if best else None)
            logger.info("tuned %s: %s", entry, best)
            return best

        saved_bs = self.args.block_sizes
        self.args.block_sizes = "16"
        try:
            best = sweep([(bn, w, s, 2.0) for bn, w, s in DECODE_TUNE], "decode_cfg",
                         lambda rows: self.decode_point(batch, ctx, rows, flex=False), "decode")
            if best:
                sweep([(*best[0][:3], waves) for waves in (1.0, 2.0, 4.0)], "decode_cfg",
                      lambda rows: self.decode_point(*split_point, rows, flex=False), "waves")
            sweep(PREFILL_TUNE, "prefill_cfg", lambda rows: self.prefill_point(prefill_ctx, rows), "prefill")
        finally:
            self.args.block_sizes = saved_bs
        log["chosen"] = {"decode": self.decode_cfg, "prefill": self.prefill_cfg}
        return log


def plan_points(args: argparse.Namespace) -> list[tuple]:
    """The points of a run in their order: ``("prefill", context)``, then ``("decode", batch, context)``
    (batch * context at most ``--max-tokens``), then ``("flex", batch, context)`` (every shape compiles,
    tens of seconds each on CUDA)."""
    points: list[tuple] = [("prefill", ctx) for ctx in _ints(args.prefill_contexts)]
    points += [("decode", batch, ctx) for ctx in _ints(args.contexts) for batch in _ints(args.batches)
               if batch * ctx <= args.max_tokens]
    points += [("flex", batch, ctx) for batch, ctx in _points(args.flex_points)]
    return points


def run(args: argparse.Namespace) -> int:
    from vmkv.compare.kernel_bench_report import summarize, write_outputs
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = resolve_defaults(args)
    if not _checks.triton_available():
        print("vmkv compare kernels: needs triton, which a CPU-only install leaves out: pip install "
              "'vmkv[cuda]' on a GPU machine, or pip install triton for the CPU smoke run")
        return 2
    bench = Bench(args)
    if bench.device.type == "cuda" and not torch.cuda.is_available():
        print("vmkv compare kernels: CUDA is not available; use --device cpu for a functional smoke run")
        return 2
    if bench.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # the kernels are compiled when vmkv.kernels is imported, before the flag could set it
        print("vmkv compare kernels: --device cpu runs the Triton kernels in Triton's interpreter; "
              "set it before the command: TRITON_INTERPRET=1 vmkv compare kernels --device cpu ...")
        return 2
    problem = grid_error(args)
    if problem:
        print(f"vmkv compare kernels: {problem}")
        return 2
    out_dir = Path(args.out)
    result: dict = {"args": vars(args), "decode": [], "prefill": []}
    from vmkv.compare.kernel_bench_peers import load_peers
    peer_names = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"]
    try:
        bench.peers = load_peers(bench.device, peer_names, flashinfer_backend=args.flashinfer_backend)
    except ValueError as exc:
        print(f"vmkv compare kernels: {exc}")
        return 2
    result["peers"] = {p.name: getattr(p, "version", None) for p in bench.peers}
    t_start = time.perf_counter()
    result["copy_bandwidth"] = copy_bandwidth(bench.device, bench.timer)
    bench.copy_gbps = result["copy_bandwidth"]["gbps"]
    logger.info("copy bandwidth %.0f GB/s", bench.copy_gbps)
    if args.tune:
        cuda = bench.device.type == "cuda"
        result["tuning"] = bench.tune(64 if cuda else 2, 4096 if cuda else _ints(args.contexts)[0],
                                      8192 if cuda else _ints(args.prefill_contexts)[0],
                                      (4, 32768) if cuda else (1, _ints(args.contexts)[0]))
        write_outputs(out_dir, result, with_plot=False)
    def guarded(fn, *point):
        try:
            fn(*point)
        except Exception as exc:  # a point whose setup fails is recorded, the run goes on
            logger.exception("point %s failed", point)
            result.setdefault("failed_points", []).append({"point": list(point[:-2]), "error": repr(exc)[:500]})
            bench.release()

    points = plan_points(args)
    logger.info("%d points on %s; %s is rewritten as each finishes", len(points), bench.device,
                out_dir / "kernel_bench.json")
    done = 0
    try:
        for i, (kind, *shape) in enumerate(points, 1):
            name = "x".join(map(str, shape))
            logger.info("point %d/%d: %s %s ...", i, len(points), kind, name)
            if kind == "prefill":
                guarded(bench.prefill_point, *shape, result["prefill"], None)
            else:   # flex: only the flex_attention variant (the others ran at the decode points)
                bench.only = {f"flex_paged_p{args.flex_page}"} if kind == "flex" else None
                guarded(bench.decode_point, *shape, result["decode"], kind == "flex")
            logger.info("point %d/%d: %s %s done (%.0f s)", i, len(points), kind, name,
                        time.perf_counter() - t_start)
            write_outputs(out_dir, result, with_plot=False)
            done = i
    except KeyboardInterrupt:   # the variants measured so far are in result's rows already
        result["interrupted"] = f"{done} of {len(points)} points finished"
        result["wall_s"] = time.perf_counter() - t_start
        paths = write_outputs(out_dir, result, with_plot=False)
        print(f"vmkv compare kernels: interrupted ({result['interrupted']}); what was measured is in "
              f"{paths['json']} and {paths['md']}")
        return 130
    bench.only = None
    result["decode_config"] = bench.decode_cfg
    result["prefill_config"] = bench.prefill_cfg
    result["sdpa_notes"] = SDPA_NOTES
    result["summary"] = summarize(result)
    result["wall_s"] = time.perf_counter() - t_start
    paths = write_outputs(out_dir, result, with_plot=True)
    print(paths["md"].read_text())
    rows = [r for r in result["decode"] + result["prefill"] if isinstance(r, dict)]
    if (rows and all("error" in r for r in rows)) or (not rows and result.get("failed_points")):
        print("vmkv compare kernels: every measurement failed (the errors are in the table and the log)")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernel_bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
