"""The shipped Azure LLM inference trace 2023 (compare/data/azure_llm_2023/) and its workloads: the files,
the loader, seeded schedules, time scaling, the max_model_len cap, and a `vmkv compare engine` run on it."""

import argparse
import gzip
import hashlib
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from vmkv.compare import bench_cli, engine_bench
from vmkv.compare.workloads import (TRACE_FILES, WorkloadSpec, _DATA_DIR, fingerprint, generate, load_trace,
                                    trace_info, trace_rows)

# rows (header left out), first and last rows, SHA-256 of the ungzipped CSV (the data README's table)
FILES = {
    "azure-conv": (19366, ("2023-11-16 18:15:46.6805900", 374, 44), ("2023-11-16 19:14:08.4025270", 197, 183),
                   "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", 3501.721937),
    "azure-code": (8819, ("2023-11-16 18:17:03.9799600", 4808, 10), ("2023-11-16 19:14:19.9280160", 549, 173),
                   "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", 3435.948056),
}


@pytest.mark.parametrize("kind", sorted(FILES))
def test_shipped_files_are_the_upstream_bytes(kind):
    rows, first, last, sha, _ = FILES[kind]
    data = gzip.decompress((_DATA_DIR / TRACE_FILES[kind]).read_bytes())
    assert hashlib.sha256(data).hexdigest() == sha
    lines = data.decode().split("\r\n")
    assert lines[0] == "TIMESTAMP,ContextTokens,GeneratedTokens" and len(lines) == rows + 1
    assert all(len(ln.split(",")) == 3 for ln in lines)        # the last line is complete too
    assert lines[1] == ",".join(map(str, first)) and lines[-1] == ",".join(map(str, last))


@pytest.mark.parametrize("kind", sorted(FILES))
def test_loader_rows(kind):
    rows, first, last, _, span = FILES[kind]
    tr = load_trace(kind)
    assert len(tr) == rows and tr.first_timestamp == first[0]
    assert (tr.context_tokens[0], tr.generated_tokens[0]) == first[1:]
    assert (tr.context_tokens[-1], tr.generated_tokens[-1]) == last[1:]
    assert tr.timestamps_s[0] == 0 and np.all(np.diff(tr.timestamps_s) >= 0)
    assert tr.timestamps_s[-1] == pytest.approx(span, abs=1e-6)
    assert tr.context_tokens.min() >= 1 and tr.generated_tokens.min() >= 1


def test_spec_takes_the_lengths_from_the_trace_and_at_most_its_rows():
    spec = WorkloadSpec(kind="azure-conv", num_requests=5, input_len="999", output_len="7", burstiness=0.3)
    assert (spec.input_len, spec.output_len, spec.burstiness) == ("trace:ContextTokens", "trace:GeneratedTokens", 1.0)
    reqs = generate(spec, 1000)
    tr = load_trace("azure-conv")
    assert [r.prompt_len for r in reqs] == tr.context_tokens[:5].tolist()
    assert [r.output_len for r in reqs] == tr.generated_tokens[:5].tolist()
    assert all(r.arrival_s == 0 for r in reqs)                 # request_rate inf: every row at t=0
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="8819 rows"):
        WorkloadSpec(kind="azure-code", num_requests=8820)
    WorkloadSpec(kind="azure-code", num_requests=8819)


def test_a_fixed_seed_gives_the_same_schedule():
    spec = WorkloadSpec(kind="azure-code", num_requests=40, request_rate=3.0, seed=5, max_model_len=2048)
    a, b = generate(spec, 512), generate(spec, 512)
    assert fingerprint(a) == fingerprint(b)
    assert [(r.prompt_token_ids, r.output_len, r.arrival_s) for r in a] == \
           [(r.prompt_token_ids, r.output_len, r.arrival_s) for r in b]
    c = generate(replace(spec, seed=6), 512)                  # other tokens, the same rows and arrivals
    assert fingerprint(c) != fingerprint(a)
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in c] == [(r.prompt_len, r.output_len, r.arrival_s) for r in a]
    # the rate changes only the arrivals
    d = generate(replace(spec, request_rate=math.inf), 512)
    assert [r.prompt_token_ids for r in d] == [r.prompt_token_ids for r in a]
    # the spec survives its JSON form (the worker and the served path regenerate from it)
    back = WorkloadSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec and fingerprint(generate(back, 512)) == fingerprint(a)


