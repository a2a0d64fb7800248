"""`vmkv compare kernels` on its own: the grid checks name the flag at fault (issue 25)."""

import argparse

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
