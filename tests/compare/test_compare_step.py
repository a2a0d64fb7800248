"""`vmkv compare step` end to end on the `tiny` random-weight shape, both backends, CPU; its command-line checks."""

import argparse
import json
import math

import pytest

from vmkv.cli import main
from vmkv.compare import step_bench
from vmkv.compare.step_worker import busy_us, max_tokens_for

TINY = ["--model", "tiny", "--device", "cpu", "--torch-threads", "1"]


def _args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    step_bench.add_arguments(p)
    return p.parse_args([*TINY, *flags])


@pytest.mark.slow
def test_compare_step_tiny_both_backends(tmp_path):
    out = tmp_path / "res"
    batches, contexts, steps = (1, 3), (16, 40), 4
    rc = main(["compare", "step", "--backends", "paged,vmem", *TINY, "--batch-sizes", "1,3",
               "--context-lens", "16,40", "--steps", str(steps), "--warmup-steps", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "step_bench.json").read_text())
    assert res["kind"] == "step" and res["command"] == res["environment"]["command"]  # sys.argv (pytest's here)
    env = res["environment"]
    assert {"torch", "triton", "gpus", "git_commit"} <= set(env)
    points = {(p["backend"], p["batch"], p["context"]): p for p in res["points"]}
    assert set(points) == {(b, n, c) for b in ("paged", "vmem") for n in batches for c in contexts}
    from vmkv.model import random_model

    model = random_model("tiny", device="cpu")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.model.parameters())
    bpt = 2 * 2 * 2 * 16 * 4            # tiny: 2 layers x (K, V) x 2 KV heads x 16 dims x fp32
    for (backend, b, c), p in points.items():
        w = res["workers"][backend]
        assert "error" not in p and "error" not in w
        assert p["weight_bytes"] == w["weight_bytes"] == weight_bytes and p["kv_bytes_per_token"] == bpt
        assert p["read_bytes_per_s"] == w["read_bandwidth"]["bytes_per_s"] > 0
        # every timed step was decode-only with exactly B sequences, each one token longer than before
        assert p["decode_only"] is True and p["num_steps"] == len(p["steps"]) == steps
        for s in p["steps"]:
            assert s["num_seqs_with_one_new_token"] == b and s["step_s"] > 0
        assert p["num_running_seqs"] == b
        assert 0 <= p["alloc_ms_per_step"] < p["step_ms_max"] and p["prefetch_ms_per_step"] >= 0
        assert p["release_ms_per_step"] >= 0
        kv = [s["kv_tokens_read"] for s in p["steps"]]
        assert all(y - x == b for x, y in zip(kv, kv[1:]))          # every sequence grew by one token a step
        assert kv[0] >= b * (c + 2)                                    # prompt + first token + the warm-up step
        # the numbers agree with each other
        ms = sorted(s["step_s"] * 1e3 for s in p["steps"])
        assert p["floor_ms"] > 0 and ms[0] <= p["step_ms_p10"] <= p["step_ms"] <= p["step_ms_p90"] <= ms[-1]
        assert p["step_ms"] == pytest.approx((ms[1] + ms[2]) / 2) and p["step_ms_max"] == pytest.approx(ms[-1])
        assert p["alloc_ms_per_step"] == pytest.approx(p["window_kv_s"]["alloc_s"] / (steps + 1) * 1e3)
        assert p["kv_bytes_read"] == pytest.approx(sum(kv) / len(kv) * bpt)
        assert p["floor_ms"] == pytest.approx((weight_bytes + p["kv_bytes_read"]) / p["read_bytes_per_s"] * 1e3)
        assert p["floor_over_step"] == pytest.approx(p["floor_ms"] / p["step_ms"])
        assert p["output_tok_s"] == pytest.approx(b / (p["step_ms"] * 1e-3))   # at the median step
        assert p["gpu_busy_pct"] is None and p["gpu_busy"] is None      # CPU: no GPU-busy share
        assert p["max_tokens"] == max_tokens_for(b, c, 16384, 1 + steps + 5 + 3)   # each window runs one more step
        if backend == "vmem":
            assert p["vmem_over_paged_tok_s"] == pytest.approx(
                p["output_tok_s"] / points[("paged", b, c)]["output_tok_s"])
    md = (out / "step_bench.md").read_text()
    assert "| " + " | ".join(step_bench.COLUMNS) + " |" in md
    for (backend, b, c), p in points.items():
        assert f"| {backend} | {b} | {c} | {p['step_ms']:.2f} (" in md
        assert f"| {p['floor_ms']:.2f} | {p['floor_over_step']:.3f} | - |" in md
    assert "- paged: read bandwidth" in md and "- vmem: read bandwidth" in md and res["command"] in md
    assert (out / "raw" / "step-paged.json").exists() and (out / "raw" / "step-vmem.log").exists()


