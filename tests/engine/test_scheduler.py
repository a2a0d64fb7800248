"""Scheduler unit tests on real KV caches (both backends) with a simulated model: token budget,
decodes before prefills, chunked prefill, admission by capacity and max_num_seqs, recompute
preemption of the newest sequence, prefix-cache hits not recomputed, n > 1 reservations."""

from __future__ import annotations

import pytest
import torch

from vmkv import KVCacheSpec, create_kv_cache
from vmkv.engine.config import SchedulerConfig
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.scheduler import Scheduler, TimedAllocator
from vmkv.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from vmkv.kvcache.base import StepSeq

# 2 layers x 2 (K,V) x 2 heads x 8 x 4 bytes = 256 bytes per token; 4 KiB vmem pages = 16 tokens
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
OPTIONS = {"paged": {"block_size": 16}, "vmem": {"driver": "host", "page_size_bytes": 4096}}


@pytest.fixture(params=list(OPTIONS))
def backend(request):
    return request.param


def make(backend: str, *, capacity_tokens: int = 1024, max_model_len: int = 256, max_num_seqs: int = 8,
         budget: int = 64, chunked: bool = True, prefix: bool = True) -> Scheduler:
    kv = create_kv_cache(backend, SPEC, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         memory_bytes=capacity_tokens * SPEC.bytes_per_token,
                         **{**OPTIONS[backend], "enable_prefix_caching": prefix})
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, enable_chunked_prefill=chunked)
    return Scheduler(cfg, TimedAllocator(kv), max_model_len, enable_prefix_caching=prefix)


_ids = iter(range(10 ** 6))


def request(sched: Scheduler, prompt: list[int], n: int = 1, name: str | None = None) -> SequenceGroup:
    g = SequenceGroup(name or f"r{next(_ids)}", None, prompt, SamplingParams(n=n, max_tokens=1000),
                      None, 0.0, torch.device("cpu"))
    g.seqs.append(Sequence(next(_ids), g, 0))
    sched.add(g)
    return g


def step(sched: Scheduler, token: int = 7):
    """Schedule, 'run' (prepare marks the written positions), append a token where sampled."""
    out = sched.schedule()
    if out.scheduled:
        sched.alloc.kv_cache.prepare([StepSeq(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens)
                                      for s in out.scheduled])
    for s in out.scheduled:
        if s.samples:
            s.seq.output_token_ids.append(token)
    return out


