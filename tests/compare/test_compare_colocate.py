"""``vmkv compare colocate``: the parts that run without a GPU (the experiment itself runs on an H200;
see docs/results/h200/colocate/)."""

from __future__ import annotations

import argparse

from vmkv.compare import colocate


def test_parse_metrics_takes_unlabelled_kv_and_device_gauges():
    text = """# HELP vmkv_kv_created_bytes x
# TYPE vmkv_kv_created_bytes gauge
vmkv_kv_created_bytes 4.194304e+06
vmkv_kv_in_use_bytes 2097152.0
vmkv_device_memory_used_bytes 1.5e9
vmkv_requests_running 3.0
vmkv_ttft_seconds_bucket{le="0.1"} 2.0
vmkv_kv_broken notanumber
"""
    got = colocate.parse_metrics(text)
    assert got == {"vmkv_kv_created_bytes": 4194304.0, "vmkv_kv_in_use_bytes": 2097152.0,
                   "vmkv_device_memory_used_bytes": 1.5e9}


def test_serve_command_passes_the_caps_and_the_elastic_options_only_to_vmem():
    p = argparse.ArgumentParser()
    colocate.add_arguments(p)
    args = p.parse_args(["--backend", "vmem", "--kv-reserve", "128MiB", "--kv-shrink-grace-s", "1.5"])
    cmd = colocate._serve_cmd(args, 18500, 3 << 30)
    assert cmd[cmd.index("--kv-memory") + 1] == str(3 << 30)
    assert cmd[cmd.index("--kv-reserve") + 1] == str(128 << 20)
    assert cmd[cmd.index("--kv-shrink-grace-s") + 1] == "1.5"
    assert cmd[cmd.index("--port") + 1] == "18500"
    assert "--page-size-bytes" not in cmd                # serve's default (the driver's page) unless asked
    big = colocate._serve_cmd(p.parse_args(["--page-size-bytes", "32MiB"]), 18500, 3 << 30)
    assert big[big.index("--page-size-bytes") + 1] == str(32 << 20)
    assert big[big.index("--kv-reserve") + 1] == str(256 << 20)      # this experiment's defaults
    assert big[big.index("--kv-shrink-grace-s") + 1] == "2.0"
    paged = colocate._serve_cmd(p.parse_args(["--backend", "paged", "--page-size-bytes", "32MiB"]), 18500, 1 << 30)
    assert not {"--kv-reserve", "--kv-shrink-grace-s", "--page-size-bytes"} & set(paged)
    assert paged[paged.index("--backend") + 1] == "paged"


def test_without_a_gpu_it_says_so_and_leaves_no_empty_out_folder(tmp_path, monkeypatch, capsys):
    """It used to make ``--out`` first, then fail, leaving an empty folder (issue 25, item 6)."""
    calls = []
    monkeypatch.setattr(colocate, "gpu_memory", lambda: calls.append(1) or {})
    p = argparse.ArgumentParser()
    colocate.add_arguments(p)
    out = tmp_path / "X"
    assert colocate.run(p.parse_args(["--out", str(out)])) == 2
    assert calls, "the patched gpu_memory was not called"
    assert not out.exists()
    assert "needs one GPU" in capsys.readouterr().out


def test_the_serve_command_parses(monkeypatch):
    """Every flag the script passes is one `vmkv serve` accepts (parsed by the real parser)."""
    from vmkv.server import cli as server_cli
    p = argparse.ArgumentParser()
    colocate.add_arguments(p)
    for backend in ("vmem", "paged"):
        args = p.parse_args(["--backend", backend, "--page-size-bytes", "32MiB", "--block-size", "32"])
        cmd = colocate._serve_cmd(args, 18500, 2 << 30)
        parser = argparse.ArgumentParser()
        server_cli.add_arguments(parser)
        ns = parser.parse_args(cmd[cmd.index("serve") + 1:])
        assert ns.backend == backend and ns.memory_bytes == 2 << 30
        assert ns.page_size_bytes == (32 << 20 if backend == "vmem" else None)
        assert ns.block_size == (32 if backend == "paged" else 16)
        assert ns.kv_reserve_bytes == (256 << 20 if backend == "vmem" else 64 << 20)


def test_compare_engine_names_the_kv_reserve_flag_as_typed():
    import pytest

    from vmkv.compare import engine_bench
    p = argparse.ArgumentParser()
    engine_bench.add_arguments(p)
    args = p.parse_args(["--backends", "paged", "--kv-reserve", "1MiB"])
    with pytest.raises(ValueError, match="--kv-reserve is an option"):
        engine_bench.check_backends(args, ["paged"])


def test_bench_times_token_id_chunks_of_a_model_without_a_tokenizer():
    """The H200 co-location run at 6f38949 counted every request as failed ("no content chunk"): a
    random-weight model streams empty text.  Token-id prompts now ask for token ids back, and a chunk
    carrying them is a token arrival."""
    from types import SimpleNamespace

    from vmkv.compare import bench_cli
    args = SimpleNamespace(temperature=0.0, no_ignore_eos=False, endpoint="/v1/completions")
    req = SimpleNamespace(output_len=4, meta={"prompt": [1, 2, 3]})
    assert bench_cli._payload(req, args, "m")["return_token_ids"] is True
    text_req = SimpleNamespace(output_len=4, meta={"prompt": "the of and"})
    assert "return_token_ids" not in bench_cli._payload(text_req, args, "m")
    assert bench_cli._chunk_has_tokens({"choices": [{"text": "", "token_ids": [7]}]})
    assert bench_cli._chunk_has_tokens({"choices": [{"text": "hi"}]})
    assert not bench_cli._chunk_has_tokens({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not bench_cli._chunk_has_tokens({"choices": [], "usage": {"completion_tokens": 3}})
