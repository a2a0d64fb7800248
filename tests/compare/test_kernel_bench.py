"""`vmkv compare kernels` on its own: the grid checks name the flag at fault, the CPU default grid is a
short smoke run, results are written as points finish (issue 25)."""

import argparse
import json

import pytest

from vmkv.compare import kernel_bench


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    kernel_bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_flex_page_is_checked_only_against_the_flex_points():
    small = ("--contexts", "64", "--prefill-contexts", "64", "--block-sizes", "16")
    assert kernel_bench.grid_error(_args(*small, "--flex-points", "none")) is None
    # before the fix: "context 64 is not a multiple of block/page size 128", flex_attention off
    msg = kernel_bench.grid_error(_args(*small, "--flex-points", "2x64"))
    assert msg.startswith("--flex-points 2x64: context 64 is not a multiple of --flex-page 128")
    assert kernel_bench.grid_error(_args(*small, "--flex-points", "2x64", "--flex-page", "32")) is None


@pytest.mark.parametrize("argv, message", [
    (("--contexts", "64", "--flex-points", "none"), "--contexts 64 is not a multiple of --block-sizes 256"),
    (("--contexts", "256", "--prefill-contexts", "100"), "--prefill-contexts 100 is not a multiple of --block-sizes 16"),
    (("--block-sizes", "0"), "--block-sizes 0: a size in tokens must be > 0"),
    (("--flex-page", "-1"), "--flex-page -1: a size in tokens must be > 0"),
])
def test_grid_errors_name_the_flag_and_value(argv, message):
    assert kernel_bench.grid_error(_args(*argv)).startswith(message)


def test_cli_refuses_a_bad_grid_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernel_bench, "copy_bandwidth", lambda *a: pytest.fail("measured a bad grid"))
    rc = kernel_bench.main(["--device", "cpu", "--contexts", "64", "--prefill-contexts", "64", "--block-sizes",
                            "16", "--flex-points", "1x64", "--out", str(tmp_path)])
    assert rc == 2
    assert "vmkv compare kernels: --flex-points 1x64: context 64 is not a multiple of --flex-page 128" in \
        capsys.readouterr().out


# ------------------------------------------------------------------ the CPU smoke run (TRITON_INTERPRET=1)
def test_cpu_default_grid_is_a_short_smoke_run():
    """On CPU the Triton interpreter ran the CUDA grid (batches to 256, contexts to 32768) for hours, printing
    nothing; its own default is a few small points (25 s on 2 cores, measured)."""
    cpu = kernel_bench.resolve_defaults(_args("--device", "cpu"))
    points = kernel_bench.plan_points(cpu)
    assert len(points) <= 8
    assert sum(b * c for kind, b, c in (p for p in points if p[0] != "prefill")) <= 8192   # decode KV tokens
    assert max(p[1] for p in points if p[0] == "prefill") <= 512
    assert cpu.num_kv_heads * cpu.head_dim <= 256 and cpu.megacache_layers <= 2
    assert kernel_bench.grid_error(cpu) is None
    cuda = kernel_bench.resolve_defaults(_args("--device", "cuda"))
    assert (cuda.batches, cuda.contexts, cuda.num_heads, cuda.num_kv_heads) == ("1,4,16,64,128,256",
                                                                                 "512,1024,4096,8192,32768", 32, 8)
    given = kernel_bench.resolve_defaults(_args("--device", "cpu", "--batches", "8", "--num-heads", "8"))
    assert (given.batches, given.num_heads, given.contexts) == ("8", 8, "256,512")     # a given flag wins


def _row(variant: str, **kw) -> dict:
    return {"variant": variant, "ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0, "gbps": 1.0, "pct_copy_bw": 1.0,
            "ok": True, **kw}


def test_results_are_written_as_points_finish_and_an_interrupt_keeps_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernel_bench, "copy_bandwidth", lambda device, timer: {
        "buffer_bytes": 1 << 20, "ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0, "gbps": 1.0})
    on_disk = []   # (point, rows in kernel_bench.json when the point starts)

    def rows_written() -> int:
        path = tmp_path / "kernel_bench.json"
        return len(json.loads(path.read_text())["prefill"] + json.loads(path.read_text())["decode"]) \
            if path.exists() else 0

    def prefill_point(self, ctx, rows, _unused=None):
        on_disk.append((("prefill", ctx), rows_written()))
        rows.append(_row("triton_paged_bs16", batch=1, context=ctx))

    def decode_point(self, batch, ctx, rows, flex):
        on_disk.append((("decode", batch, ctx), rows_written()))
        if batch == 2:
            raise KeyboardInterrupt        # Ctrl-C in the third point
        rows.append(_row("triton_paged_bs16", batch=batch, context=ctx))

    monkeypatch.setattr(kernel_bench.Bench, "prefill_point", prefill_point)
    monkeypatch.setattr(kernel_bench.Bench, "decode_point", decode_point)
    rc = kernel_bench.main(["--device", "cpu", "--batches", "1,2", "--contexts", "256", "--prefill-contexts", "256",
                            "--flex-points", "none", "--peers", "none", "--out", str(tmp_path)])
    assert rc == 130
    assert on_disk == [(("prefill", 256), 0), (("decode", 1, 256), 1), (("decode", 2, 256), 2)]
    result = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert result["interrupted"] == "2 of 3 points finished"
    assert [(r["batch"], r["context"]) for r in result["prefill"] + result["decode"]] == [(1, 256), (1, 256)]
    assert "| 1 | 256 |" in (tmp_path / "kernel_bench.md").read_text()
    assert "interrupted (2 of 3 points finished); what was measured is in" in capsys.readouterr().out