@pytest.mark.parametrize("kind,rate", [("azure-conv", 24.0), ("azure-conv", 1.5), ("azure-code", 10.0)])
def test_time_scaling_gives_the_requested_mean_rate(kind, rate):
    n = 2000
    _, _, arr, _ = trace_rows(WorkloadSpec(kind=kind, num_requests=n, request_rate=rate))
    raw = load_trace(kind).timestamps_s[:n]
    assert arr[0] == 0 and np.all(np.diff(arr) >= 0)
    assert (n - 1) / arr[-1] == pytest.approx(rate, rel=1e-9)   # mean rate of the rows = the requested rate
    scale = arr[-1] / raw[-1]
    np.testing.assert_allclose(arr, raw * scale, rtol=1e-12, atol=1e-12)   # one factor: the bursts are kept
    info = trace_info(WorkloadSpec(kind=kind, num_requests=n, request_rate=rate))
    assert info["time_scale"] == pytest.approx(scale, rel=1e-5)
    assert info["trace_mean_rate"] == pytest.approx((n - 1) / raw[-1], rel=1e-5)


@pytest.mark.parametrize("kind,cap,clipped", [("azure-code", 2048, 3367), ("azure-conv", 2048, 2838),
                                              ("azure-conv", 8192, 1), ("azure-conv", 16384, 0)])
def test_rows_are_capped_to_max_model_len(kind, cap, clipped):
    tr = load_trace(kind)
    spec = WorkloadSpec(kind=kind, num_requests=len(tr), max_model_len=cap)
    ctx, gen, _, n_clipped = trace_rows(spec)
    assert n_clipped == clipped == trace_info(spec)["rows_clipped"]
    assert np.all(ctx + gen <= cap) and ctx.min() >= 1 and gen.min() >= 1
    fits = tr.context_tokens + tr.generated_tokens <= cap
    assert np.array_equal(ctx[fits], tr.context_tokens[fits]) and np.array_equal(gen[fits], tr.generated_tokens[fits])
    # a clipped row keeps its output and loses prompt tokens: prompt + output == max_model_len
    assert np.array_equal(gen[~fits], np.minimum(tr.generated_tokens[~fits], cap - 1))
    assert np.all(ctx[~fits] + gen[~fits] == cap)
    ctx0, gen0, _, _ = trace_rows(replace(spec, max_model_len=0))      # 0: no cap
    assert np.array_equal(ctx0, tr.context_tokens) and np.array_equal(gen0, tr.generated_tokens)


def test_an_output_longer_than_max_model_len_keeps_one_prompt_token():
    spec = WorkloadSpec(kind="azure-conv", num_requests=3, max_model_len=16)   # outputs 44, 109, 125
    ctx, gen, _, clipped = trace_rows(spec)
    assert ctx.tolist() == [1, 1, 1] and gen.tolist() == [15, 15, 15] and clipped == 3


