"""Static KV reservation at admission (issue 24, item 2; :mod:`vmkv.engine.reservation`): the Orca
baselines (Oracle, Pow2, Max) as a scheduler policy over both backends.

- the reserved length: ``min(prompt + estimate, max_model_len)``, backed at admission, rounded to the unit;
- a hypothesis state machine of the scheduler on every KV contract case (``kvcache_cases.CASES``):
  random arrivals, steps and aborts; a reserved sequence never extends, nothing is ever preempted,
  admission is FCFS, and usage returns to 0;
- the engine on the tiny random Llama, both backends: greedy outputs equal transformers' (the
  ``none`` policy's), no preemption under a memory pressure that preempts without reservation,
  FCFS admission, n > 1, prefix hits, chunked prefill, async scheduling on and off, the
  reserved-but-unused bytes in the stats.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from engine_helpers import hf_greedy, random_prompts
from kvcache_cases import CASES, SPEC, one_torch_thread
from engine_helpers import greedy, make_engine, one_thread, run_all, tiny, BYTES_PER_TOKEN  # noqa: F401
from vmkv.engine.config import SchedulerConfig
from vmkv.engine.reservation import (KV_RESERVATIONS, design_label, output_estimate, parse_design,
                                     reserved_tokens)
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.scheduler import Scheduler, TimedAllocator
from vmkv.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from vmkv.kvcache.base import StepSeq

POLICIES = ("oracle", "pow2", "max")
ENGINE_BACKENDS = ("paged", "vmem")


# ---------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("policy, prompt, max_tokens, want", [
    ("oracle", 10, 20, 30), ("pow2", 10, 20, 42), ("max", 10, 20, 256),
    ("pow2", 10, 32, 42), ("pow2", 10, 33, 74), ("pow2", 3, 1, 4), ("oracle", 200, 100, 256),
    ("pow2", 100, 200, 256), ("oracle", 10, None, 256), ("pow2", 10, None, 256),
])
def test_reserved_tokens(policy, prompt, max_tokens, want):
    assert reserved_tokens(policy, prompt, max_tokens, 256) == want


def test_none_reserves_nothing_and_names():
    assert reserved_tokens("none", 10, 20, 256) is None
    assert KV_RESERVATIONS[0] == "none"
    assert [output_estimate("pow2", n, 4096) for n in (1, 2, 3, 64, 65, 511, 512)] == [1, 2, 4, 64, 128, 512, 512]
    assert design_label("paged", "none") == "paged" and design_label("vmem", "max") == "vmem+max"
    assert parse_design("paged+oracle") == ("paged", "oracle") and parse_design("vmem") == ("vmem", "none")
    with pytest.raises(ValueError, match="oracle"):
        parse_design("paged+guess")
    with pytest.raises(ValueError, match="kv_reservation"):
        SchedulerConfig(kv_reservation="always")


# ---------------------------------------------------------------------- scheduler state machine
_SM_SETTINGS = settings(max_examples=25, stateful_step_count=40, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])


class ReservationMachine(RuleBasedStateMachine):
    """The scheduler over a real cache of one contract case, with a simulated model: requests arrive
    (random prompt and output lengths, some sharing a prefix), steps run (prepare marks the writes,
    sampled tokens are appended, a sequence that reaches ``max_tokens`` finishes), requests abort."""

    case = CASES[0]
    policy = "max"

    def __init__(self) -> None:
        super().__init__()
        c = self.case
        self.kv = c.make()
        self.max_model_len = c.max_model_len
        cfg = SchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=48, max_model_len=c.max_model_len,
                              kv_reservation=self.policy)
        self.alloc = TimedAllocator(self.kv)
        self.sched = Scheduler(cfg, self.alloc, c.max_model_len, enable_prefix_caching=True)
        self.next_id = 0
        self.arrivals: list[SequenceGroup] = []      # in arrival order
        self.admitted: list[str] = []                # request ids in admission order
        self.reserved: dict[int, int] = {}           # seq_id -> seq_len at admission
        self.extends = 0
        real_extend = self.alloc.extend

        def counting_extend(seq_id, num_tokens):     # only admission may extend (to the reservation)
            if seq_id in self.reserved:
                self.extends += 1
            real_extend(seq_id, num_tokens)

        self.alloc.extend = counting_extend

    def teardown(self) -> None:
        try:
            for seq in list(self.sched.running) + list(self.sched.waiting):
                self.sched.finish(seq)
            u = self.kv.usage()
            assert (u.num_seqs, u.used_tokens, u.allocated_bytes) == (0, 0, 0), u
            self.kv.check_integrity()
        finally:
            self.kv.close()

    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 40), shared=st.booleans())
    def arrive(self, prompt_len, max_tokens, shared):
        self.next_id += 1
        base = [5] * 16 if shared else []
        prompt = (base + [1000 + 41 * self.next_id + i for i in range(prompt_len)])[:max(prompt_len, 1)]
        g = SequenceGroup(f"r{self.next_id}", None, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          None, 0.0, torch.device("cpu"))
        g.seqs.append(Sequence(10 * self.next_id, g, 0))
        self.sched.add(g)
        self.arrivals.append(g)

    @rule()
    def step(self):
        before = {s.seq_id for s in self.sched.running}
        out = self.sched.schedule()
        assert not out.preempted and not out.failed
        for g in out.ignored:
            g.parent.status = SequenceStatus.FINISHED
        for s in self.sched.running:
            if s.seq_id not in before:
                want = reserved_tokens(self.policy, s.prompt_len, s.group.params.max_tokens, self.max_model_len)
                assert self.kv.seq_len(s.seq_id) == want
                self.reserved[s.seq_id] = want
                self.admitted.append(s.group.request_id)
        if out.scheduled:
            self.kv.prepare([StepSeq(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled])
        for s in out.scheduled:
            if s.samples:
                s.seq.output_token_ids.append(7)
                if s.seq.ends_by_length_after(0, self.max_model_len):
                    self.sched.finish(s.seq)

    @rule(data=st.data())
    def abort(self, data):
        live = [g for g in self.arrivals if g.parent.status is not SequenceStatus.FINISHED]
        if live:
            self.sched.finish(data.draw(st.sampled_from(live)).parent)

    @invariant()
    def never_grows_never_preempts(self):
        assert self.extends == 0 and self.sched.num_preempted_total == 0
        assert self.sched.num_reservation_overruns == 0
        for s in self.sched.running:
            assert self.kv.seq_len(s.seq_id) == self.reserved[s.seq_id]
        # FCFS: the admitted requests come in arrival order (aborted ones left out)
        order = {g.request_id: i for i, g in enumerate(self.arrivals)}
        assert [order[r] for r in self.admitted] == sorted(order[r] for r in self.admitted)
        self.kv.check_integrity()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reservation_state_machine(case, policy):
    machine = type(f"ReservationMachine_{case.name.replace('-', '_')}_{policy}", (ReservationMachine,),
                   {"case": case, "policy": policy})
    with one_torch_thread():
        run_state_machine_as_test(machine, settings=_SM_SETTINGS)


def test_reserved_bytes_are_the_reservation_rounded_to_the_unit():
    """paged, 16-token blocks: a 10-token prompt with max_tokens 20 reserves 30 (oracle), 42 (pow2)
    or 64 (max) positions: 2, 3 and 4 blocks."""
    for policy, blocks in (("oracle", 2), ("pow2", 3), ("max", 4)):
        c = CASES[1]
        kv = c.make()
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, kv_reservation=policy)
        sched = Scheduler(cfg, TimedAllocator(kv), 64)
        g = SequenceGroup("a", None, list(range(1, 11)), SamplingParams(max_tokens=20), None, 0.0, torch.device("cpu"))
        g.seqs.append(Sequence(1, g, 0))
        sched.add(g)
        sched.schedule()
        u = kv.usage()
        assert u.allocated_bytes == blocks * 16 * SPEC.bytes_per_token, (policy, u)
        assert sched.reserved_unused_tokens() == reserved_tokens(policy, 10, 20, 64) - 10
        kv.close()


# ---------------------------------------------------------------------- the engine
def _pressure(tiny):
    prompts = random_prompts(len(tiny["tokenizer"]), [50, 37, 61, 45, 29, 12], seed=2)
    return prompts, [hf_greedy(tiny["hf"], p, 24) for p in prompts]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_engine_reservation_matches_and_never_preempts(tiny, backend, policy):
    """A 200-token cache for 6 requests, a 16-token budget (chunked prefill): without reservation
    running requests are preempted; with it none is, admission is FCFS, the reserved length is
    min(prompt + estimate, max_model_len), and every greedy output is transformers' token for token."""
    prompts, refs = _pressure(tiny)
    knobs = dict(memory_bytes=200 * BYTES_PER_TOKEN, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4)
    base = make_engine(tiny, backend, **knobs)
    for i, p in enumerate(prompts):
        base.add_request(f"r{i}", None, greedy(24), prompt_token_ids=p)
    base_out = run_all(base)
    assert base.get_stats().num_preempted_total > 0
    base.close()

    engine = make_engine(tiny, backend, kv_reservation=policy, **knobs)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(24), prompt_token_ids=p)
    admitted, lens, unused = [], {}, []

    def watch(e):
        e.kv_cache.check_integrity()
        for s in e.scheduler.running:
            if s.group.request_id not in lens:
                admitted.append(s.group.request_id)
            lens.setdefault(s.group.request_id, set()).add(e.kv_cache.seq_len(s.seq_id))
        unused.append(e.get_stats().reserved_unused_bytes)

    final = run_all(engine, on_step=watch)
    stats = engine.get_stats()
    assert stats.num_preempted_total == 0 and stats.num_reservation_overruns == 0
    assert stats.num_prefill_chunks_total > 0
    assert admitted == sorted(admitted, key=lambda r: int(r[1:]))            # FCFS
    for i, p in enumerate(prompts):
        assert lens[f"r{i}"] == {reserved_tokens(policy, len(p), 24, 128)}, i   # reserved once, never grown
        assert final[f"r{i}"].outputs[0].token_ids == refs[i] == base_out[f"r{i}"].outputs[0].token_ids
    assert max(unused) > 0 and stats.reserved_unused_bytes == 0
    u = engine.kv_cache.usage()
    assert u.num_seqs == 0 and u.used_tokens == 0 and u.allocated_bytes == 0
    engine.close()


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_engine_reservation_without_async_scheduling(tiny, backend):
    prompts, refs = _pressure(tiny)
    engine = make_engine(tiny, backend, kv_reservation="pow2", async_scheduling=False,
                         memory_bytes=200 * BYTES_PER_TOKEN, max_model_len=128, max_num_batched_tokens=16)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(24), prompt_token_ids=p)
    final = run_all(engine)
    assert engine.get_stats().num_preempted_total == 0
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == refs
    engine.close()


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_engine_reservation_n3_children_reserve_their_own(tiny, backend):
    """n > 1: each child is admitted with a reservation of its own (no fork of a reserved range); the
    prompt comes from the prefix cache, greedy children equal the parent."""
    prompt = random_prompts(len(tiny["tokenizer"]), [21], seed=5)[0]
    ref = hf_greedy(tiny["hf"], prompt, 12)
    engine = make_engine(tiny, backend, kv_reservation="oracle")
    engine.add_request("g", None, greedy(12, n=3), prompt_token_ids=prompt)
    lens = set()
    outs = run_all(engine, on_step=lambda e: lens.update(e.kv_cache.seq_len(s.seq_id) for s in e.scheduler.running))
    assert [c.token_ids for c in outs["g"].outputs] == [ref, ref, ref]
    assert lens == {len(prompt) + 12}
    stats = engine.get_stats()
    assert stats.num_preempted_total == 0 and stats.num_cached_tokens_total > 0
    assert engine.kv_cache.usage().num_seqs == 0
    engine.close()


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_engine_reservation_keeps_prefix_hits(tiny, backend):
    prompt = random_prompts(len(tiny["tokenizer"]), [40], seed=6)[0]
    ref = hf_greedy(tiny["hf"], prompt, 6)
    engine = make_engine(tiny, backend, kv_reservation="max")
    engine.add_request("a", None, greedy(6), prompt_token_ids=prompt)
    run_all(engine)
    engine.add_request("b", None, greedy(6), prompt_token_ids=prompt)
    out = run_all(engine)["b"]
    assert out.outputs[0].token_ids == ref and out.num_cached_tokens > 0
    engine.close()