# ------------------------------------------------------------------ command line
@pytest.mark.parametrize("text, message", [
    ("0,4", "--batch-sizes: 0 must be >= 1"),
    ("1,x", "--batch-sizes: 'x' is not an integer"),
    (" , ", "--batch-sizes is empty"),
    ("-3", "--batch-sizes: -3 must be >= 1"),
])
def test_bad_batch_grids_are_refused(text, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        step_bench.parse_grid(text, "--batch-sizes")


def test_grid_keeps_order_and_drops_duplicates():
    assert step_bench.parse_grid("256, 1,64,1", "--batch-sizes") == [256, 1, 64]


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "0"], "--batch-sizes: 0 must be >= 1"),
    (["--context-lens", "1k"], "--context-lens: '1k' is not an integer"),
    (["--context-lens", "4000"], "--context-lens 4000 needs"),
    (["--batch-sizes", "64", "--max-num-batched-tokens", "64"], "--max-num-batched-tokens 64 must exceed"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--backends", "paged,blocks"], "unknown KV backend 'blocks'"),
    (["--backends", "paged", "--layout", "per_layer"], "--layout is an option of the vmem backend"),
])
def test_cli_refuses_bad_values_with_status_2(flags, message, tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(step_bench, "_run_worker", lambda *a, **k: started.append(a))
    rc = main(["compare", "step", *TINY, "--out", str(tmp_path), *flags])
    assert rc == 2 and started == []
    assert message in capsys.readouterr().out.replace("\n", " ")


def test_context_error_names_the_limit_and_the_fix():
    with pytest.raises(ValueError) as e:
        step_bench.plan(_args("--context-lens", "4000"))
    assert "more than tiny's context of 2048" in str(e.value) and "use context lengths up to" in str(e.value)


def test_model_must_be_a_random_weight_shape():
    with pytest.raises(ValueError, match="not a random-weight shape"):
        step_bench.plan(_args("--model", "/some/checkpoint"))


def test_plan_passes_graph_flags_and_backend_options():
    cfg = step_bench.plan(_args("--enforce-eager", "--cuda-graph-sizes", "4", "1", "--layout", "per_layer",
                                "--block-size", "32", "--batch-sizes", "1,8", "--context-lens", "64,32"))
    assert cfg["backends"] == ["paged", "vmem"]
    assert cfg["points"] == [[1, 64], [8, 64], [1, 32], [8, 32]]
    for b, k in cfg["knobs"].items():
        assert k["enforce_eager"] is True and k["cuda_graph_sizes"] == (4, 1)
        assert k["random_weights"] == "tiny" and k["max_num_seqs"] == 8
        assert k["memory_bytes"] == cfg["memory_bytes"] and k["max_model_len"] == cfg["max_model_len"]
    assert cfg["knobs"]["vmem"]["layout"] == "per_layer" and "layout" not in cfg["knobs"]["paged"]
    assert cfg["knobs"]["paged"]["block_size"] == 32 and "block_size" not in cfg["knobs"]["vmem"]
    # every point fits: prompt + every step it runs
    assert cfg["max_model_len"] >= 64 + max_tokens_for(8, 64, 16384, 3 + 20 + 5)
    # the engine accepts the knobs as they are
    from vmkv.engine.config import EngineConfig

    for b, k in cfg["knobs"].items():
        assert EngineConfig.from_args(kv_backend=b, **k).enforce_eager is True
    # the KV budget covers the largest point (fp32 on CPU) with room
    assert cfg["memory_bytes"] >= 8 * (64 + max_tokens_for(8, 64, 16384, 28)) * 512


def test_default_flags_reach_the_engine():
    k = step_bench.plan(_args("--context-lens", "1024"))["knobs"]["paged"]
    assert k["enforce_eager"] is False and k["cuda_graph_sizes"] is None


# ------------------------------------------------------------------ pieces of the worker
def test_busy_counts_overlapping_device_intervals_once():
    events = [{"cat": "kernel", "ts": 0, "dur": 10}, {"cat": "kernel", "ts": 5, "dur": 10},   # 0..15
              {"cat": "gpu_memcpy", "ts": 20, "dur": 5}, {"cat": "kernel", "ts": 21, "dur": 1},  # 20..25
              {"cat": "cpu_op", "ts": 30, "dur": 100}, {"cat": "gpu_memset", "ts": 40, "dur": 2}]
    assert busy_us(events) == 15 + 5 + 2
    assert busy_us([]) == 0


def test_max_tokens_covers_prefill_and_every_decode_step():
    # 256 x 2048 prompt tokens at 16384 a step (256 of them decode): 33 prefill steps at most, + 2
    assert max_tokens_for(256, 2048, 16384, 28) == math.ceil(256 * 2048 / (16384 - 256)) + 2 + 28 + 2
    assert max_tokens_for(1, 16, 16384, 0) == 1 + 2 + 2


def test_step_error_line_and_duplicate_backends():
    """A failed worker's table row names its exception (the log tail's last line), not the first
    traceback line; a backend listed twice and a timeout <= 0 are refused (adversarial pass)."""
    from vmkv.compare.step_bench import _error_line

    err = 'worker exited with 1: Traceback (most recent call last):\n  File "x.py", line 3\nValueError: too small'
    assert _error_line(err) == "worker exited with 1: ValueError: too small"
    assert _error_line("KVCacheFullError: full") == "KVCacheFullError: full"
    from vmkv.compare.step_bench import plan
    with pytest.raises(ValueError, match="twice"):
        plan(_args("--backends", "paged,paged"))
    with pytest.raises(ValueError, match="timeout"):
        plan(_args("--timeout-s", "-5"))


class _FakeEngine:
    """Just enough of LLMEngine for ``run_point``: every ``step()`` gives each request one token and
    spends exactly 1 ms allocating, 2 ms prefetching and 3 ms releasing KV."""

    def __init__(self):
        import types

        import torch

        self.device = torch.device("cpu")
        self.model_config = types.SimpleNamespace(vocab_size=100)
        self.runner = types.SimpleNamespace(release_time_s_total=0.0)
        self.rids, self.num_calls, self.prompt, self.gen = [], 0, 0, 0

    def add_request(self, rid, prompt, params, prompt_token_ids):
        self.rids.append(rid)
        self.prompt += len(prompt_token_ids)

    def step(self):
        import types

        self.num_calls += 1
        self.runner.release_time_s_total += 3e-3
        self.gen += len(self.rids)
        return [types.SimpleNamespace(error=None, request_id=r, outputs=[types.SimpleNamespace(
            delta_token_ids=[1])]) for r in self.rids]

    def get_stats(self):
        import types

        return types.SimpleNamespace(alloc_time_s_total=1e-3 * self.num_calls,
                                     prefetch_time_s_total=2e-3 * self.num_calls,
                                     num_generation_tokens_total=self.gen, num_prompt_tokens_total=self.prompt,
                                     num_running_seqs=len(self.rids))

    def abort_request(self, rid):
        self.rids.remove(rid)

    def has_unfinished_requests(self):
        return bool(self.rids)


def test_kv_time_per_step_divides_by_the_steps_that_spent_it():
    """The window runs ``steps + 1`` calls of ``engine.step()`` (the first interval is dropped): its KV
    time totals cover all of them, so the per-step figures divide by ``steps + 1``, not ``steps``."""
    from vmkv.compare.step_worker import run_point

    cfg = {"seed": 0, "max_num_batched_tokens": 16384, "warmup_steps": 1, "steps": 4, "profile_steps": 0,
           "temperature": 0.0}
    p = run_point(_FakeEngine(), 2, 8, cfg, weight_bytes=1000, bytes_per_token=8, bw=1e9)
    assert p["num_steps"] == len(p["steps"]) == 4
    assert p["window_kv_s"]["num_calls"] == 5 and p["window_kv_s"]["alloc_s"] == pytest.approx(5e-3)
    assert p["alloc_ms_per_step"] == pytest.approx(1.0)
    assert p["prefetch_ms_per_step"] == pytest.approx(2.0)
    assert p["release_ms_per_step"] == pytest.approx(3.0)


def test_the_default_context_lens_fit_the_model():
    """``vmkv compare step --model tiny`` was refused by its own default --context-lens 1024,2048: 2048 plus
    the decode steps exceeds tiny's context of 2048 (issue 25, item 6)."""
    cfg = step_bench.plan(_args())
    assert cfg["context_lens"][0] == 1024 and 1024 < cfg["context_lens"][1] < 2048
    assert cfg["max_model_len"] <= 2048
    longest = cfg["context_lens"][1]

    def positions(c: int) -> int:       # prompt + decode steps of the largest batch, rounded up to 16
        return -(-max(c + max_tokens_for(b, c, 16384, 3 + 20 + 5) for b in (1, 64, 256)) // 16) * 16

    assert positions(longest) <= 2048 < positions(longest + 16)        # the longest that fits
    # a model with room keeps the defaults as they are
    big = step_bench.plan(_args("--model", "smollm2-135m"))
    assert big["context_lens"] == list(step_bench.DEFAULT_CONTEXT_LENS)
    # an explicit value is never changed, only refused with the fix
    with pytest.raises(ValueError, match="--context-lens 2048 needs"):
        step_bench.plan(_args("--context-lens", "2048"))


def test_cli_runs_with_the_default_context_lens(tmp_path, monkeypatch):
    """The command line itself gets past validation to its first worker (stopped there)."""
    class Started(Exception):
        pass

    def worker(cfg, *a, **k):
        raise Started(cfg)

    monkeypatch.setattr(step_bench, "_run_worker", worker)
    with pytest.raises(Started) as e:
        main(["compare", "step", *TINY, "--out", str(tmp_path), "--backends", "paged"])
    assert e.value.args[0]["backend"] == "paged"
