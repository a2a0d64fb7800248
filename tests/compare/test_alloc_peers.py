"""CPU tests of the allocator-peers microbenchmark (``vmkv.compare.alloc_peers``).

The trace is seeded and every allocator receives the same one; the vmem adapter runs it on the host driver
with a tiny shape and its statistics are exact and consistent; missing peers are skipped with one log line.
vAttention and kvcached need a GPU build: here they are replaced by small Python fakes of the calls the
adapters make (their synchronous algorithms, reduced), to exercise the adapters' bookkeeping.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import math
import sys
import types

import pytest
import torch

from vmkv.compare import alloc_peers as ap
from vmkv.compare import alloc_vattention

CFG = ap.TraceConfig(num_seqs=5, prompt_len=(3, 20), final_len=(30, 90), decode_tokens=2, admit_len=64,
                     admit_reps=3, seed=7)
PAGE = 4096
RESERVE = 2 * PAGE


def bench(**kw) -> ap.BenchConfig:
    base = dict(model="tiny", device="cpu", kv_memory_bytes=4 << 20, max_num_seqs=CFG.num_seqs + 1,
                max_model_len=CFG.max_len, vmem_page_size_bytes=PAGE, vmem_reserve_bytes=RESERVE, idle_s=0.0)
    return ap.BenchConfig(**{**base, **kw})


def _pages(n: int, tokens_per_page: int) -> int:
    return -(-n // tokens_per_page)


def _lengths(cfg=CFG):
    """(prompt, final) of every sequence, read back from the trace."""
    steps = ap.make_trace(cfg)
    prompt = {s: n for _, s, n in steps[0]}
    final = {}
    for step in steps[1:]:
        for op, s, n in step:
            if op == ap.GROW:
                final[s] = n
    return prompt, final


def _check_summary(d: dict) -> None:
    if d["num"]:
        assert d["p50_us"] <= d["p99_us"] <= d["max_us"] + 1e-9, d
        assert d["total_ms"] >= d["max_us"] / 1e3 - 1e-9, d


# ---------------------------------------------------------------------------------------- trace
def test_trace_is_seeded_and_well_formed():
    steps = ap.make_trace(CFG)
    assert steps == ap.make_trace(CFG)
    assert ap.trace_digest(steps) == ap.trace_digest(ap.make_trace(CFG))
    assert steps != ap.make_trace(ap.TraceConfig(**{**CFG.__dict__, "seed": 8}))
    assert [op for op, _, _ in steps[0]] == [ap.ADMIT] * CFG.num_seqs
    lens, freed = {s: n for _, s, n in steps[0]}, set()
    for s, n in lens.items():
        assert CFG.prompt_len[0] <= n <= CFG.prompt_len[1]
    for step in steps[1:]:
        for op, s, n in step:
            assert s not in freed, f"op on freed sequence {s}"
            if op == ap.GROW:
                assert 0 < n - lens[s] <= CFG.decode_tokens
                lens[s] = n
            else:
                assert op == ap.FREE and CFG.final_len[0] <= lens[s] <= CFG.final_len[1]
                freed.add(s)
    assert freed == set(range(CFG.num_seqs))


@pytest.mark.parametrize("kw,needle", [
    ({"num_seqs": 0}, "num_seqs"), ({"decode_tokens": True}, "decode_tokens"),
    ({"prompt_len": (0, 5)}, "prompt_len"), ({"final_len": (10, 20), "prompt_len": (5, 10)}, "final_len"),
])
def test_trace_config_names_the_bad_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ap.TraceConfig(**kw)


def test_every_allocator_receives_the_same_trace(monkeypatch):
    calls: dict[str, list] = {}

    class Recording(ap.VMemAdapter):
        def __init__(self, cfg, layout):
            super().__init__(cfg, layout)
            self.log = calls.setdefault(layout, [])

        def admit(self, seq_id, n):
            if seq_id >= 0 and seq_id < 10_000:
                self.log.append((ap.ADMIT, seq_id, n))
            super().admit(seq_id, n)

        def grow(self, seq_id, n):
            self.log.append((ap.GROW, seq_id, n))
            super().grow(seq_id, n)

        def free(self, seq_id):
            if 0 <= seq_id < 10_000:
                self.log.append((ap.FREE, seq_id, 0))
            super().free(seq_id)

    monkeypatch.setitem(ap.ALLOCATORS, "a", ap.AllocatorEntry(lambda c: Recording(c, "megacache")))
    monkeypatch.setitem(ap.ALLOCATORS, "b", ap.AllocatorEntry(lambda c: Recording(c, "per_layer")))
    results = ap.run_all(["a", "b"], bench(), CFG, in_process=True)
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert results[0]["trace_digest"] == results[1]["trace_digest"] == ap.trace_digest(ap.make_trace(CFG))
    flat = [op for step in ap.make_trace(CFG) for op in step]
    assert calls["megacache"] == calls["per_layer"] == flat


# ---------------------------------------------------------------------------------------- vmem
@pytest.mark.parametrize("name,tokens_per_unit,pages_per_unit", [("vmem", 8, 1), ("vmem-per_layer", 32, 4)])
def test_vmem_adapter_runs_the_trace_on_cpu(name, tokens_per_unit, pages_per_unit):
    """tiny: 2 layers, 2 KV heads, head_dim 16, fp32: 512 B/token, so a 4 KiB page holds 8 tokens of all
    layers (megacache) or 32 tokens of one layer's K or V (per_layer, 4 pages a unit)."""
    r = ap.run_allocator(name, bench(), CFG)
    assert r["status"] == "ok" and r["touch_ok"]
    assert r["trace_digest"] == ap.trace_digest(ap.make_trace(CFG))
    g, unit_bytes = r["grow"], pages_per_unit * PAGE
    prompt, final = _lengths()
    expected = sum(_pages(final[s], tokens_per_unit) - _pages(prompt[s], tokens_per_unit) for s in prompt)
    assert g["num_boundary_calls"] == expected == g["num_calls_that_mapped"]
    assert r["samples"]["boundary_bytes"] == [unit_bytes] * expected
    assert g["num"] == sum(math.ceil((final[s] - prompt[s]) / CFG.decode_tokens) for s in prompt)
    for d in (g, g["boundary"], g["per_2MiB"], r["admit_in_trace"], r["free"], r["admit_warm"], r["admit_cold"]):
        _check_summary(d)
    assert g["per_2MiB"]["p50_us"] == pytest.approx(g["boundary"]["p50_us"] * ap.MIB2 / unit_bytes, rel=1e-6)
    # every 64-token admission brings exactly its units into use
    admit_bytes = _pages(CFG.admit_len, tokens_per_unit) * unit_bytes
    assert r["samples"]["admit_warm_bytes"] == r["samples"]["admit_cold_bytes"] == [admit_bytes] * CFG.admit_reps
    mem = r["memory"]
    assert mem["after_burst"]["in_use_bytes"] == 0
    assert mem["peak"]["held_bytes"] >= mem["after_burst"]["held_bytes"] > RESERVE
    # the burst's memory is released down to the reserve once idle (release_idle past the grace period)
    assert mem["after_idle"]["held_bytes"] <= RESERVE
    assert mem["after_drop"]["held_bytes"] <= RESERVE
    assert mem["after_idle"]["device_bytes"] is None        # no CUDA here
    assert r["info"]["num_released_pages"] > 0 and r["info"]["page_size_bytes"] == PAGE


