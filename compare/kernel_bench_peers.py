"""Optional peer kernels of ``vmkv compare kernels``: other libraries' paged attention on the same K/V.

A registry names each peer and the package it needs; :func:`load_peers` imports a peer only when asked and
only when its package imports, and skips it with one log line otherwise (package absent, import failing, or
a device the peer does not run on).  A peer turns the paged K/V of our ``triton_paged_bs{N}`` variant (same
blocks, same shuffled block table) into variants that :class:`vmkv.compare.kernel_bench.Bench` checks
against the float64 reference and SDPA and then times like its own.

FlashInfer (``flashinfer-python``, CUDA only), NHD layout, block sizes :data:`FLASHINFER_BLOCK_SIZES`:

- ``flashinfer_paged_bs{N}``: ``BatchDecodeWithPagedKVCacheWrapper`` on CUDA cores (its default);
- ``flashinfer_paged_tc_bs{N}``: the same wrapper with ``use_tensor_cores=True`` (the prefill kernels;
  SGLang's choice for GQA groups of 4 and more);
- prefill ``flashinfer_paged_bs{N}``: ``BatchPrefillWithPagedKVCacheWrapper``, causal.

``plan()`` runs once per point outside the timed call (FlashInfer's plan/run split: our kernels choose their
launch per call inside the timed call, which costs microseconds at these sizes); its first call per module
JIT-compiles with the device's ``nvcc`` (``plan_s`` in the row records it).  ``python -m
vmkv.compare.kernel_bench_peers`` compiles every peer's modules ahead on tiny inputs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["PEERS", "Peer", "FlashInferPeer", "load_peers", "FLASHINFER_BLOCK_SIZES", "WORKSPACE_BYTES"]

#: peer name -> (package that must import, ``module:class`` of the peer, imported lazily)
PEERS: dict[str, tuple[str, str]] = {
    "flashinfer": ("flashinfer", "vmkv.compare.kernel_bench_peers:FlashInferPeer"),
}
#: paged block sizes (tokens) the FlashInfer variants run at (FlashInfer takes any page size; 16 is vLLM's
#: and ours by default)
FLASHINFER_BLOCK_SIZES = (16,)
#: float workspace of each FlashInfer wrapper (FlashInfer's recommended 128 MiB)
WORKSPACE_BYTES = 128 << 20

Variant = tuple[str, Callable[[], torch.Tensor], dict]


class Peer:
    """A library's attention variants on our paged K/V (one instance per run and device)."""

    name = "peer"

    def variant_names(self, kind: str, block_size: int) -> list[str]:
        """Names of the ``kind`` (``"decode"`` or ``"prefill"``) variants at ``block_size`` (none: [])."""
        return []

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, context: int, scale: float) -> list[Variant]:
        """Decode variants, planned and ready to run.

        Args:
            q: ``[B, num_heads, head_dim]``, bf16/fp16: one query token per sequence.
            key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD).
            block_tables: ``int32 [B, context // block_size]``: physical block of each logical block.
            context: tokens of every sequence (a multiple of the block size).
            scale: softmax scale.
        """
        return []

    def prefill(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, context: int, scale: float) -> list[Variant]:
        """Causal prefill variants of one sequence: ``q`` ``[context, num_heads, head_dim]``, the paged K/V
        and ``block_tables`` ``int32 [1, context // block_size]`` as in :meth:`decode`."""
        return []


def _guarded(name: str, extra: dict, build: Callable[[], Callable[[], torch.Tensor]]) -> Variant:
    """``(name, fn, extra)`` with ``fn = build()`` (timed in ``extra["plan_s"]``); a failing build gives a
    ``fn`` that raises its exception, so the variant is recorded as failed and the point goes on."""
    t0 = time.perf_counter()
    try:
        fn = build()
    except Exception as exc:  # noqa: BLE001 - recorded on the variant's row by Bench.measure
        logger.warning("%s: plan failed: %s", name, exc)
        err = exc

        def fn():
            raise err
    extra = {**extra, "plan_s": time.perf_counter() - t0}
    return name, fn, extra


