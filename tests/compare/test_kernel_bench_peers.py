"""`vmkv compare kernels` peers (FlashInfer) on CPU: the registry skips cleanly, the page table FlashInfer
gets describes our paged K/V, the bench checks and times peer variants like its own, the report has the
ours/FlashInfer column."""

import argparse
import logging
import sys
import types

import pytest
import torch

from vmkv.compare import kernel_bench, kernel_bench_peers as peers
from vmkv.compare.kernel_bench_report import PEER_NOTE, summarize, tables
from vmkv.kernels import reference as ref


def _skips(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]


def test_flashinfer_absent_is_skipped_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flashinfer", None)      # `import flashinfer` raises ImportError
    with caplog.at_level(logging.INFO, logger=peers.__name__):
        assert peers.load_peers(torch.device("cpu")) == []
        assert peers.load_peers(torch.device("cuda")) == []
    lines = _skips(caplog)
    assert len(lines) == 2 and all("peer flashinfer skipped: `import flashinfer` failed" in m for m in lines)


def test_flashinfer_on_a_cpu_device_is_skipped(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    with caplog.at_level(logging.INFO, logger=peers.__name__):
        assert peers.load_peers(torch.device("cpu"), ["flashinfer"]) == []
    assert _skips(caplog) == ["peer flashinfer skipped: FlashInfer runs on CUDA only, not on cpu"]


def test_unknown_peer_is_an_error():
    with pytest.raises(ValueError, match="unknown kernel peer 'vllm'; choose from \\['flashinfer'\\]"):
        peers.load_peers(torch.device("cpu"), ["vllm"])


def test_no_peers_asked_loads_none(caplog):
    with caplog.at_level(logging.INFO, logger=peers.__name__):
        assert peers.load_peers(torch.device("cpu"), []) == []
    assert caplog.records == []


# ------------------------------------------------------------------ FlashInfer's documented page table, in torch
class _FakeWrapper:
    """FlashInfer's wrappers as documented (NHD, CSR page table), computed with the float reference."""

    calls: list = []

    def __init__(self, workspace, layout, **kw):
        assert workspace.dtype == torch.uint8 and workspace.numel() == peers.WORKSPACE_BYTES
        self.layout, self.kw = layout, kw

    def plan(self, *args, **kw):
        self.calls.append((type(self).__name__, self.layout, self.kw, args, kw))
        if type(self).__name__ == "Prefill":
            self.qo_indptr, args = args[0], args[1:]
        self.indptr, self.indices, self.last, self.hq, self.hkv, self.d, self.page = args
        self.scale, self.causal = kw["sm_scale"], kw.get("causal", False)

    def run(self, q, kv):
        k_cache, v_cache = kv
        assert k_cache.shape[1:] == (self.page, self.hkv, self.d)       # NHD
        outs = []
        for i in range(len(self.last)):
            pages = self.indices[self.indptr[i]:self.indptr[i + 1]].long()
            n = (len(pages) - 1) * self.page + int(self.last[i])
            k = k_cache[pages].reshape(-1, self.hkv, self.d)[:n]
            v = v_cache[pages].reshape(-1, self.hkv, self.d)[:n]
            qi = q[i:i + 1] if type(self).__name__ == "Decode" else q[self.qo_indptr[i]:self.qo_indptr[i + 1]]
            assert type(self).__name__ == "Decode" or self.causal
            outs.append(ref.attention_one_seq_ref(qi, k, v, n - qi.shape[0], self.scale))
        return torch.cat(outs)


class Decode(_FakeWrapper):
    pass


class Prefill(_FakeWrapper):
    pass


def _fake_peer(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "fake"
    fake.BatchDecodeWithPagedKVCacheWrapper = Decode
    fake.BatchPrefillWithPagedKVCacheWrapper = Prefill
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    # the peer refuses a CPU device; build it as load_peers would on CUDA
    peer = peers.FlashInferPeer.__new__(peers.FlashInferPeer)
    peer.fi, peer.device, peer.backend, peer.version, peer._workspaces = fake, torch.device("cpu"), "fa2", "fake", {}
    _FakeWrapper.calls = []
    return peer


def test_flashinfer_decode_and_prefill_get_our_paged_kv(monkeypatch):
    peer = _fake_peer(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    b, ctx, hq, hkv, d, scale = 3, 48, 4, 2, 16, 0.25
    k, v = torch.randn(b, ctx, hkv, d, generator=gen), torch.randn(b, ctx, hkv, d, generator=gen)
    kc, vc, table = kernel_bench.paged_copy(k, v, 16, gen)                  # shuffled physical blocks
    assert not torch.equal(table.flatten(), torch.arange(table.numel(), dtype=torch.int32))
    q = torch.randn(b, hq, d, generator=gen)
    variants = peer.decode(q, kc, vc, table, ctx, scale)
    assert [n for n, _, _ in variants] == peer.variant_names("decode", 16) == \
        ["flashinfer_paged_bs16", "flashinfer_paged_tc_bs16"]
    for name, fn, extra in variants:
        out = fn()
        for i in range(b):
            torch.testing.assert_close(out[i:i + 1], ref.attention_one_seq_ref(q[i:i + 1], k[i], v[i], ctx - 1, scale))
        assert extra["peer"] == "flashinfer" and extra["plan_s"] >= 0
    (_, layout, kw0, args0, plan0), (_, _, kw1, _, _) = _FakeWrapper.calls
    assert layout == "NHD" and kw0 == {"use_tensor_cores": False, "backend": "auto"}
    assert kw1 == {"use_tensor_cores": True, "backend": "fa2"}
    assert args0[3:] == (hq, hkv, d, 16) and plan0["sm_scale"] == scale and plan0["q_data_type"] == torch.float32
    assert args0[0].dtype == args0[1].dtype == args0[2].dtype == torch.int32
    # prefill: one causal sequence of ctx tokens over its blocks
    qp = torch.randn(ctx, hq, d, generator=gen)
    (name, fn, extra), = peer.prefill(qp, kc, vc, table[:1], ctx, scale)
    assert name == "flashinfer_paged_bs16" and extra["backend"] == "fa2"
    torch.testing.assert_close(fn(), ref.attention_one_seq_ref(qp, k[0], v[0], 0, scale))
    assert _FakeWrapper.calls[-1][4]["causal"] is True
    assert peer.decode(q, *kernel_bench.paged_copy(k, v, 48, gen), ctx, scale) == []   # block size 48: none


def test_a_failing_plan_is_a_failed_variant_not_a_failed_run(monkeypatch):
    peer = _fake_peer(monkeypatch)

    def boom(*a, **k):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(Decode, "plan", boom)
    kc = torch.randn(2, 16, 2, 16)
    variants = peer.decode(torch.randn(1, 4, 16), kc, kc, torch.zeros(1, 1, dtype=torch.int32), 16, 0.25)
    assert len(variants) == 2
    for _, fn, _ in variants:
        with pytest.raises(RuntimeError, match="nvcc not found"):
            fn()


# ------------------------------------------------------------------ the bench measures peers like its own
class _RefPeer(peers.Peer):
    name = "flashinfer"
    version = "ref"

    def variant_names(self, kind, block_size):
        return ["flashinfer_paged_bs16"] if block_size == 16 else []

    def decode(self, q, key_cache, value_cache, block_tables, context, scale):
        def fn():
            outs = []
            for i, row in enumerate(block_tables.long()):
                k = key_cache[row].reshape(context, *key_cache.shape[2:])
                v = value_cache[row].reshape(context, *value_cache.shape[2:])
                outs.append(ref.attention_one_seq_ref(q[i:i + 1], k, v, context - 1, scale))
            return torch.cat(outs)
        return [("flashinfer_paged_bs16", fn, {"peer": "flashinfer"})] if key_cache.shape[1] == 16 else []


@pytest.mark.triton
def test_bench_checks_and_times_peer_variants():
    p = argparse.ArgumentParser()
    kernel_bench.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--block-sizes", "16", "--num-heads", "4", "--num-kv-heads", "2",
                         "--head-dim", "16", "--megacache-layers", "1", "--flex-points", "none"])
    bench = kernel_bench.Bench(args)
    bench.copy_gbps = 1.0
    bench.peers = [_RefPeer()]
    rows: list = []
    bench.decode_point(2, 32, rows, flex=False)
    by = {r["variant"]: r for r in rows}
    peer_row = by["flashinfer_paged_bs16"]
    assert "error" not in peer_row and peer_row["ok"] and peer_row["ms"] > 0
    assert peer_row["rel_err_seq0_vs_fp64"] < 1e-2 and peer_row["bytes"] == by["triton_paged_bs16"]["bytes"]
    # tuning or flex-only passes skip the peers
    bench.only, rows = {"triton_contig_per_layer"}, []
    bench.decode_point(2, 32, rows, flex=False)
    assert [r["variant"] for r in rows] == ["triton_contig_per_layer"]


# ------------------------------------------------------------------ report
def _row(variant, ms, **kw):
    return {"variant": variant, "ms": ms, "p20_ms": ms, "p80_ms": ms, "gbps": 100.0 / ms,
            "pct_copy_bw": 10.0 / ms, "tflops": 1.0 / ms, "ok": True, **kw}


def _result(with_peer: bool) -> dict:
    decode = []
    for c in (1024, 2048):
        decode += [_row("triton_paged_bs16", 1.0, batch=256, context=c),
                   _row("triton_contig_megacache", 0.9, batch=256, context=c)]
        if with_peer:
            decode += [_row("flashinfer_paged_bs16", 1.25 if c == 1024 else 0.5, batch=256, context=c),
                       _row("flashinfer_paged_tc_bs16", 0.8, batch=256, context=c)]
    prefill = [_row("triton_paged_bs16", 2.0, batch=1, context=4096),
               _row("sdpa_flash_contiguous", 1.5, batch=1, context=4096)]
    if with_peer:
        prefill.append(_row("flashinfer_paged_bs16", 1.0, batch=1, context=4096))
    res = {"copy_bandwidth": {"gbps": 4300.0, "buffer_bytes": 4 << 30, "ms": 2.0}, "decode": decode,
           "prefill": prefill, "peers": {"flashinfer": "0.6.0"} if with_peer else {}}
    res["summary"] = summarize(res)
    return res


def test_report_has_an_ours_over_flashinfer_column():
    md = tables(_result(with_peer=True))
    header = next(line for line in md.splitlines() if line.startswith("| batch | context | triton_contig"))
    assert header.endswith("| paged_bs16/contig | ours/FI speed (bs16) | ours/FI speed (tc_bs16) |")
    assert "| 256 | 1024 |" in md and md.count(PEER_NOTE) == 2 and "Peers: flashinfer 0.6.0" in md
    row_1k = next(line for line in md.splitlines() if line.startswith("| 256 | 1024 | 0.900"))
    assert row_1k.endswith("| 1.111 | 1.250 | 0.800 |")       # paged/contig, FI ms / ours ms for both FI variants
    row_pre = next(line for line in md.splitlines() if line.startswith("| 4096 |"))
    assert row_pre.endswith("| 0.500 |")                         # prefill: FI 1.0 ms / ours 2.0 ms
    targets = {t["target"]: t for t in _result(True)["summary"]["targets"]}
    t = targets["decode 256x1024 triton_paged_bs16 vs flashinfer_paged_bs16: speed (FI ms / ours ms)"]
    assert (t["value"], t["met"]) == (1.25, True)
    t = targets["decode 256x2048 triton_paged_bs16 vs flashinfer_paged_bs16: speed (FI ms / ours ms)"]
    assert (t["value"], t["met"]) == (0.5, False)


def test_report_without_peers_has_no_flashinfer_column():
    md = tables(_result(with_peer=False))
    assert "ours/FI" not in md and PEER_NOTE not in md and "Peers:" not in md
    assert not any("flashinfer" in t["target"] for t in _result(False)["summary"]["targets"])
