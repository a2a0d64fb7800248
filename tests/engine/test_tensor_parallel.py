"""Tensor parallelism (``tensor_parallel_size``, issue 13) on CPU: the sharding math in one process
(sharded layers against the full ones, a whole 2-rank model run on two threads against the full model),
the divisibility errors, and the engine with 2 processes over gloo: TP=2 generates what TP=1 generates,
token for token, on both backends, with preemption and ``n > 1``; worker failures stop the engine
(fatal), ``close()`` and rank 0's death end the workers.  A 2-GPU NCCL run skips without 2 GPUs.

The tiny random model (``random_weights="tiny"``: 4 query heads, 2 KV heads, intermediate 128,
vocabulary 512) in float32; its KV takes 512 bytes per token (256 on each of 2 ranks).
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from vmkv.engine.config import EngineConfig
from vmkv.engine.errors import is_fatal_error
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.sampling_params import SamplingParams
from vmkv.engine.tensor_parallel import TensorParallelError
from vmkv.engine.tp_cache import READ_ONLY, REPLICATED
from vmkv.kvcache import KVCache, StepSeq, create_kv_cache
from vmkv.model import LlamaForCausalLM, random_model
from vmkv.model.config import SHAPES
from vmkv.model.parallel import TensorParallel, check_divisible, shard_layout

TINY = SHAPES["tiny"]
BYTES_PER_TOKEN = 512
BACKENDS = {"paged": {}, "vmem": {"driver": "host", "page_size_bytes": 4096}}
#: the engine runs also map ahead and give idle pages back (calls every rank replays)
ENGINE_KNOBS = {"paged": {}, "vmem": {"prefetch_tokens": 8, "lookahead_tokens": 8, "kv_shrink_grace_s": 0.0,
                                     "kv_reserve_bytes": 0}}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine: one intra-op thread per process (the workers take
    rank 0's count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------- the sharding math, one process
class _Local(TensorParallel):
    """One rank's arithmetic with the collectives left out (the test sums / concatenates)."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x


def test_sharded_layers_with_an_emulated_all_reduce_equal_the_full_ones():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g, dtype=torch.float64)
    # column-parallel fused qkv: each rank's q, k and v rows; concatenated per part they are the full output
    qkv = torch.randn(TINY.q_size + 2 * TINY.kv_size, 64, generator=g, dtype=torch.float64)
    layout = shard_layout("layers.0.self_attn.qkv_proj.weight", TINY)
    outs = [x @ TensorParallel(r, 2).shard(qkv, layout).T for r in range(2)]
    full = (x @ qkv.T).split([TINY.q_size, TINY.kv_size, TINY.kv_size], -1)
    for part, (lo, n) in zip(full, [(0, 32), (32, 16), (48, 16)]):
        torch.testing.assert_close(torch.cat([o[:, lo:lo + n] for o in outs], -1), part)
    # row-parallel o_proj: the input columns split, the partial products summed, the bias added once
    o = torch.randn(64, TINY.q_size, generator=g, dtype=torch.float64)
    bias = torch.randn(64, generator=g, dtype=torch.float64)
    a = torch.randn(5, TINY.q_size, generator=g, dtype=torch.float64)
    layout = shard_layout("layers.0.self_attn.o_proj.weight", TINY)
    parts = [_Local(r, 2).row_parallel_linear(a[:, r * 32:(r + 1) * 32], _Local(r, 2).shard(o, layout), None)
             for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1] + bias, a @ o.T + bias)
    assert TensorParallel(0, 2).shard(bias, None) is bias            # replicated
    # vocab-parallel embedding: each rank zeroes the ids outside its rows; the sum is the lookup
    emb = torch.randn(TINY.vocab_size, 64, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 255, 256, 511, 7, 300])
    layout = shard_layout("embed_tokens.weight", TINY)
    rows = [_Local(r, 2).embedding(ids, _Local(r, 2).shard(emb, layout)) for r in range(2)]
    assert torch.equal(rows[0] + rows[1], emb[ids])
    # the LM head's logits side by side are the full vocabulary's
    h = torch.randn(3, 64, generator=g, dtype=torch.float64)
    logits = torch.cat([h @ TensorParallel(r, 2).shard(emb, layout).T for r in range(2)], -1)
    torch.testing.assert_close(logits, h @ emb.T)