def test_vmem_prealloc_holds_its_whole_pool():
    cap = 1 << 20
    r = ap.run_allocator("vmem-prealloc", bench(kv_memory_bytes=cap), CFG)
    assert r["status"] == "ok" and r["touch_ok"]
    mem = r["memory"]
    assert mem["after_init"]["held_bytes"] == mem["after_idle"]["held_bytes"] == mem["after_drop"]["held_bytes"] == cap
    assert r["grow"]["num_boundary_calls"] == r["grow"]["num_calls_that_mapped"] > 0


def test_vmem_prefetch_maps_ahead_between_steps_and_reports_the_time_it_took():
    """vmem-prefetch makes the engine's between-steps ``prefetch`` (16 positions ahead) before
    ``release_idle``: every boundary's page is mapped before the grow that claims it, so no boundary call
    maps, and the prefetch calls' own time is reported (and shown next to the map total)."""
    from vmkv.compare.alloc_vmem import DEFAULT_CUDA_PREFETCH_TOKENS

    r = ap.run_allocator("vmem-prefetch", bench(), CFG)
    assert r["status"] == "ok" and r["touch_ok"]
    g, (prompt, final) = r["grow"], _lengths()
    expected = sum(_pages(final[s], 8) - _pages(prompt[s], 8) for s in prompt)
    assert g["num_boundary_calls"] == expected > 0 and g["num_calls_that_mapped"] == 0
    pf = r["info"]["prefetch"]
    assert pf["tokens"] == DEFAULT_CUDA_PREFETCH_TOKENS and pf["num_calls"] == len(ap.make_trace(CFG))
    assert pf["total_ms"] > 0 and pf["p50_us"] <= pf["p99_us"]
    assert r["info"]["num_prefetched_pages"] >= expected
    assert r["memory"]["after_idle"]["held_bytes"] <= RESERVE
    assert ap.rows([r])[0][4].endswith(" prefetch")
    plain = ap.run_allocator("vmem", bench(), CFG)
    assert plain["info"]["prefetch"]["num_calls"] == 0 and "prefetch" not in ap.rows([plain])[0][4]
    assert plain["info"]["num_topped_up_pages"] > 0          # release_idle keeps the reserve created