def _engine_args(**kw):
    p = argparse.ArgumentParser()
    engine_bench.add_arguments(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_compare_plan_caps_the_trace_at_the_model_context():
    p = engine_bench.plan(_engine_args(workload="azure-conv", model="tiny", num_requests=19366))
    assert p.max_model_len == 2048 and p.base_spec.max_model_len == 2048      # tiny's context
    assert "2838 rows clipped" in p.note
    p = engine_bench.plan(_engine_args(trace="azure-code", model="tiny", num_requests=8, max_model_len=1024))
    assert p.max_model_len == 1024
    cfg = engine_bench.worker_config(_engine_args(workload="azure-code", model="tiny", num_requests=8),
                                     "paged", "4", engine_bench._spec(_engine_args(workload="azure-code",
                                                                                   model="tiny", num_requests=8), 4.0),
                                     1024)
    spec = WorkloadSpec.from_dict(cfg["workload"])
    assert spec.max_model_len == 1024 and cfg["workload"]["trace"]["rows_clipped"] == 4
    assert all(r.prompt_len + r.output_len <= 1024 for r in generate(spec, 512))
    # short rows: the default is the longest row rounded up, as for the synthetic workloads
    p = engine_bench.plan(_engine_args(workload="azure-conv", model="llama3-8b", num_requests=2))
    assert p.max_model_len == 512 and "0 rows clipped" in p.note


def test_bench_serve_sends_the_compare_engine_trace_requests():
    args = argparse.Namespace(num_prompts=12, input_len="256", output_len="128", request_rate=6.0, burstiness=1.0,
                              seed=3, prompt_format="tokens", vocab_size=512, workload="azure-code",
                              max_model_len=2048)
    sent = bench_cli.build_requests(args)
    want = generate(WorkloadSpec(kind="azure-code", num_requests=12, request_rate=6.0, seed=3, max_model_len=2048), 512)
    assert [r.meta["prompt"] for r in sent] == [r.prompt_token_ids for r in want]
    assert [(r.output_len, r.arrival_s) for r in sent] == [(r.output_len, r.arrival_s) for r in want]
    text = bench_cli.build_requests(argparse.Namespace(**{**vars(args), "prompt_format": "text"}))
    assert [r.meta["prompt_len"] for r in text] == [r.prompt_len for r in want]


@pytest.mark.slow
def test_compare_engine_replays_the_code_trace(tmp_path):
    from vmkv.cli import main

    out = tmp_path / "res"
    rc = main(["compare", "engine", "--workload", "azure-code", "--model", "tiny", "--device", "cpu",
               "--num-requests", "8", "--request-rate", "8", "--backends", "paged", "--warmup-requests", "1",
               "--torch-threads", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["max_model_len"] == 2048 and res["workload"]["kind"] == "azure-code"
    info = res["workload"]["trace"]
    assert info["rows_used"] == 8 and info["rows_clipped"] == 4 and info["rows_in_file"] == 8819
    (run,) = res["runs"]
    assert run["config"]["workload"]["trace"]["time_scale"] == pytest.approx(info["trace_mean_rate"] / 8, rel=1e-5)
    want = generate(WorkloadSpec(kind="azure-code", num_requests=8, request_rate=8.0, max_model_len=2048), 512)
    s = run["serving"]
    assert s["completed"] == 8 and s["failed"] == 0 and run["output_len_mismatches"] == 0
    assert s["total_input_tokens"] == sum(r.prompt_len for r in want)
    assert s["total_output_tokens"] == sum(r.output_len for r in want)
    assert run["workload_fingerprint"] == fingerprint(want)


def test_bench_serve_caps_the_trace_at_the_served_max_model_len(tmp_path):
    """``vmkv bench serve --workload azure-code`` without ``--max-model-len`` caps the rows at the card's
    ``max_model_len`` (vmkv serve gives it) and sends the requests ``--max-model-len`` would have given."""
    from test_bench_serve import _args, _card_server

    seen = []
    args = _args(prompt_format="tokens", workload="azure-code", out=tmp_path)
    args.model = None
    card = {"id": "random-tiny", "object": "model", "max_model_len": 256, "vocab_size": 512}
    assert bench_cli.run(args, transport=_card_server(seen, card)) == 0
    want = bench_cli.build_requests(_args(prompt_format="tokens", workload="azure-code", vocab_size=512,
                                          max_model_len=256))
    assert sorted((tuple(b["prompt"]), b["max_tokens"]) for b in seen) == \
           sorted((tuple(r.meta["prompt"]), r.output_len) for r in want)
    assert all(len(b["prompt"]) + b["max_tokens"] <= 256 for b in seen)
    assert json.loads((tmp_path / "bench.json").read_text())["args"]["max_model_len"] == 256