def test_every_rank_gets_its_shard_of_the_same_random_weights():
    full = dict(random_model("tiny", device="cpu", seed=3).model.named_parameters())
    shards = [dict(random_model("tiny", device="cpu", seed=3, tp=TensorParallel(r, 2)).model.named_parameters())
              for r in range(2)]
    for name, p in full.items():
        layout = shard_layout(name, TINY)
        for r in range(2):
            assert torch.equal(shards[r][name], TensorParallel(r, 2).shard(p, layout)), (name, r)
    assert shards[0]["layers.0.self_attn.qkv_proj.weight"].shape == (64, 64)   # 2 q + 1 k + 1 v heads of 16
    assert shards[1]["layers.0.mlp.down_proj.weight"].shape == (64, 64)        # half of 128 columns


def test_load_weights_cuts_each_rank_its_shard():
    names = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
    full = random_model("tiny", device="cpu", seed=5).model
    hf = [("model.embed_tokens.weight", full.embed_tokens.weight), ("model.norm.weight", full.norm.weight),
          ("lm_head.weight", full.lm_head.weight)]
    for i, layer in enumerate(full.layers):
        qkv = layer.self_attn.qkv_proj.weight.split([TINY.q_size, TINY.kv_size, TINY.kv_size])
        hf += [(f"model.layers.{i}.{n}.weight", qkv[k]) for n, k in names.items()]
        gate, up = layer.mlp.gate_up_proj.weight.split([TINY.intermediate_size] * 2)
        hf += [(f"model.layers.{i}.mlp.gate_proj.weight", gate), (f"model.layers.{i}.mlp.up_proj.weight", up),
               (f"model.layers.{i}.mlp.down_proj.weight", layer.mlp.down_proj.weight),
               (f"model.layers.{i}.self_attn.o_proj.weight", layer.self_attn.o_proj.weight),
               (f"model.layers.{i}.input_layernorm.weight", layer.input_layernorm.weight),
               (f"model.layers.{i}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)]
    for r in range(2):
        model = LlamaForCausalLM(TINY, tp=TensorParallel(r, 2))
        model.load_weights(hf)
        assert model.missing_weights() == []
        want = random_model("tiny", device="cpu", seed=5, tp=TensorParallel(r, 2)).model
        for (name, p), (_, q) in zip(model.named_parameters(), want.named_parameters()):
            assert torch.equal(p, q), (name, r)


class _ThreadGroup:
    """The collectives of ``size`` threads (one per rank), for a whole-model test in one process."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=30)

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


class _ThreadTP(TensorParallel):
    def __init__(self, rank: int, group: _ThreadGroup) -> None:
        super().__init__(rank, group.size)
        self.g = group

    def all_reduce(self, x):
        parts = self.g.exchange(self.rank, x)
        return x.copy_(parts[0] + parts[1])

    def all_gather(self, x):
        return torch.cat(self.g.exchange(self.rank, x), -1)


def _step(model, cache, prompts):
    batch, ids = [], []
    for i, p in enumerate(prompts):
        cache.allocate(i, len(p))
        batch.append(StepSeq(i, 0, len(p)))
        ids += p
    meta = cache.prepare(batch)
    return model(torch.tensor(ids), meta.positions, cache, meta)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_rank_model_on_threads_equals_the_full_model(backend):
    """The whole sharded forward (heads, MLP, vocabulary; each rank's KV cache of 1 head), 2 ranks on
    2 threads, gives the full model's logits in float32 up to the all-reduce's rounding."""
    prompts = [[5, 9, 300, 17, 2, 400], [260, 1, 44]]
    full = random_model("tiny", device="cpu", seed=1).model
    with create_kv_cache(backend, TINY.kv_spec("cpu", torch.float32), max_num_seqs=4, max_model_len=64,
                         memory_bytes=1 << 20, **BACKENDS[backend]) as cache:
        want = _step(full, cache, prompts)
    group, got = _ThreadGroup(2), [None, None]

    def rank(r: int) -> None:
        tp = _ThreadTP(r, group)
        model = random_model("tiny", device="cpu", seed=1, tp=tp).model
        spec = TINY.kv_spec("cpu", torch.float32)
        spec = type(spec)(spec.num_layers, 1, spec.head_dim, spec.dtype, spec.device)
        with create_kv_cache(backend, spec, max_num_seqs=4, max_model_len=64, memory_bytes=1 << 19,
                             **BACKENDS[backend]) as cache:
            got[r] = _step(model, cache, prompts)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[0] is not None and got[1] is not None
    assert torch.equal(got[0], got[1])                   # every rank ends with the same full logits
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


def test_sizes_that_do_not_divide_are_refused_with_the_ones_that_do():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide ModelConfig.num_heads=4.*"
                                         r"tensor_parallel_size in \[1, 2\]"):
        check_divisible(TINY, 3)
    with pytest.raises(ValueError, match="does not divide ModelConfig.num_kv_heads=2"):
        LlamaForCausalLM(TINY, tp=TensorParallel(0, 4))
    with pytest.raises(ValueError, match="vocab_size=49153"):
        check_divisible(TINY.with_overrides(vocab_size=49153), 2)
    with pytest.raises(ValueError, match="intermediate_size=129"):
        check_divisible(TINY.with_overrides(intermediate_size=129), 2)
    with pytest.raises(ValueError, match=r"EngineConfig.tensor_parallel_size must be a positive int, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="rank must be an int in"):
        TensorParallel(2, 2)


def test_engine_refuses_a_size_that_does_not_divide_and_leaves_no_process():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide ModelConfig.num_heads=4"):
        LLMEngine.from_args(None, "paged", "cpu", "float32", random_weights="tiny", tensor_parallel_size=3)
    assert multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()
    loaded = random_model("tiny", device="cpu")             # an already loaded model cannot be split
    with pytest.raises(ValueError, match="needs the engine to load the model in every rank"):
        LLMEngine(EngineConfig(random_weights="tiny", device="cpu", tensor_parallel_size=2), loaded=loaded)


def test_the_proxy_classifies_every_kv_cache_call():
    """A call added to the KVCache interface must be declared replicated or read-only here."""
    public = {n for n in dir(KVCache) if not n.startswith("_") and callable(getattr(KVCache, n))}
    assert public - {"close"} == set(REPLICATED) | set(READ_ONLY) | {"write"}


# ---------------------------------------------------------------------- the engine, 2 processes over gloo
def _run(tp: int, backend: str, **knobs) -> tuple[dict, object]:
    engine = LLMEngine.from_args(None, "vmem" if backend == "vmem" else "paged", "cpu", "float32",
                                 random_weights="tiny", tensor_parallel_size=tp, seed=1,
                                 **BACKENDS[backend], **ENGINE_KNOBS[backend], **knobs)
    try:
        if tp > 1:
            workers = [w.process for w in engine.model.workers]
            assert engine.kv_cache.inner.spec.num_kv_heads == 1 and engine.kv_cache.spec.num_kv_heads == 2
        g = torch.Generator().manual_seed(7)
        for i in range(6):
            prompt = torch.randint(3, TINY.vocab_size, (12 + 5 * i,), generator=g).tolist()
            engine.add_request(f"g{i}", None, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                               prompt_token_ids=prompt)
        engine.add_request("n2", None, SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=16,
                                                      ignore_eos=True), prompt_token_ids=[5, 6, 7, 300, 9])
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    assert o.error is None, o.error
                    out[o.request_id] = [list(c.token_ids) for c in o.outputs]
        engine.kv_cache.check_integrity()
        stats = engine.get_stats()
        if tp > 1:      # every rank's cache made the same decisions: the same blocks / pages / counts
            usages = engine.model.rank_usages(engine.kv_cache)
            assert usages[0] == usages[1] and usages[0].num_seqs == 0 and usages[0].prefix_query_tokens > 0
    finally:
        engine.close()
    if tp > 1:
        assert not any(p.is_alive() for p in workers)        # close() ended them
        assert not torch.distributed.is_initialized()
    return out, stats


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_tp2_generates_what_tp1_generates_with_preemption_and_n2(backend):
    """6 greedy prompts (12..37 tokens, 24 new each) and one n=2 sampled request in a KV budget of
    192 tokens: requests are preempted (recompute) on both sizes, and every token is the same."""
    knobs = dict(memory_bytes=192 * BYTES_PER_TOKEN, max_model_len=64, max_num_seqs=8)
    want, stats1 = _run(1, backend, **knobs)
    got, stats2 = _run(2, backend, **knobs)
    assert stats1.num_preempted_total > 0 and stats2.num_preempted_total > 0
    assert len(want) == 7 and len(want["n2"]) == 2 and want["n2"][0] != want["n2"][1]
    assert got == want
    # the proxy reports the whole cache: both ranks' bytes
    assert stats2.kv_usage.capacity_bytes == pytest.approx(stats1.kv_usage.capacity_bytes, rel=0.1)


def test_generate_cli_with_tensor_parallel_size_2(capsys):
    from vmkv.cli import main

    common = ["generate", "--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--memory-bytes",
              "1MiB", "--max-tokens", "6", "--ignore-eos", "--seed", "2", "--no-stream", "--prompt-token-ids", "1,2,3"]
    assert main(common) == 0
    want = capsys.readouterr().out
    assert "tensor parallel" not in capsys.readouterr().err
    assert main([*common, "--tensor-parallel-size", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == want and len(want.split(",")) == 6
    # it says so (it used to print the same line as TP=1; issue 25, item 6)
    assert "tensor parallel over 2 ranks (gloo; cpu, cpu)" in " ".join(captured.err.split())


def test_a_script_read_from_stdin_is_refused_saying_the_ranks_cannot_reimport_it(tmp_path):
    """``python - < script.py`` used to fail with "rank 1 exited while loading its shard": each spawned
    rank re-runs ``__main__`` from ``__file__``, which is ``"<stdin>"``."""
    import subprocess
    import sys

    script = ("from vmkv.engine.llm_engine import LLMEngine\n"
              "if __name__ == '__main__':\n"
              "    LLMEngine.from_args(None, 'paged', 'cpu', 'float32', random_weights='tiny',\n"
              "                        tensor_parallel_size=2, memory_bytes=1 << 20)\n")
    r = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode != 0
    assert "ValueError: tensor_parallel_size=2" in r.stderr and "standard input" in r.stderr, r.stderr[-2000:]
    assert "cannot re-import" in r.stderr and "exited while loading" not in r.stderr
    # the same script from a file runs
    (tmp_path / "script.py").write_text(script)
    r = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_failing_worker_stops_the_engine_with_its_traceback():
    engine = LLMEngine.from_args(None, "paged", "cpu", "float32", random_weights="tiny", tensor_parallel_size=2,
                                 memory_bytes=1 << 20)
    try:
        worker = engine.model.workers[0].process
        engine.model._send(("no such message",))          # the worker raises, reports, exits
        worker.join(10)
        engine.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=2), prompt_token_ids=[1, 2])
        with pytest.raises(TensorParallelError, match=r"(?s)rank 1 stopped.*unknown message") as info:
            engine.step()
        assert is_fatal_error(info.value)
        with pytest.raises(TensorParallelError, match="failed earlier"):     # and stays stopped
            engine.model.forward(torch.tensor([1]), torch.tensor([0]), engine.kv_cache, None)
    finally:
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < 5
    assert not torch.distributed.is_initialized()


def test_a_worker_killed_mid_run_is_a_fatal_error():
    engine = LLMEngine.from_args(None, "vmem", "cpu", "float32", random_weights="tiny", tensor_parallel_size=2,
                                 memory_bytes=1 << 20, driver="host")
    try:
        engine.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=4), prompt_token_ids=[1, 2])
        engine.step()
        worker = engine.model.workers[0].process
        worker.kill()
        worker.join(10)
        with pytest.raises(TensorParallelError, match=r"rank 1 (stopped|is gone)(?s:.*)exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.close()


def test_workers_exit_when_rank_0_dies():
    script = textwrap.dedent("""
        import os, signal
        import torch
        from vmkv.engine.llm_engine import LLMEngine
        if __name__ == "__main__":
            torch.set_num_threads(1)
            e = LLMEngine.from_args(None, "paged", "cpu", "float32", random_weights="tiny",
                                    tensor_parallel_size=2, memory_bytes=1 << 20)
            print(" ".join(str(w.process.pid) for w in e.model.workers), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1, proc.stderr

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie has exited
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 15
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(p) for p in pids)


# ---------------------------------------------------------------------- 2 GPUs, NCCL
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_tp2_on_two_gpus_generates_what_one_gpu_generates(backend):
    opts = {"driver": "cuda"} if backend == "vmem" else {}

    def run(tp: int) -> list:
        engine = LLMEngine.from_args(None, backend, "cuda", "float32", random_weights="tiny", seed=1,
                                     tensor_parallel_size=tp, memory_bytes=64 << 20, enforce_eager=True, **opts)
        try:
            outs = []
            for i in range(4):
                engine.add_request(f"r{i}", None, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                   prompt_token_ids=list(range(3 + i, 40 + 7 * i)))
            while engine.has_unfinished_requests():
                outs += [(o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished]
            return sorted(outs)
        finally:
            engine.close()

    assert run(2) == run(1)


def test_compare_engine_passes_the_size_to_its_runs():
    import argparse

    from vmkv.compare import engine_bench

    p = argparse.ArgumentParser()
    engine_bench.add_arguments(p)
    for flags, want in (([], 1), (["--tensor-parallel-size", "2"], 2)):
        assert engine_bench._knobs(p.parse_args(flags), 256, "paged")["tensor_parallel_size"] == want
