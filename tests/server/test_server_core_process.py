"""The server's two processes (issue 22): the HTTP front and the engine core, on real processes and sockets.

- the core's death (``kill -9``) is visible at once: open streams get an error event and ``[DONE]``,
  ``/health`` answers 503 naming the cause, new requests 503;
- SIGTERM to ``vmkv serve`` mid-stream stops both processes, and no child process is left;
- 64 concurrent streams with random disconnects leave no KV in use;
- stop strings split over several steps end the text where the in-process engine ends it;
- the served tokens (greedy and seeded sampling, ``n`` > 1) equal the in-process engine's, token for token.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import (
    CHAT,
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    SERVED,
    RunningServer,
    ServerProcess,
    engine_knobs_for,
    final_completions,
    inprocess_engine,
    set_step_delay,
    sse_events,
)


def _children(pid: int) -> list[int]:
    """Pids of the live child processes of ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_core_process_fails_streams_and_health(tiny_model_dir):
    srv = RunningServer(tiny_model_dir, "paged")
    try:
        srv.assert_alive()
        core = srv.async_engine.core_pid
        assert core in _children(os.getpid())
        srv.call(set_step_delay, 0.05)              # the core dies with it: no undo
        body = {"messages": CHAT, "max_tokens": 100, "ignore_eos": True, "stream": True}
        with srv.http.stream("POST", CHAT_URL, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")     # the stream is open
            os.kill(core, signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == "engine_unavailable" and "SIGKILL" in err["message"]
        health = srv.http.get("/health")
        assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]
        r = srv.http.post(CHAT_URL, json={"messages": CHAT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert srv.http.get("/v1/models").status_code == 200     # the HTTP side still answers
        assert srv.http.get("/metrics").status_code == 200
    finally:
        srv.stop()


def test_sigterm_mid_stream_stops_both_processes(tiny_model_dir):
    """``vmkv serve`` gets SIGTERM while a stream runs: the stream ends with [DONE] (finished or an error
    event after the graceful timeout), the server exits 0, and neither the core nor any other child
    outlives it."""
    proc = ServerProcess(tiny_model_dir, "--graceful-timeout", "1", step_delay_s=0.05)
    try:
        kids = _children(proc.proc.pid)
        assert len(kids) >= 1, "the engine core runs in a child process"
        body = {"messages": CHAT, "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=proc.base, timeout=30) as http:
            with http.stream("POST", CHAT_URL, json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                proc.proc.send_signal(signal.SIGTERM)
                events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert proc.proc.wait(timeout=30) == 0
        deadline = time.time() + 10
        while any(_alive(k) for k in kids):
            assert time.time() < deadline, f"children {kids} outlived the server"
            time.sleep(0.05)
        out = proc.proc.stdout.read()
        assert "vmkv serve: stopped (SIGTERM)" in out, out
    finally:
        proc.kill()


def test_64_streams_with_random_disconnects_free_all_kv(tiny_model_dir):
    srv = RunningServer(tiny_model_dir, "vmem", engine_knobs={"max_num_seqs": 16})
    rng = random.Random(5)
    plan = [(rng.random() < 0.5, rng.randint(1, 6)) for _ in range(64)]

    async def one(client: httpx.AsyncClient, leave: bool, after: int) -> int:
        body = {"messages": CHAT, "max_tokens": 24, "ignore_eos": True, "stream": True}
        n = 0
        async with client.stream("POST", CHAT_URL, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if leave and n >= after:
                        return n                  # leaving the block drops the connection mid-stream
        return n

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.base, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, leave, after) for leave, after in plan))

    try:
        with srv.slowed(0.01):
            counts = asyncio.run(main())
        assert all(c > 0 for c in counts)
        m = srv.wait_kv_idle()
        assert m["vmkv_kv_num_seqs"] == 0
        srv.assert_alive()
        srv.wait_kv_idle()
    finally:
        srv.stop()


def _device_knobs(device: str, backend: str) -> dict:
    """Engine knobs of the parity test on ``device`` (CUDA: the CUDA driver's 2 MiB pages)."""
    if device == "cpu":
        return {}
    knobs = {"device": device, "memory_bytes": 64 << 20}
    if backend == "vmem":
        knobs.update(driver="cuda", page_size_bytes=2 << 20)
    return knobs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", ["paged", "vmem"])
def test_served_tokens_equal_the_in_process_engine(tiny_model_dir, backend, device):
    """Greedy, seeded sampling with n=3, and stop strings (found in the front, across steps): the served
    completions are the in-process engine's, token for token and character for character (on CUDA
    too: CUDA graphs and async scheduling in both)."""
    from vmkv.engine.sampling_params import SamplingParams

    knobs = _device_knobs(device, backend)
    engine = inprocess_engine(tiny_model_dir, backend, knobs)
    prompt = "the capital of France is"

    def offline(params: SamplingParams) -> list:
        return final_completions(engine, prompt, params)

    ref_greedy = offline(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    words = ref_greedy[0].text.split()
    # a stop string of two words from the middle of the greedy text: completed over several steps
    stop = " ".join(words[3:5])
    ref_stop = offline(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    ref_seeded = offline(SamplingParams(temperature=1.0, top_p=0.9, seed=1234, n=3, max_tokens=12, ignore_eos=True))
    engine.close()
    assert ref_stop[0].finish_reason == "stop" and ref_stop[0].stop_reason == stop

    srv = RunningServer(tiny_model_dir, backend, engine_knobs=knobs)
    try:
        def served(body: dict) -> list[dict]:
            r = srv.http.post(COMPLETIONS_URL, json={"model": SERVED, "prompt": prompt, "ignore_eos": True,
                                                     "return_token_ids": True, **body})
            assert r.status_code == 200, r.text
            return sorted(r.json()["choices"], key=lambda c: c["index"])

        def same(choices: list[dict], ref: list) -> None:
            assert [c["token_ids"] for c in choices] == [list(c.token_ids) for c in ref]
            assert [c["text"] for c in choices] == [c.text for c in ref]
            assert [c["finish_reason"] for c in choices] == [c.finish_reason for c in ref]

        same(served({"max_tokens": 20, "temperature": 0}), ref_greedy)
        same(served({"max_tokens": 20, "temperature": 0, "stop": [stop]}), ref_stop)
        same(served({"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "n": 3}), ref_seeded)
        # streamed, the stop string's text never shows, although it arrived over several chunks
        with srv.http.stream("POST", COMPLETIONS_URL, json={"model": SERVED, "prompt": prompt, "max_tokens": 20,
                                                            "temperature": 0, "ignore_eos": True, "stop": [stop],
                                                            "stream": True}) as r:
            chunks = [json.loads(e[len("data: "):]) for e in sse_events(r.read().decode())[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == ref_stop[0].text and stop not in text
        srv.wait_kv_idle()
    finally:
        srv.stop()


def test_max_num_seqs_and_limits_come_from_the_core(tiny_model_dir):
    srv = RunningServer(tiny_model_dir, "paged")
    try:
        card = srv.http.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == MAX_MODEL_LEN and card["vocab_size"] > 100
        assert srv.async_engine.max_num_seqs == MAX_NUM_SEQS
        r = srv.http.post(COMPLETIONS_URL, json={"prompt": [1, 2, 3], "n": MAX_NUM_SEQS + 1, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    finally:
        srv.stop()


def test_a_bad_engine_option_fails_the_server_before_it_listens(tiny_model_dir):
    """A bad option is reported by the core and ``vmkv serve`` exits 2 with the message (no listener)."""
    import sys

    cmd = [sys.executable, "-m", "vmkv.cli", "serve", "--model", str(tiny_model_dir), "--device", "cpu",
           "--max-model-len", "100000", "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot start the engine" in done.stderr and "max_model_len" in done.stderr
    assert "listening" not in done.stdout


def test_a_normal_shutdown_reaps_the_core_once(tiny_model_dir, caplog):
    """The receiver thread and the shutdown both wait for the core process; a race between two reapers
    made ``multiprocessing`` report the exited core as alive, and the shutdown "killed" it after its
    timeout (a spurious warning on every stop, seen on the H200)."""
    import logging

    from vmkv.server.async_engine import AsyncEngine

    async def run_once() -> None:
        ae = AsyncEngine(engine_knobs_for(tiny_model_dir, "paged"), log_level="warning", torch_threads=1)
        ae.start()
        out = await (await ae.add_request("r", None, _greedy(4), [5, 6, 7])).result()
        assert len(out.outputs[0].token_ids) == 4
        t0 = time.monotonic()
        await ae.shutdown()
        assert time.monotonic() - t0 < 8, "the core took its kill timeout to stop"

    with caplog.at_level(logging.WARNING, logger="vmkv.server.async_engine"):
        for _ in range(3):
            asyncio.run(run_once())
    assert not [r for r in caplog.records if "did not stop" in r.getMessage()]


def _greedy(max_tokens: int):
    from vmkv.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_the_front_process_never_imports_torch(tiny_model_dir):
    """The HTTP front tokenizes, detokenizes and streams; torch (and its threads and memory) stays in the
    engine core: the handshake carries nothing that needs torch to unpickle."""
    import sys

    program = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "if __name__ == '__main__':\n"
        "    from pathlib import Path\n"
        "    from server_helpers import engine_knobs_for\n"
        "    from vmkv.server.async_engine import AsyncEngine\n"
        "    import vmkv.server.app, vmkv.server.cli\n"
        f"    ae = AsyncEngine(engine_knobs_for(Path({str(tiny_model_dir)!r}), 'paged'), log_level='warning')\n"
        "    ae.start_core()\n"
        "    assert ae.processor.encode('the capital of France')\n"
        "    ae.close_sync()\n"
        "    print('torch' in sys.modules)\n")
    path = tiny_model_dir.parent / "front_torch_check.py"
    path.write_text(program)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_metrics_answer_while_the_core_is_stopped(tiny_model_dir, monkeypatch):
    """A core that does not answer (SIGSTOP here; a very long step alike) leaves its gauges out of
    ``/metrics`` after the timeout instead of stalling the scrape; once it runs again they are back."""
    import vmkv.server.app as app_mod

    monkeypatch.setattr(app_mod, "METRICS_ENGINE_TIMEOUT_S", 0.5)
    srv = RunningServer(tiny_model_dir, "paged")
    core = srv.async_engine.core_pid
    try:
        assert "vmkv_kv_used_tokens" in srv.http.get("/metrics").text
        os.kill(core, signal.SIGSTOP)
        try:
            r = srv.http.get("/metrics", timeout=10)
            assert r.status_code == 200
            assert "vmkv_kv_used_tokens" not in r.text and "vmkv_http_requests_total" in r.text
        finally:
            os.kill(core, signal.SIGCONT)
        assert "vmkv_kv_used_tokens" in srv.http.get("/metrics").text
        srv.assert_alive()
    finally:
        srv.stop()


def test_serve_binds_its_port_before_loading_the_model(tiny_model_dir):
    """A port in use fails at once (exit 2, naming the port), before the engine core starts; ``--port 0``
    prints the port it really got."""
    import socket
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "vmkv.cli", "serve", "--model", str(tiny_model_dir), "--device", "cpu",
                               "--port", str(port), "--log-level", "info"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "engine core" not in done.stdout + done.stderr and "loaded" not in done.stderr
    cmd = [sys.executable, "-m", "vmkv.cli", "serve", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0",
           "--log-level", "warning"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.time() + 60
        while "listening on" not in line:
            assert time.time() < deadline and p.poll() is None, "no banner"
            line = p.stdout.readline()
        url = line.rsplit("listening on ", 1)[1].strip().removesuffix("/v1")
        assert not url.endswith(":0")
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, f"{url} never answered"
            time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)


def test_health_turns_503_when_the_core_stops_answering(tiny_model_dir, monkeypatch):
    """A core that is alive but stuck (SIGSTOP) leaves ``/health``'s liveness ping unanswered: past
    ``HEALTH_STALL_S`` it answers 503 saying so; once the core runs again it is 200 again."""
    import vmkv.server.app as app_mod

    monkeypatch.setattr(app_mod, "HEALTH_STALL_S", 0.5)
    srv = RunningServer(tiny_model_dir, "paged")
    core = srv.async_engine.core_pid
    try:
        assert srv.http.get("/health").status_code == 200
        os.kill(core, signal.SIGSTOP)
        try:
            srv.http.get("/health")                   # sends a ping the stopped core cannot answer
            time.sleep(1.0)
            r = srv.http.get("/health")
            assert r.status_code == 503 and "has not answered" in r.json()["error"]["message"]
        finally:
            os.kill(core, signal.SIGCONT)
        deadline = time.time() + 15
        while srv.http.get("/health").status_code != 200:
            assert time.time() < deadline, "health never recovered"
            time.sleep(0.1)
        srv.assert_alive()
    finally:
        srv.stop()
