"""Issue 12 through the server: after a burst ends, ``vmkv serve --backend vmem`` gives idle KV memory
back while it has no request (the engine thread calls ``LLMEngine.idle()`` between requests), and
``/metrics`` shows created bytes falling to the reserve; paged keeps its static pool."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor


from server_helpers import SERVED, RunningServer, check_kv_integrity


def _burst(srv: RunningServer, n: int = 6) -> None:
    def one(i: int) -> None:
        srv.client.completions.create(model=SERVED, prompt=[list(range(5 + i, 60 + i))], max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def _wait_for(srv: RunningServer, pred, timeout_s: float = 15.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        m = srv.metrics()
        if pred(m):
            return m
        assert time.time() < deadline, f"memory never fell: {m.get('vmkv_kv_created_bytes')}"
        time.sleep(0.1)


def test_vmem_server_gives_idle_memory_back_after_a_burst(tiny_model_dir):
    from server_helpers import VMEM_PAGE_SIZE_BYTES
    # --kv-shrink-grace-s 0 --kv-reserve <one page>: idle pages go back at the first idle moment
    srv = RunningServer(tiny_model_dir, "vmem", engine_knobs={"kv_shrink_grace_s": 0.0,
                                                         "kv_reserve_bytes": VMEM_PAGE_SIZE_BYTES})
    try:
        page_size_bytes = srv.call(check_kv_integrity)
        _burst(srv)
        peak = srv.metrics()["vmkv_kv_created_bytes"]
        m = _wait_for(srv, lambda m: m["vmkv_kv_in_use_bytes"] == 0
                      and m["vmkv_kv_created_bytes"] <= 2 * page_size_bytes)
        assert peak > 2 * page_size_bytes
        assert m["vmkv_kv_idle_bytes"] == m["vmkv_kv_created_bytes"]
        srv.assert_alive()
        _burst(srv, 2)                      # grows again on demand
        srv.call(check_kv_integrity)
    finally:
        srv.stop()


def test_paged_server_keeps_its_static_pool(tiny_model_dir):
    srv = RunningServer(tiny_model_dir, "paged")
    try:
        before = srv.metrics()["vmkv_kv_created_bytes"]
        _burst(srv, 3)
        m = srv.wait_kv_idle()
        time.sleep(1.2)                     # two idle turns of the engine thread
        assert srv.metrics()["vmkv_kv_created_bytes"] == before == m["vmkv_kv_created_bytes"] > 0
    finally:
        srv.stop()