# ---------------------------------------------------------------------------------------- fakes
def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__dict__.update(attrs)
    return m


class FakeVAttention:
    """vAttention's step_sync / alloc_new_batch_idx / free_batch_idx, in Python, on CPU tensors."""

    def __init__(self):
        self.mapped: list[int] = []

    def init_kvcache(self, L, H, D, B, Lmax, device, dtype, page, mega):
        self.tpp = page // (H * D * torch.empty((), dtype=dtype).element_size() * (L if mega else 1))
        self.lens, self.mapped = [0] * B, [0] * B
        shape = (B, Lmax, L, H, D) if mega else (B, Lmax, H, D)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 if mega else 2 * L)]

    def reserve_physical_pages(self, mem):
        self.free_blocks = mem // (2 * 2 * 4096)    # generous; a block's exact size does not matter here
        return self.free_blocks * 4

    def alloc_new_batch_idx(self, n):
        i = self.lens.index(0)
        self.lens[i] = n
        return i

    def free_batch_idx(self, i):
        self.lens[i] = 0

    def step(self, lens, eager):
        assert eager is True
        self.lens = list(lens)
        for r, n in enumerate(self.lens):
            if n == 0 and self.mapped[r]:
                self.free_blocks += self.mapped[r]
                self.mapped[r] = 0
            need = -(-n // self.tpp)
            if need > self.mapped[r]:
                assert self.free_blocks >= need - self.mapped[r], "fake pool exhausted"
                self.free_blocks -= need - self.mapped[r]
                self.mapped[r] = need


class FakeManager:
    """kvcached's KVCacheManager reduced: 16-token blocks out of pages, at most 10 empty pages kept."""

    page_size = 16 * 1024

    def __init__(self, num_blocks, block_size, cell_size, num_layers, world_size):
        self.per_page = self.page_size // (block_size * cell_size)
        self.num_blocks, self.pages, self.reserved, self.next_page = num_blocks, {}, [], 0
        self.page_allocator = types.SimpleNamespace(get_page_state=lambda: {
            "inuse_pages": len(self.pages), "reserved_pages": len(self.reserved)})

    def alloc(self, n):
        out = []
        while len(out) < n:
            page = next((p for p, free in self.pages.items() if free), None)
            if page is None:
                page = self.reserved.pop() if self.reserved else self.next_page
                self.next_page += page == self.next_page
                self.pages[page] = [page * self.per_page + i for i in range(self.per_page)]
            out.append(self.pages[page].pop())
            assert out[-1] < self.num_blocks
        return out

    def free(self, ids):
        for b in ids:
            self.pages[b // self.per_page].append(b)
        for p in [p for p, free in self.pages.items() if len(free) == self.per_page]:
            del self.pages[p]
            if len(self.reserved) < 10:
                self.reserved.append(p)

    def trim(self):
        self.reserved.clear()

    def shutdown(self):
        return True


@pytest.fixture
def fake_peers(monkeypatch):
    vattn = FakeVAttention()
    monkeypatch.setitem(sys.modules, "vattention", _module(
        "vattention", **{k: getattr(vattn, k) for k in
                         ("init_kvcache", "reserve_physical_pages", "alloc_new_batch_idx", "free_batch_idx", "step")}))
    monkeypatch.setattr(alloc_vattention, "VATTN_PAGE_BYTES", 4096)
    alloc = lambda kvcache_shape, block_size, dtype, device, num_layers: [  # noqa: E731
        torch.zeros(kvcache_shape, dtype=dtype) for _ in range(num_layers)]
    mods = {
        "kvcached": _module("kvcached", __version__="fake"),
        "kvcached.utils": _module("kvcached.utils", CONTIGUOUS_LAYOUT=True, PAGE_PREALLOC_ENABLED=True,
                                  MIN_RESERVED_PAGES=5, MAX_RESERVED_PAGES=10),
        "kvcached.vmm_ops": _module("kvcached.vmm_ops", kv_tensors_created=lambda: True),
        "kvcached.kv_cache_manager": _module("kvcached.kv_cache_manager", KVCacheManager=FakeManager),
        "kvcached.integration": _module("kvcached.integration"),
        "kvcached.integration.vllm": _module("kvcached.integration.vllm"),
        "kvcached.integration.vllm.interfaces": _module(
            "kvcached.integration.vllm.interfaces", init_kvcached=lambda **kw: None, alloc_kv_cache=alloc,
            shutdown_kvcached=lambda: True),
    }
    mods["kvcached"].utils = mods["kvcached.utils"]
    mods["kvcached.integration"].vllm = mods["kvcached.integration.vllm"]
    mods["kvcached.integration.vllm"].interfaces = mods["kvcached.integration.vllm.interfaces"]
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    return vattn


@pytest.mark.parametrize("name,tokens_per_block", [("vattention", 32), ("vattention-megacache", 16)])
def test_vattention_adapter_with_a_fake(fake_peers, name, tokens_per_block):
    r = ap.run_allocator(name, bench(), CFG)
    assert r["status"] == "ok" and r["touch_ok"], r
    prompt, final = _lengths()
    expected = sum(_pages(final[s], tokens_per_block) - _pages(prompt[s], tokens_per_block) for s in prompt)
    g = r["grow"]
    assert g["num_boundary_calls"] == expected == g["num_calls_that_mapped"]
    block_bytes = r["info"]["block_bytes"]
    assert block_bytes == 4096 * (2 if name.endswith("megacache") else 4)
    assert set(r["samples"]["boundary_bytes"]) == {block_bytes}
    # eager reclamation: nothing stays mapped after drop(); the last admission's blocks wait for a next step
    assert r["memory"]["after_drop"]["mapped_bytes"] == 0
    assert sum(fake_peers.mapped) == _pages(CFG.admit_len, tokens_per_block)
    mem = r["memory"]
    assert mem["after_burst"]["held_bytes"] == mem["after_idle"]["held_bytes"] == mem["after_init"]["held_bytes"]
    for d in (g, g["boundary"], r["admit_warm"], r["admit_cold"]):
        _check_summary(d)


def test_kvcached_adapter_with_a_fake(fake_peers):
    r = ap.run_allocator("kvcached", bench(), CFG)
    assert r["status"] == "ok" and r["touch_ok"], r
    bundle = FakeManager.page_size * 2 * 2
    assert r["info"]["compound_page_bytes"] == bundle and r["info"]["version"] == "fake"
    g, mem = r["grow"], r["memory"]
    assert g["num_boundary_calls"] > 0 and set(r["samples"]["boundary_bytes"]) == {bundle}
    assert mem["after_burst"]["in_use_bytes"] == 0
    assert 0 < mem["after_burst"]["held_bytes"] <= 10 * bundle      # the reserve of empty pages
    assert mem["after_drop"]["held_bytes"] == 0                     # trim()
    # 64 tokens = 4 blocks of 16; a fake page holds 8 blocks, so each admission takes one page
    assert r["samples"]["admit_cold_bytes"] == [bundle] * CFG.admit_reps


# ---------------------------------------------------------------------------------------- skipping
def test_missing_peers_are_skipped_with_one_log_line(monkeypatch, caplog):
    for mod in ("vattention", "kvcached"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with caplog.at_level(logging.INFO, logger=ap.__name__):
        results = ap.run_all(["vattention", "kvcached", "vmem"], bench(), CFG, in_process=True)
    assert [r["status"] for r in results] == ["skipped", "skipped", "ok"]
    assert "not installed (no module named 'vattention')" in results[0]["reason"]
    lines = [rec.getMessage() for rec in caplog.records if "skipped" in rec.getMessage()]
    assert lines == ["alloc_peers: vattention skipped: not installed (no module named 'vattention')",
                     "alloc_peers: kvcached skipped: not installed (no module named 'kvcached')"]


def test_installed_peer_on_cpu_is_skipped(fake_peers):
    assert ap.missing_reason("vattention", "cpu") == "needs a CUDA device (--device cpu)"
    assert ap.missing_reason("kvcached", "cuda") is None
    assert ap.missing_reason("vmem", "cpu") is None


def test_cli_runs_each_allocator_in_its_own_process(tmp_path):
    """End to end as on the device: workers in subprocesses, JSON and markdown written."""
    out = tmp_path / "out"
    rc = ap.main(["--out", str(out), "--model", "tiny", "--device", "cpu", "--allocators", "vmem,vattention,vmem-prealloc",
                  "--num-seqs", "3", "--prompt-len", "4..8", "--final-len", "20..40", "--admit-len", "32",
                  "--admit-reps", "2", "--kv-memory", "2MiB", "--vmem-page-size", "4KiB", "--vmem-reserve", "8KiB",
                  "--idle-s", "0", "--peer-source", "vattention=test"])
    assert rc == 0
    payload = json.loads((out / "alloc_peers.json").read_text())
    vmem, vattn, prealloc = payload["results"]
    assert vmem["status"] == "ok" and vmem["worker_rc"] == 0 and vmem["touch_ok"]
    assert prealloc["status"] == "ok" and prealloc["touch_ok"] and "preallocate" in prealloc["label"]
    assert vmem["trace_digest"] == payload["trace_digest"]
    assert vattn["status"] == "skipped"
    assert payload["peer_sources"] == {"vattention": "test"}
    assert payload["environment"]["command"].startswith("python3 -m vmkv.compare.alloc_peers --out")
    md = (out / "alloc_peers.md").read_text()
    assert "| vmem | " in md and "- vattention: skipped" in md


def test_vmem_prefetch_prefetches_each_admission_as_the_engine_does_and_reports_it_apart():
    """vmem-prefetch makes the engine's ``prefetch_admission`` before every admission (trace, warm,
    cold), timed apart: the admission itself then maps nothing, even right after ``drop``."""
    from vmkv.compare.alloc_vmem import VMemAdapter

    r = ap.run_allocator("vmem-prefetch", bench(), CFG)
    assert r["status"] == "ok" and r["touch_ok"]
    apf = r["info"]["admit_prefetch"]
    assert (apf["trace"]["num_calls"], apf["warm"]["num_calls"], apf["cold"]["num_calls"]) == \
        (CFG.num_seqs, CFG.admit_reps - 1, CFG.admit_reps)   # warm: as admit_warm, without the first
    row = ap.rows([r])[0]
    assert row[5].endswith(" prefetch") and row[6].endswith(" prefetch")
    plain = ap.run_allocator("vmem", bench(), CFG)
    assert plain["info"]["admit_prefetch"]["cold"]["num_calls"] == 0 and "prefetch" not in ap.rows([plain])[0][6]

    a = VMemAdapter(bench(), "megacache", prefetch_tokens=16)
    try:
        a.admit(1, 40)
        a.free(1)
        a.drop()
        a.before_admit(ap.COLD_FIRST_ID, CFG.admit_len)
        before = a.counters()
        a.admit(ap.COLD_FIRST_ID, CFG.admit_len)
        after = a.counters()
        assert after.mapped_bytes == before.mapped_bytes and after.held_bytes == before.held_bytes
        assert after.in_use_bytes > before.in_use_bytes
        assert a.touch(ap.COLD_FIRST_ID, CFG.admit_len - 1)
    finally:
        a.close()


def test_vmem_32mib_variant_uses_its_own_page_size_over_the_benchs():
    """``vmem-32MiB`` maps 32 MiB pages whatever ``--vmem-page-size`` says (the larger-allocation point
    of the comparison), and its memory reads back what was written."""
    a = ap.ALLOCATORS["vmem-32MiB"].make(bench(kv_memory_bytes=128 << 20))
    try:
        assert a.cache.page_size_bytes == 32 << 20 and a.info()["page_size_bytes"] == 32 << 20
        a.admit(1, CFG.admit_len)
        assert a.counters().mapped_bytes == 32 << 20 and a.touch(1, CFG.admit_len - 1)
        a.free(1)
    finally:
        a.close()


def test_vmem_prefetch_warm_note_covers_the_same_admissions_as_the_warm_figure():
    """The warm admission figures leave out the first admission (it follows the idle phase); the
    "+ N prefetch" shown beside the warm p50 must be over the same admissions, the first kept apart."""
    r = ap.run_allocator("vmem-prefetch", bench(), CFG)
    warm = r["info"]["admit_prefetch"]["warm"]
    assert warm["num_calls"] == r["admit_warm"]["num"] == CFG.admit_reps - 1
    assert warm["first_us"] is not None and warm["first_us"] > 0
    cold = r["info"]["admit_prefetch"]["cold"]
    assert cold["num_calls"] == r["admit_cold"]["num"] == CFG.admit_reps