class FlashInferPeer(Peer):
    """FlashInfer's paged decode (CUDA cores and tensor cores) and paged causal prefill (module docstring).

    Args:
        device: a CUDA device.
        backend: FlashInfer's ``backend`` of the tensor-core decode and the prefill wrapper (``"auto"``:
            FlashInfer's choice, FA3 on Hopper; ``"fa2"``, ``"fa3"``).
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, backend: str = "auto") -> None:
        import flashinfer  # noqa: PLC0415 - optional dependency

        if device.type != "cuda":
            raise RuntimeError(f"FlashInfer runs on CUDA only, not on {device}")
        self.fi, self.device, self.backend = flashinfer, device, backend
        self.version = getattr(flashinfer, "__version__", "?")
        self._workspaces: dict[str, torch.Tensor] = {}

    def _workspace(self, key: str) -> torch.Tensor:
        if key not in self._workspaces:
            self._workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspaces[key]

    def variant_names(self, kind: str, block_size: int) -> list[str]:
        if block_size not in FLASHINFER_BLOCK_SIZES:
            return []
        if kind == "decode":
            return [f"flashinfer_paged_bs{block_size}", f"flashinfer_paged_tc_bs{block_size}"]
        return [f"flashinfer_paged_bs{block_size}"]

    def _indices(self, block_tables: torch.Tensor, context: int, block_size: int):
        """FlashInfer's CSR page table of full sequences: ``indptr int32 [B + 1]``, ``indices int32
        [B * blocks]``, ``last_page_len int32 [B]``."""
        b, per_seq = block_tables.shape
        i32 = dict(dtype=torch.int32, device=block_tables.device)
        indptr = torch.arange(b + 1, **i32) * per_seq
        last = torch.full((b,), context - (per_seq - 1) * block_size, **i32)
        return indptr, block_tables.reshape(-1).contiguous(), last

    def decode(self, q, key_cache, value_cache, block_tables, context, scale) -> list[Variant]:
        bs, hkv, d = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
        if bs not in FLASHINFER_BLOCK_SIZES:
            return []
        indptr, indices, last = self._indices(block_tables, context, bs)
        out = []
        for tc in (False, True):
            name = f"flashinfer_paged{'_tc' if tc else ''}_bs{bs}"

            def build(tc=tc):
                w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace(f"decode_tc{tc}"), "NHD", use_tensor_cores=tc,
                    backend=self.backend if tc else "auto")
                w.plan(indptr, indices, last, q.shape[1], hkv, d, bs, pos_encoding_mode="NONE",
                       q_data_type=q.dtype, kv_data_type=key_cache.dtype, sm_scale=scale)
                return lambda: w.run(q, (key_cache, value_cache))

            out.append(_guarded(name, {"peer": "flashinfer", "peer_version": self.version, "use_tensor_cores": tc,
                                       "backend": self.backend if tc else "auto"}, build))
        return out

    def prefill(self, q, key_cache, value_cache, block_tables, context, scale) -> list[Variant]:
        bs, hkv, d = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
        if bs not in FLASHINFER_BLOCK_SIZES:
            return []
        indptr, indices, last = self._indices(block_tables, context, bs)
        qo_indptr = torch.tensor([0, context], dtype=torch.int32, device=q.device)

        def build():
            w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace("prefill"), "NHD", backend=self.backend)
            w.plan(qo_indptr, indptr, indices, last, q.shape[1], hkv, d, bs, causal=True, sm_scale=scale,
                   q_data_type=q.dtype, kv_data_type=key_cache.dtype)
            return lambda: w.run(q, (key_cache, value_cache))

        return [_guarded(f"flashinfer_paged_bs{bs}", {"peer": "flashinfer", "peer_version": self.version,
                                                       "backend": self.backend}, build)]


def load_peers(device: torch.device, names: list[str] | None = None, **options) -> list[Peer]:
    """The peers of ``names`` (default: every registered one) that import and run on ``device``; each
    skipped peer gets one log line saying why.  ``options`` go to the peers' constructors by name
    (``flashinfer_backend`` -> ``FlashInferPeer(backend=...)``).

    Raises:
        ValueError: a name that is not registered (the message lists the registered ones).
    """
    peers: list[Peer] = []
    for name in (list(PEERS) if names is None else names):
        if name not in PEERS:
            raise ValueError(f"unknown kernel peer {name!r}; choose from {sorted(PEERS)} or 'none'")
        package, target = PEERS[name]
        try:
            importlib.import_module(package)
        except Exception as exc:  # noqa: BLE001 - absent or broken: skip, say why once
            logger.info("peer %s skipped: `import %s` failed (%s: %s)", name, package, type(exc).__name__, exc)
            continue
        module_name, cls_name = target.split(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
        kw = {k.removeprefix(name + "_"): v for k, v in options.items() if k.startswith(name + "_")}
        try:
            peers.append(cls(device, **kw))
        except Exception as exc:  # noqa: BLE001
            logger.info("peer %s skipped: %s", name, exc)
            continue
        logger.info("peer %s %s loaded", name, getattr(peers[-1], "version", ""))
    return peers


def main(argv: list[str] | None = None) -> int:
    """Compile every available peer's modules ahead (tiny problems of the given head shape)."""
    p = argparse.ArgumentParser(prog="python -m vmkv.compare.kernel_bench_peers", description=main.__doc__)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--flashinfer-backend", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kind", default="all", choices=("all", "decode", "prefill"),
                   help="compile only these variants' modules (two processes compile in parallel)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    dev, dtype = torch.device(a.device), {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    for peer in load_peers(dev, flashinfer_backend=a.flashinfer_backend):
        for bs in FLASHINFER_BLOCK_SIZES:
            k = torch.randn(4, bs, a.num_kv_heads, a.head_dim, device=dev, dtype=dtype)
            table = torch.arange(4, dtype=torch.int32, device=dev).view(1, 4)
            for kind, q in (("decode", torch.randn(1, a.num_heads, a.head_dim, device=dev, dtype=dtype)),
                            ("prefill", torch.randn(4 * bs, a.num_heads, a.head_dim, device=dev, dtype=dtype))):
                if a.kind not in ("all", kind):
                    continue
                for name, fn, extra in getattr(peer, kind)(q, k, k, table, 4 * bs, a.head_dim ** -0.5):
                    try:
                        fn()
                        status = "ok"
                    except Exception as exc:  # noqa: BLE001 - report and go on with the next module
                        status = f"failed: {type(exc).__name__}: {exc}"
                    print(f"{peer.name} {kind} {name}: plan (incl. compile) {extra['plan_s']:.1f} s, {status}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