def test_engine_waits_instead_of_preempting_a_max_reservation(tiny):
    """Max reserves max_model_len per request: a 128-token cache of max_model_len 64 runs two at a time,
    the others wait; nothing is preempted and everything completes."""
    prompts = random_prompts(len(tiny["tokenizer"]), [10, 12, 8, 9, 11], seed=8)
    engine = make_engine(tiny, "paged", kv_reservation="max", memory_bytes=128 * BYTES_PER_TOKEN, max_model_len=64)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(10), prompt_token_ids=p)
    most = []
    final = run_all(engine, on_step=lambda e: most.append(len(e.scheduler.running)))
    assert max(most) == 2 and engine.get_stats().num_preempted_total == 0
    assert all(len(final[f"r{i}"].outputs[0].token_ids) == 10 for i in range(len(prompts)))
    assert math.isclose(engine.kv_cache.usage().allocated_bytes, 0)
    engine.close()


# ---------------------------------------------------------------------- vmkv compare engine
def test_compare_designs_labels_and_knobs():
    from vmkv.compare import engine_bench

    assert engine_bench.designs("paged,vmem") == ["paged", "vmem"]
    assert engine_bench.designs("paged,vmem", "none,max") == ["paged", "paged+max", "vmem", "vmem+max"]
    assert engine_bench.designs("paged,vmem+oracle", "none,pow2") == ["paged", "paged+pow2", "vmem+oracle"]
    with pytest.raises(ValueError, match="oracle"):
        engine_bench.designs("paged", "none,static")


