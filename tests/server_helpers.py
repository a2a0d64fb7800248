"""What the server tests share: a tiny random Llama with a word-level tokenizer and a ChatML chat template
(transformers ``save_pretrained``, no download), the real app served by uvicorn on 127.0.0.1 in a thread
of this process with its engine core in a child process (:class:`RunningServer`, through
:class:`vmkv.server.async_engine.AsyncEngine` and :func:`vmkv.server.http_server.build_server` like
``vmkv serve``), and ``vmkv serve`` as a child process (:class:`ServerProcess`).

Faults and delays are injected into the engine core process with :meth:`RunningServer.call` and the
module-level functions below (they are pickled by reference and run in the core between two steps)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 16
SERVED = "tiny-llama"
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
CHAT = [{"role": "system", "content": "you are a good help"}, {"role": "user", "content": "what is the capital of France"}]

WORDS = (
    "the a of to and in is it you that he was for on are with as I his they be at one have this from or "
    "had by hot word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too same "
    "tell does set three want air well also play small end put home read hand port large spell add even "
    "land here must big high such follow act why ask men change went light kind off need house picture try "
    "us again animal point mother world near build self earth father Paris France capital"
).split()
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: vmem pages of 16 tokens of the tiny model (2 layers x 2 KV heads x 16 dims x K,V x fp32 = 512 bytes a
#: token), so that prefix caching works at the granularity of paged's 16-token blocks
VMEM_PAGE_SIZE_BYTES = 16 * 512


def make_tiny_model(path: Path) -> Path:
    """A 2-layer random Llama (GQA 4/2 heads, vocab ~210) with tokenizer and chat template, in ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(special + WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(http: httpx.Client, url: str, body: Any) -> httpx.Response:
    """POST ``body`` encoded by ``json.dumps`` (ASCII escapes: lone surrogates and NaN survive, which
    httpx's own ``json=`` encoding refuses)."""
    return http.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def sse_events(raw: str) -> list[str]:
    """The non-empty events of an SSE body."""
    return [e for e in raw.split("\n\n") if e]


# ---------------------------------------------------------------------- run in the engine core (call)
def set_step_delay(engine, delay_s: float) -> None:
    """Every engine step takes ``delay_s`` longer (0: back to normal).  Patches ``step_deltas``, the
    method the engine core calls (``EngineCore.run``)."""
    engine.__dict__.pop("step_deltas", None)
    if delay_s:
        real_step = engine.step_deltas

        def slow_step():
            engine.num_slowed_steps = getattr(engine, "num_slowed_steps", 0) + 1
            time.sleep(delay_s)
            return real_step()

        engine.step_deltas = slow_step


def num_slowed_steps(engine) -> int:
    """Steps :func:`set_step_delay` slowed so far (a test checks its patch fired)."""
    return getattr(engine, "num_slowed_steps", 0)


def fail_steps(engine, message: str, after: int = 0, times: int | None = None) -> None:
    """The engine's steps raise ``RuntimeError(message)``: after ``after`` more good steps, ``times``
    times (None: for ever).  Patches ``step_deltas``, the method the engine core calls."""
    engine.__dict__.pop("step_deltas", None)
    real_step = engine.step_deltas
    state = {"good": after, "bad": times}

    def step():
        if state["good"] > 0:
            state["good"] -= 1
            return real_step()
        if state["bad"] is None or state["bad"] > 0:
            if state["bad"] is not None:
                state["bad"] -= 1
            raise RuntimeError(message)
        return real_step()

    engine.step_deltas = step


def has_unfinished_requests(engine) -> bool:
    return engine.has_unfinished_requests()


def check_kv_integrity(engine) -> int:
    """``kv_cache.check_integrity()``; returns the cache's page size in bytes (vmem) or 0."""
    engine.kv_cache.check_integrity()
    return int(getattr(engine.kv_cache, "page_size_bytes", 0))


def engine_knobs_for(model_dir: Path | None, backend: str, engine_knobs: dict | None = None) -> dict:
    """``LLMEngine.from_args`` keywords of the test servers."""
    knobs = {"driver": "host", "page_size_bytes": VMEM_PAGE_SIZE_BYTES} if backend == "vmem" else {}
    if model_dir is None:                   # a random-weight model without a tokenizer
        knobs["random_weights"] = "tiny"
    return {"model": None if model_dir is None else str(model_dir), "kv_backend": backend, "device": "cpu",
            "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
            "memory_bytes": 4 << 20, **knobs, **(engine_knobs or {})}


def inprocess_engine(model_dir: Path | None, backend: str, engine_knobs: dict | None = None):
    """The engine a :class:`RunningServer` with the same arguments runs in its core, built in this process
    (the reference the served completions are compared with)."""
    from vmkv.engine.llm_engine import LLMEngine

    kwargs = engine_knobs_for(model_dir, backend, engine_knobs)
    return LLMEngine.from_args(kwargs.pop("model"), kwargs.pop("kv_backend"), kwargs.pop("device"),
                               kwargs.pop("dtype"), **kwargs)


def final_completions(engine, prompt, params) -> list:
    """Run one request (``prompt`` text or token ids) on an in-process engine to its end; its completions
    by index."""
    ids = None if isinstance(prompt, str) else list(prompt)
    engine.add_request("r", prompt if ids is None else None, params, prompt_token_ids=ids)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return sorted(final.outputs, key=lambda c: c.index)


class RunningServer:
    """The real app on uvicorn in a background thread, its engine core in a child process."""

    def __init__(self, model_dir: Path | None, backend: str, engine_knobs: dict | None = None,
                 **server_kwargs: Any) -> None:
        from vmkv.server.app import build_app
        from vmkv.server.async_engine import AsyncEngine
        from vmkv.server.http_server import build_server

        self.backend = backend
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        app_kwargs = {k: server_kwargs.pop(k) for k in ("max_request_bytes",) if k in server_kwargs}
        self.async_engine = AsyncEngine(engine_knobs_for(model_dir, backend, engine_knobs), log_level="warning",
                                        torch_threads=1)
        self.async_engine.start_core()
        app = build_app(self.async_engine, SERVED, **app_kwargs)
        self.server = build_server(app, host="127.0.0.1", port=self.port, log_level="warning",
                                   graceful_timeout_s=2, **server_kwargs)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=self.base, timeout=30)  # one client: its SSL setup is slow

    def call(self, fn, *args: Any, timeout_s: float = 30.0) -> Any:
        """``fn(engine, *args)`` run in the engine core process (``AsyncEngine.call``)."""
        ae = self.async_engine
        return asyncio.run_coroutine_threadsafe(ae.call(fn, *args), ae.loop).result(timeout_s)

    @contextlib.contextmanager
    def slowed(self, step_delay_s: float):
        """Make every engine step take ``step_delay_s`` longer (a slower model), so a request is
        reliably still running when the client leaves."""
        before = self.call(num_slowed_steps)
        self.call(set_step_delay, step_delay_s)
        try:
            yield
        finally:
            self.call(set_step_delay, 0.0)
        assert self.call(num_slowed_steps) > before, "the step delay never fired (patched a method the core no longer calls?)"

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.async_engine.close_sync()      # the lifespan stopped it already, unless uvicorn failed

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics, plus labelled ones keyed by their full text name."""
        text = self.http.get("/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_kv_idle(self, timeout_s: float = 15.0) -> dict[str, float]:
        deadline = time.time() + timeout_s
        while True:
            m = self.metrics()
            if m["vmkv_kv_used_tokens"] == 0 and m["vmkv_num_requests_running"] == 0 \
                    and m["vmkv_num_requests_waiting"] == 0:
                return m
            assert time.time() < deadline, f"KV still in use: {m['vmkv_kv_used_tokens']} tokens"
            time.sleep(0.05)

    def assert_alive(self) -> None:
        """The server still serves real work."""
        r = self.client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def slow_engine(delay_s: float, **kwargs):
    """Engine factory (runs in the engine core): ``LLMEngine.from_args(**kwargs)`` with every step
    ``delay_s`` slower."""
    from vmkv.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(**kwargs)
    set_step_delay(engine, delay_s)
    return engine


#: ``python -c`` program: ``vmkv`` whose engine core steps are slowed by ``argv[1]`` seconds (a slower model,
#: so that requests are reliably still running when the server is told to stop), then ``argv[2:]``; the
#: tests folder is ``argv[2]``, so that the core process can import :func:`slow_engine`
_SLOW_VMKV = """
import functools, sys
sys.path.insert(0, sys.argv[2])
import server_helpers
from vmkv.server import async_engine
real_init = async_engine.AsyncEngine.__init__
def init(self, *args, **kwargs):
    kwargs.setdefault("engine_factory", functools.partial(server_helpers.slow_engine, float(sys.argv[1])))
    real_init(self, *args, **kwargs)
async_engine.AsyncEngine.__init__ = init
from vmkv.cli import main
sys.exit(main(sys.argv[3:]))
"""


class ServerProcess:
    """``vmkv serve`` on the tiny model as a child process (stdout and stderr merged)."""

    def __init__(self, model_dir: Path, *args: str, step_delay_s: float = 0.0) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        serve = ["serve", "--model", str(model_dir), "--backend", "paged", "--port", str(self.port),
                 "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--memory-bytes", "2MiB",
                 "--device", "cpu", "--served-model-name", SERVED, "--log-level", "warning", *args]
        cmd = [sys.executable, "-c", _SLOW_VMKV, str(step_delay_s), str(Path(__file__).parent), *serve] if step_delay_s \
            else [sys.executable, "-m", "vmkv.cli", *serve]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
