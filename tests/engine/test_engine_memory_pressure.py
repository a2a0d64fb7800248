"""Memory held by another process (issue 9): vmem's page creation running out of memory is a
transient full cache; the engine waits or preempts and every request completes, never "can never fit".

The GPU twin is ``tests/vmem/test_vmem_pressure_cuda.py::test_cumemcreate_failure_fails_requests_not_the_engine``
(cuMemCreate failing on the CUDA driver); here the host driver's page creation (``ftruncate`` of the
memfd) fails with ENOMEM.
"""

from __future__ import annotations

import pytest

from engine_helpers import hf_greedy, random_prompts
from engine_helpers import greedy, make_engine, one_thread, run_all, tiny  # noqa: F401 (fixtures)
from vmkv.kvcache import KVCacheFullError
from vmkv.vmem.driver import VMMError


def _flaky_page_creation(engine, monkeypatch, *, fail_first: int, every: int):
    """Make the vmem driver's page creation fail with ENOMEM: the first ``fail_first`` calls, then
    every ``every``-th call.  Returns the call counter."""
    drv = engine.kv_cache.driver
    inner = getattr(drv, "inner", drv)
    real = inner._create_page
    calls = {"n": 0, "failed": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] <= fail_first or calls["n"] % every == 0:
            calls["failed"] += 1
            raise VMMError(inner.calls["create_page"], "ENOMEM (Cannot allocate memory)", "injected")
        return real()

    monkeypatch.setattr(inner, "_create_page", flaky)
    return calls


def test_transient_out_of_memory_is_waited_out_and_every_request_completes(tiny, monkeypatch):
    engine = make_engine(tiny, "vmem")
    calls = _flaky_page_creation(engine, monkeypatch, fail_first=5, every=3)
    prompts = random_prompts(len(tiny["tokenizer"]), [20, 40, 60, 33], seed=31)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(8), prompt_token_ids=p)
    final = run_all(engine)
    assert calls["failed"] >= 5
    assert engine.scheduler.num_transient_full > 0
    for i, p in enumerate(prompts):
        out = final[f"r{i}"]
        assert out.error is None, out.error
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(tiny["hf"], p, 8)
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.usage().num_seqs == 0


def test_transient_full_error_is_marked_and_a_capacity_full_is_not(tiny, monkeypatch):
    engine = make_engine(tiny, "vmem")
    kv = engine.kv_cache
    _flaky_page_creation(engine, monkeypatch, fail_first=10**9, every=1)
    with pytest.raises(KVCacheFullError) as err:
        kv.allocate(1, 40)
    assert err.value.transient
    monkeypatch.undo()
    with pytest.raises(KVCacheFullError) as err2:      # the budget holds 512 tokens: fill it
        for seq_id in range(2, 8):
            kv.allocate(seq_id, 200)
    assert not err2.value.transient
    kv.check_integrity()