def shares(out):
    return [(s.seq.group.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_chunked_prefill_and_decodes_first(backend):
    sched = make(backend, budget=16)
    a = request(sched, list(range(10)), name="a")
    request(sched, list(range(100, 110)), name="b")
    request(sched, list(range(200, 210)), name="c")
    out = step(sched)
    assert shares(out) == [("a", 0, 10), ("b", 0, 6)]          # b's prompt is split
    assert sched.num_prefill_chunks_total == 1
    assert [s.group.request_id for s in sched.waiting] == ["c"]
    out = step(sched)
    assert shares(out) == [("a", 10, 1), ("b", 6, 4), ("c", 0, 10)]   # decode, rest of b, then c
    assert out.num_batched_tokens == 15
    out = step(sched)
    assert shares(out) == [("a", 11, 1), ("b", 10, 1), ("c", 10, 1)]
    assert sched.alloc.seq_len(a.parent.seq_id) == 12
    assert sched.alloc.time_s > 0


def test_no_chunking_waits_for_budget(backend):
    sched = make(backend, budget=16, chunked=False, max_model_len=16)
    request(sched, list(range(10)), name="a")
    request(sched, list(range(100, 110)), name="b")
    assert shares(step(sched)) == [("a", 0, 10)]
    assert shares(step(sched)) == [("a", 10, 1), ("b", 0, 10)]


def test_prompt_that_does_not_fit_the_budget_is_not_allocated(backend):
    """Issue 9: without chunked prefill a waiting prompt that does not fit the step's remaining
    budget used to be allocated, freed and retried every step, each attempt counted as a prefix
    lookup.  Now it is not allocated until it fits: one lookup per admission."""
    sched = make(backend, budget=32, chunked=False, max_model_len=32, max_num_seqs=16)
    shorts = [request(sched, [10 + i, 11 + i], name=f"s{i}") for i in range(12)]
    long = request(sched, list(range(100, 124)), name="long")
    kv = sched.alloc.kv_cache
    for _ in range(4):                                  # 12 decodes leave 20 < 24 tokens of budget
        out = step(sched)
        assert "long" not in [s[0] for s in shares(out)]
        assert long.parent.status is SequenceStatus.WAITING and kv.usage().num_seqs == 12
    for g in shorts[:6]:
        sched.finish(g.parent)
    assert ("long", 0, 24) in shares(step(sched))
    assert kv.usage().prefix_query_tokens == 12 * 2 + 24


def test_max_num_seqs_limits_admission(backend):
    sched = make(backend, max_num_seqs=2)
    for i in range(3):
        request(sched, [i + 1] * 5, name=f"r{i}")
    assert [s[0] for s in shares(step(sched))] == ["r0", "r1"]
    assert len(sched.waiting) == 1
    sched.finish(sched.running[0])
    assert [s[0] for s in shares(step(sched))] == ["r1", "r2"]


def test_full_cache_preempts_the_newest_by_recompute(backend):
    # 64 tokens of KV: two 31-token prompts fit; their first decodes need a 3rd unit each
    sched = make(backend, capacity_tokens=64, max_model_len=64, budget=128)
    a = request(sched, list(range(1, 32)), name="a")
    b = request(sched, list(range(40, 71)), name="b")
    step(sched)
    assert {s.status for s in (a.parent, b.parent)} == {SequenceStatus.RUNNING}
    step(sched)                                      # decode: position 31 fits both (32 tokens)
    out = step(sched)                                # position 32 needs a new unit: b is preempted
    assert [s.seq.group.request_id for s in out.scheduled] == ["a"]
    assert out.preempted == [b.parent]
    assert b.parent.status is SequenceStatus.PREEMPTED and b.parent.num_computed_tokens == 0
    assert sched.waiting[0] is b.parent and sched.num_preempted_total == 1
    assert not sched.alloc.kv_cache.has_seq(b.parent.seq_id)
    # b waits until a finishes, then recomputes prompt + its 2 generated tokens
    while a.parent.num_tokens < 40:
        step(sched)
    sched.finish(a.parent)
    out = step(sched)
    assert [(s.seq is b.parent, s.num_new_tokens + s.num_computed_tokens) for s in out.scheduled] == [(True, 33)]
    assert b.parent.output_token_ids == [7, 7, 7]
    sched.alloc.kv_cache.check_integrity()


def test_newest_sequence_preempts_itself(backend):
    # 4 units of 16 tokens: a holds 2 full units, b 1 full unit; a's decode takes the last free
    # unit, so b (the newest) cannot grow and is the victim of its own extension
    sched = make(backend, capacity_tokens=64, max_model_len=64)
    a = request(sched, list(range(1, 33)), name="a")
    b = request(sched, list(range(40, 56)), name="b")
    step(sched)
    out = step(sched)
    assert shares(out) == [("a", 32, 1)] and out.preempted == [b.parent]
    assert list(sched.waiting) == [b.parent] and sched.running == [a.parent]


def test_request_that_can_never_fit_is_ignored(backend):
    sched = make(backend, capacity_tokens=32, max_model_len=64)
    big = request(sched, list(range(1, 41)), name="big")
    small = request(sched, [1, 2, 3], name="small")
    out = step(sched)
    assert out.ignored == [big] and shares(out) == [("small", 0, 3)]


def test_prefix_hit_is_not_recomputed(backend):
    sched = make(backend)
    prompt = list(range(1, 41))
    a = request(sched, prompt, name="a")
    step(sched)
    sched.finish(a.parent)
    b = request(sched, prompt, name="b")
    out = step(sched)
    assert shares(out) == [("b", 32, 8)]
    assert b.num_cached_tokens == 32 and sched.num_cached_tokens_total == 32
    c = request(sched, prompt, name="c")
    d = request(sched, prompt, name="d")
    sched_off = make(backend, prefix=False)
    e = request(sched_off, prompt, name="e")
    assert shares(step(sched_off)) == [("e", 0, 40)] and e.num_cached_tokens == 0
    assert {c.parent.status, d.parent.status} == {SequenceStatus.WAITING}


def test_pending_forks_reserve_sequences(backend):
    sched = make(backend, max_num_seqs=3)
    request(sched, [1, 2, 3], n=3, name="n3")
    request(sched, [4, 5, 6], name="other")
    out = step(sched)
    assert shares(out) == [("n3", 0, 3)]          # 'other' waits: 1 running + 2 forks = 3 reserved
    assert sched.num_reserved_seqs() == 3


def test_finish_frees_kv(backend):
    sched = make(backend)
    a = request(sched, list(range(1, 20)))
    b = request(sched, list(range(30, 50)))
    step(sched)
    kv = sched.alloc.kv_cache
    assert kv.usage().num_seqs == 2
    sched.finish(a.parent)
    sched.finish(b.parent)
    assert kv.usage().used_tokens == 0 and not sched.running
    w = request(sched, [1, 2])
    sched.finish(w.parent)                              # a waiting sequence just leaves the queue
    assert not sched.waiting and w.parent.is_finished
