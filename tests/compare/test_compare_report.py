"""Report helpers: strict JSON, environment, formatting, plots."""

import json
import math

from vmkv.compare import report
from vmkv.compare.metrics import RequestRecord


def test_write_json_is_strict_and_compacts_numeric_arrays(tmp_path):
    rec = RequestRecord("r", 3, 2, 0.0, 0.1, 0.2, [0.1, 0.2])
    obj = {"nan": math.nan, "inf": -math.inf, "rec": rec, "tup": (1, 2), "s": "a [1, 2]\n", "f": print}
    path = report.write_json(tmp_path / "x.json", obj)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert '"tup": [1,2]' in text and '"token_times": [0.1,0.2]' in text
    back = json.loads(text)
    assert back["nan"] is None and back["inf"] is None and back["s"] == "a [1, 2]\n"
    assert back["rec"]["ttft"] == 0.1 and back["f"].startswith("<built-in")


def test_environment_names_versions_and_command():
    env = report.environment(["/x/vmkv/cli.py", "compare", "alloc", "--out", "a b"], seed=7)
    assert env["command"] == "vmkv compare alloc --out 'a b'"
    assert env["seed"] == 7 and env["torch"] and env["python"] and isinstance(env["gpus"], list)
    assert "git_commit" in env


def test_formatting():
    assert report.fmt_size(2 << 20) == "2M" and report.fmt_size(1536, 1) == "1.5K" and report.fmt_size(512) == "512"
    assert report.fmt_bytes(3 << 30) == "3.00 GiB" and report.fmt_num(None) == "-" and report.fmt_num(1234.5) == "1,234.50"
    md = report.markdown_table(["a", "b"], [[1, 2]])
    assert md.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_plots_write_png(tmp_path):
    p = report.plot_latency_cdfs({"paged": {"TTFT (ms)": [1, 2, 3]}, "vmem": {"TTFT (ms)": [2, 3]}},
                                 tmp_path / "cdf.png")
    q = report.plot_throughput_vs_rate({"paged": [(1.0, 10.0, 5.0), (2.0, 18.0, 7.0)]}, tmp_path / "tp.png")
    for f in (p, q):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_environment_names_the_commit_of_a_copied_tree(monkeypatch):
    """A tree copied without .git (git archive on a GPU machine) names its commit through VMKV_GIT_COMMIT."""
    from vmkv.compare.report import environment

    monkeypatch.setenv("VMKV_GIT_COMMIT", "abc1234")
    env = environment(argv=["x"])
    assert env["git_commit"] == "abc1234" and env["git_dirty"] is None
    monkeypatch.delenv("VMKV_GIT_COMMIT")
    assert environment(argv=["x"])["git_commit"] != "abc1234"