@pytest.mark.slow
def test_compare_engine_runs_every_design_in_one_invocation(tmp_path):
    """``--kv-reservations none,max`` on one backend plus ``vmem+oracle``: three designs, the same
    workload, labelled in the tables and JSON; reservations never preempt and report their unused KV."""
    import json

    from vmkv.cli import main

    out = tmp_path / "res"
    rc = main(["compare", "engine", "--backends", "paged,vmem+oracle", "--kv-reservations", "none,max",
               "--model", "tiny", "--device", "cpu", "--num-requests", "4", "--input-len", "8..40",
               "--output-len", "3..6", "--warmup-requests", "1", "--torch-threads", "1", "--max-num-seqs", "4",
               "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    runs = {r["backend"]: r for r in res["runs"]}
    assert list(runs) == ["paged", "paged+max", "vmem+oracle"]
    assert len({r["workload_fingerprint"] for r in runs.values()}) == 1
    assert [(r["kv_backend"], r["kv_reservation"]) for r in runs.values()] == [
        ("paged", "none"), ("paged", "max"), ("vmem", "oracle")]
    for name, r in runs.items():
        assert r["serving"]["completed"] == 4 and r["output_len_mismatches"] == 0
        m = r["memory"]
        assert m["preemptions"] == 0 and m["reservation_overruns"] == 0
    bpt = runs["paged"]["kv_bytes_per_token"]
    # without reservation at most the next position of each running sequence is backed ahead of its write
    assert runs["paged"]["memory"]["peak_reserved_unused_bytes"] <= 2 * 4 * bpt
    assert runs["paged+max"]["memory"]["peak_reserved_unused_bytes"] > 100 * bpt
    assert runs["vmem+oracle"]["memory"]["peak_reserved_unused_bytes"] > 0
    # Max reserves max_model_len (256) per sequence: its peak allocation is at least 256 tokens' worth
    assert runs["paged+max"]["memory"]["peak_allocated_bytes"] >= 256 * runs["paged"]["kv_bytes_per_token"]
    summary = (out / "summary.md").read_text()
    assert "paged+max" in summary and "vmem+oracle" in summary and "reserved unused %" in summary


def test_vmem_admission_hint_is_the_reservation(tiny):
    """vmem maps an upcoming admission's pages while the forward runs (``prefetch_admission``): under
    reservation the hint is the reserved length, so the reservation's pages are mapped off the step's
    critical path too."""
    prompts = random_prompts(len(tiny["tokenizer"]), [10, 12, 8, 9], seed=9)
    engine = make_engine(tiny, "vmem", kv_reservation="max", memory_bytes=128 * BYTES_PER_TOKEN, max_model_len=64)
    seen = []
    real = engine.kv_cache.prefetch_admission

    def record(num_tokens, token_ids=None, extra_keys=None):
        seen.extend(num_tokens)
        real(num_tokens, token_ids, extra_keys)

    engine.kv_cache.prefetch_admission = record
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(10), prompt_token_ids=p)
    run_all(engine)
    assert seen and set(seen) == {64}
    engine.close()
