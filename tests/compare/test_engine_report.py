"""`vmkv compare engine`'s console tables fit the console (issue 25): wide tables are split into parts
that repeat scenario and backend, no cell is cut with an ellipsis, and summary.md keeps every column."""

import io

from rich.console import Console

from vmkv.compare import engine_report, report


def _latency(ms: float) -> dict:
    return {"mean": ms, "p50": ms, "p90": 1.5 * ms, "p99": 2 * ms, "n": 100}


def _run(backend: str, scale: float) -> dict:
    vmm = {"map_us": {"n": 3, "p50": 25.1, "p99": 128.0}, "unmap_us": {"n": 3, "p50": 17.2, "p99": 19.9}}
    return {
        "scenario": "offline", "backend": backend, "config": {"workload": {"request_rate": "inf"}},
        "workload_fingerprint": "f00d", "dtype": "bfloat16", "device_name": "NVIDIA H200",
        "model": {"name": "llama3-8b", "kind": "random-weights", "num_layers": 32, "num_kv_heads": 8,
                  "head_dim": 128},
        "serving": {"request_throughput": 12.345 * scale, "output_throughput": 5449.1 * scale,
                    "ttft_ms": _latency(1234.5), "tpot_ms": _latency(45.67), "itl_ms": _latency(44.21),
                    "e2e_ms": _latency(23456.0), "goodput": None},
        "memory": {"peak_allocated_bytes": 8 << 20, "peak_mapped_bytes": int(8.5 * (1 << 20)),
                   "peak_created_bytes": 8 << 20, "final_created_bytes": 8 << 20, "waste_pct_mean": 3.25,
                   "bytes_per_used_token_at_peak": 131072.0, "max_concurrent_seqs": 256, "preemptions": 0,
                   "prefix_hit_rate": 0.5, "device_used_bytes_peak": 80 << 30},
        "allocation": {"alloc_share_pct": 0.21, "alloc_ahead_share_pct": 0.123, "prefetch_share_pct": 0.456,
                       "alloc_us_per_step": {"p99": 12.3}, "vmm": vmm if backend == "vmem" else None},
    }


RESULTS = {"workload": {"kind": "offline", "num_requests": 256, "input_len": "512..2048", "output_len": "128..512",
                        "seed": 0, "burstiness": 1.0},
           "max_model_len": 2560,
           "environment": {"command": "vmkv compare engine", "git_commit": "abc1234", "git_dirty": False,
                           "torch": "2.13.0", "triton": "3.6.0", "torch_cuda": "12.8", "gpus": [], "cpu": "x86_64"}}
RUNS = [_run("paged", 1.0), _run("vmem", 1.01)]
TABLES = [(engine_report.SERVING_COLUMNS, engine_report.serving_rows(RUNS)),
          (engine_report.MEMORY_COLUMNS, engine_report.memory_rows(RUNS)),
          (engine_report.RATIO_COLUMNS, engine_report.ratio_rows(RUNS))]


def _render(width: int, tmp_path) -> str:
    out = io.StringIO()
    engine_report.render(RESULTS, RUNS, tmp_path, Console(file=out, width=width, color_system=None))
    return out.getvalue()


def test_tables_on_a_narrow_console_are_split_not_cut(tmp_path):
    text = _render(100, tmp_path)
    assert "…" not in text                                   # was "8.0M/…", "backe…" even at 160 columns
    assert max(len(line) for line in text.splitlines()) <= 100
    for columns, rows in TABLES:
        for cell in [*columns, *(c for row in rows for c in row)]:
            assert cell in text, cell                        # every header and value, whole
    assert "KV memory and allocation (1/" in text
    # summary.md keeps each table whole, one markdown table each
    md = (tmp_path / "summary.md").read_text()
    for columns, rows in TABLES:
        assert report.markdown_table(columns, rows) in md


def test_a_table_that_fits_stays_one_table(tmp_path):
    text = _render(400, tmp_path)
    assert "…" not in text and "(1/" not in text
    assert "KV memory and allocation" in text


def test_each_part_repeats_the_key_columns_and_fits():
    console = Console(file=io.StringIO(), width=90)
    parts = report.fitting_tables(console, "t", engine_report.MEMORY_COLUMNS, engine_report.memory_rows(RUNS))
    assert len(parts) > 1
    seen = []
    for part in parts:
        headers = [c.header for c in part.columns]
        assert headers[:2] == ["scenario", "backend"]
        seen += headers[2:]
        console.print(part)
    assert seen == engine_report.MEMORY_COLUMNS[2:]           # every column once, in order
    assert max(len(line) for line in console.file.getvalue().splitlines()) <= 90


def test_console_takes_columns_from_the_environment(monkeypatch):
    """``COLUMNS=260 vmkv compare engine ... | tee log`` printed 160-column tables."""
    monkeypatch.setenv("COLUMNS", "260")
    assert report.console().width == 260
    monkeypatch.delenv("COLUMNS")
    assert report.console().width == 160                     # not a terminal (pytest captures stdout)
