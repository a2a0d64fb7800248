"""Async scheduling's mixed steps planned ahead (schedule_ahead / Scheduler.schedule_after): a failing
allocate, aborts, preemption and finishing sequences inside a step planned ahead of another's decode."""

from __future__ import annotations

import pytest

from test_async_scheduling import BACKENDS, _engine
from vmkv.engine.sampling_params import SamplingParams


def _run_with_failing_allocate(backend: str, asy: bool, max_steps: int = 60):
    """Request "a" decodes; "bad" arrives at step 2 (admitted into a step planned ahead of one of
    "a"'s decodes) and the KV ``allocate`` of its sequence raises a non-fatal RuntimeError."""
    eng = _engine(backend, asy, max_num_batched_tokens=8)
    bad: set[int] = set()
    orig = eng.allocator.allocate

    def failing(seq_id, *args, **kwargs):
        if seq_id in bad:
            raise RuntimeError("simulated allocate failure")
        return orig(seq_id, *args, **kwargs)
    eng.allocator.allocate = failing
    eng.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                    prompt_token_ids=[5, 6, 7])
    final = {}
    for step in range(max_steps):
        if step == 2:
            eng.add_request("bad", None, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                            prompt_token_ids=[8, 9])
            bad.add(eng._groups["bad"].parent.seq_id)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason,
                                         out.error is not None)
        eng.kv_cache.check_integrity()
        if not eng.has_unfinished_requests():
            break
    unfinished = sorted(eng._groups)
    used = eng.kv_cache.usage().used_tokens
    eng.close()
    return final, unfinished, used


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_kv_call_failing_while_a_step_is_planned_ahead_fails_its_request(backend):
    """Defect: ``StepDriver.next`` launches the step planned ahead with ``self.runner.launch(ahead, ...)``
    directly (vmkv/engine/async_scheduling.py, the ``self.pending = (ahead, self.runner.launch(...))``
    line), bypassing ``StepDriver.launch``, the only place that turns ``SchedulerOutput.failed`` into
    ``requests.fail``.  A sequence whose KV allocate (or extend) raised in ``Scheduler.schedule_after`` is
    dropped by the scheduler (FINISHED, out of the queues) but its request is never failed nor
    reported: it stays unfinished forever and ``engine.step()`` loops with nothing to run (a hang).
    Synchronously the request finishes at once with an error and the others complete."""
    sync_final, sync_unfinished, _ = _run_with_failing_allocate(backend, False)
    assert sync_unfinished == [] and sync_final["bad"][1] == "error" and sync_final["bad"][2]
    final, unfinished, used = _run_with_failing_allocate(backend, True)
    assert unfinished == [], f"request(s) {unfinished} never finished (their KV call failed ahead)"
    assert final == sync_final
    assert used == 0
