"""``vmkv compare colocate``: two ``vmkv serve`` processes on one GPU, driven with alternating bursts.

The elastic-memory experiment of issue 12 (kvcached's use case: several models on one GPU): two servers of
the same model share a device; each is allowed a KV cap of ``--kv-cap-fraction`` of the memory left after
both models' weights (vmem: created on demand, idle pages released after ``--kv-shrink-grace-s``), so the
caps sum to more than the device holds and only elasticity lets both serve.  ``--backend paged`` runs the
same load with two static pools that must fit together (each gets ``1 / num_servers`` of that memory, less
a margin), which is what a static block pool costs.

Bursts go to one server at a time (``A, B, A, B, ...``) with ``vmkv bench serve`` (all prompts at once,
random token ids of the model's vocabulary); between bursts the script waits ``--idle-s`` so the idle server
can give memory back.  A sampler thread reads each server's ``/metrics`` (every ``vmkv_kv_*`` gauge) and
the device memory each process holds (``nvidia-smi --query-compute-apps``) every ``--sample-s`` seconds.

Writes ``colocate.json`` (arguments, environment, every sample, every burst's client metrics and raw
records), ``colocate.md`` and ``memory.png`` under ``--out``; prints a table.  Exit status 0 when every
request of every burst completed and both servers stayed alive.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from vmkv.compare import report
from vmkv.engine.config import BACKEND_OPTION_FIELDS, CacheConfig
from vmkv.engine.option_args import add_backend_option_args, backend_option_values, option_argv
from vmkv.kvcache.registry import option_backends

__all__ = ["add_arguments", "run", "gpu_memory", "parse_metrics", "OPTION_DEFAULTS"]

#: backend options whose default here is not serve's: a 256 MiB reserve, a 2 s grace (bursts alternate fast)
OPTION_DEFAULTS = {"kv_reserve_bytes": 256 << 20, "kv_shrink_grace_s": 2.0}

COLUMNS = ["server", "backend", "KV cap", "requests", "failed", "TTFT p50 ms", "TTFT p99 ms", "out tok/s",
           "peak device MiB", "final device MiB", "peak KV created"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="vmem", choices=["vmem", "paged"])
    p.add_argument("--random-weights", default="llama3-8b", help="model shape (random weights)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--num-servers", type=int, default=2)
    p.add_argument("--kv-cap-fraction", type=float, default=0.7,
                   help="vmem: each server's KV cap as a fraction of the memory left after every server's "
                        "weights (default 0.7, so the caps oversubscribe the device)")
    p.add_argument("--weights-gib", type=float, default=None,
                   help="memory one server holds besides KV (weights, context, activations); default: "
                        "measured from the first server after start-up")
    # every backend option as serve has it (vmkv.engine.option_args), with this experiment's elastic defaults;
    # each server gets those of its backend that differ from serve's defaults
    add_backend_option_args(p.add_argument_group("backend options (vmkv serve's)"), defaults=OPTION_DEFAULTS)
    p.add_argument("--bursts", type=int, default=4)
    p.add_argument("--burst-prompts", type=int, default=96)
    p.add_argument("--input-len", default="1024..2048")
    p.add_argument("--output-len", default="128")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--idle-s", type=float, default=6.0, help="pause after each burst")
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--base-port", type=int, default=18400)
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument("--burst-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="colocate-out")


def gpu_memory() -> dict:
    """``{"total_mib", "free_mib", "per_pid_mib": {pid: MiB}}`` from nvidia-smi ({} without it)."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,memory.free",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if q.returncode != 0:
        return {}
    total, free = (float(x) for x in q.stdout.splitlines()[0].split(","))
    per_pid = {}
    for line in apps.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            per_pid[int(parts[0])] = float(parts[1])
    return {"total_mib": total, "free_mib": free, "per_pid_mib": per_pid}


def parse_metrics(text: str, prefixes: tuple[str, ...] = ("vmkv_kv_", "vmkv_device_")) -> dict[str, float]:
    """Unlabelled Prometheus samples whose name starts with one of ``prefixes``."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        if name.startswith(prefixes):
            try:
                out[name] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return out


def _serve_cmd(args, port: int, kv_bytes: int) -> list[str]:
    cmd = [sys.executable, "-m", "vmkv.cli", "serve", "--backend", args.backend, "--random-weights",
           args.random_weights, "--dtype", args.dtype, "--port", str(port), "--kv-memory", str(kv_bytes),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--max-num-batched-tokens",
           str(args.max_num_batched_tokens), "--log-level", "warning"]
    serve_defaults = CacheConfig()
    for name, value in backend_option_values(args, [n for n in BACKEND_OPTION_FIELDS
                                                    if args.backend in option_backends(n)]).items():
        if value != getattr(serve_defaults, name):
            cmd += option_argv(name, value)
    return cmd


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server at {url} exited with status {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server at {url} not healthy within {timeout_s} s")


class _Sampler(threading.Thread):
    def __init__(self, servers: list[dict], every_s: float) -> None:
        super().__init__(daemon=True)
        self.servers, self.every_s, self.samples = servers, every_s, []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        import httpx  # noqa: PLC0415

        while not self.stop.is_set():
            mem = gpu_memory()
            row = {"t_s": round(time.monotonic() - self.t0, 3), "device_free_mib": mem.get("free_mib"),
                   "servers": []}
            for s in self.servers:
                try:
                    metrics = parse_metrics(httpx.get(s["url"] + "/metrics", timeout=2).text)
                except httpx.HTTPError:
                    metrics = {}
                row["servers"].append({"device_mib": mem.get("per_pid_mib", {}).get(s["proc"].pid),
                                       "metrics": metrics})
            self.samples.append(row)
            self.stop.wait(self.every_s)


def _burst(args, server: dict, index: int, out: Path) -> dict:
    d = out / f"burst{index}-{server['name']}"
    cmd = [sys.executable, "-m", "vmkv.cli", "bench", "serve", "--base-url", server["url"],
           "--num-prompts", str(args.burst_prompts), "--request-rate", "inf", "--input-len", args.input_len,
           "--output-len", args.output_len, "--prompt-format", "tokens", "--vocab-size",
           str(args.vocab_size), "--seed", str(index), "--timeout-s", str(args.burst_timeout_s),
           "--out", str(d)]
    t0 = time.monotonic()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=args.burst_timeout_s + 60, check=False)
    try:
        data = json.loads((d / "bench.json").read_text())
    except (OSError, ValueError):
        data = {"metrics": {"completed": 0, "failed": args.burst_prompts}, "raw": []}
    return {"index": index, "server": server["name"], "wall_s": time.monotonic() - t0,
            "metrics": data["metrics"], "raw": data.get("raw", [])}


def _summary(args, servers, bursts, samples) -> list[dict]:
    rows = []
    for i, s in enumerate(servers):
        mine = [b for b in bursts if b["server"] == s["name"]]
        ttfts = [r["ttft"] * 1e3 for b in mine for r in b["raw"] if r.get("success") and r.get("ttft") is not None]
        dev = [x["servers"][i]["device_mib"] for x in samples if x["servers"][i]["device_mib"] is not None]
        created = [x["servers"][i]["metrics"].get("vmkv_kv_created_bytes") for x in samples]
        created = [c for c in created if c is not None]
        rows.append({
            "server": s["name"], "backend": args.backend, "kv_cap_bytes": s["kv_bytes"],
            "requests": sum(b["metrics"].get("completed", 0) + b["metrics"].get("failed", 0) for b in mine),
            "failed": sum(b["metrics"].get("failed", 0) for b in mine),
            "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p99_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
            "output_tok_s": float(np.mean([b["metrics"].get("output_throughput", 0.0) for b in mine])) if mine else 0.0,
            "peak_device_mib": max(dev) if dev else None, "final_device_mib": dev[-1] if dev else None,
            "peak_kv_created_bytes": max(created) if created else None,
            "alive": s["proc"].poll() is None,
        })
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if isinstance(v, float) else str(v)


def _plot(samples, servers, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 4.5))
    t = [x["t_s"] for x in samples]
    for i, s in enumerate(servers):
        ax.plot(t, [(x["servers"][i]["device_mib"] or 0) / 1024 for x in samples], label=f"{s['name']} device")
        kv = [x["servers"][i]["metrics"].get("vmkv_kv_created_bytes") for x in samples]
        if any(v is not None for v in kv):
            ax.plot(t, [(v or 0) / 2**30 for v in kv], "--", label=f"{s['name']} KV created")
    ax.set_xlabel("seconds")
    ax.set_ylabel("GiB")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Co-located servers: memory over time (bursts alternate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from vmkv.model.config import SHAPES  # noqa: PLC0415

    console = report.console()
    if args.random_weights not in SHAPES:
        console.print(f"[red]error:[/red] unknown shape {args.random_weights!r}; one of {sorted(SHAPES)}")
        return 2
    args.vocab_size = SHAPES[args.random_weights].vocab_size
    mem0 = gpu_memory()
    if not mem0:     # checked before --out is made: a run that cannot start leaves no empty folder
        console.print("[red]error:[/red] nvidia-smi is not available: this experiment needs one GPU")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers: list[dict] = []
    try:
        weights_mib = None if args.weights_gib is None else args.weights_gib * 1024
        for i in range(args.num_servers):
            port = args.base_port + i
            if i == 0 and weights_mib is None:
                kv_bytes = 1 << 30           # start the first one small to measure what a server holds
            else:
                left_mib = mem0["free_mib"] - args.num_servers * weights_mib
                share = args.kv_cap_fraction if args.backend == "vmem" else 0.95 / args.num_servers
                kv_bytes = int(left_mib * share) << 20
            proc = subprocess.Popen(_serve_cmd(args, port, kv_bytes), stdout=open(out / f"server{i}.log", "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
            s = {"name": "AB"[i] if i < 2 else str(i), "url": f"http://127.0.0.1:{port}", "proc": proc,
                 "kv_bytes": kv_bytes, "port": port}
            servers.append(s)
            _wait_healthy(s["url"], proc, args.start_timeout_s)
            if i == 0 and weights_mib is None:
                held = gpu_memory().get("per_pid_mib", {}).get(proc.pid)
                weights_mib = (held or 20 * 1024) - 1024 + 512      # minus the probe's KV, plus a margin
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
                servers.pop()
                left_mib = mem0["free_mib"] - args.num_servers * weights_mib
                share = args.kv_cap_fraction if args.backend == "vmem" else 0.95 / args.num_servers
                kv_bytes = int(left_mib * share) << 20
                proc = subprocess.Popen(_serve_cmd(args, port, kv_bytes), stdout=open(out / "server0.log", "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
                s = {**s, "proc": proc, "kv_bytes": kv_bytes}
                servers.append(s)
                _wait_healthy(s["url"], proc, args.start_timeout_s)
        sampler = _Sampler(servers, args.sample_s)
        sampler.start()
        bursts = []
        for b in range(args.bursts):
            server = servers[b % len(servers)]
            console.print(f"burst {b}: {args.burst_prompts} prompts -> server {server['name']}")
            bursts.append(_burst(args, server, b, out))
            time.sleep(args.idle_s)
        sampler.stop.set()
        sampler.join(timeout=10)
        rows = _summary(args, servers, bursts, sampler.samples)
    finally:
        for s in servers:
            if s["proc"].poll() is None:
                s["proc"].send_signal(signal.SIGTERM)
        for s in servers:
            try:
                s["proc"].wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(s["proc"].pid, signal.SIGKILL)
    peaks = [r["peak_device_mib"] or 0 for r in rows]
    ok = all(r["failed"] == 0 and r["alive"] for r in rows)
    title = (f"{args.backend}: {len(rows)} servers of {args.random_weights} on one GPU "
             f"({mem0['total_mib'] / 1024:.0f} GiB, {mem0['free_mib'] / 1024:.0f} GiB free at start); sum of "
             f"per-process peaks {sum(peaks) / 1024:.1f} GiB; sum of KV caps "
             f"{sum(s['kv_bytes'] for s in servers) / 2**30:.1f} GiB; every request completed: {ok}")
    table_rows = [[r["server"], r["backend"], f"{r['kv_cap_bytes'] / 2**30:.1f} GiB", str(r["requests"]),
                   str(r["failed"]), _fmt(r["ttft_p50_ms"]), _fmt(r["ttft_p99_ms"]), _fmt(r["output_tok_s"]),
                   _fmt(r["peak_device_mib"]), _fmt(r["final_device_mib"]),
                   "-" if r["peak_kv_created_bytes"] is None else f"{r['peak_kv_created_bytes'] / 2**30:.1f} GiB"]
                  for r in rows]
    console.print(title)
    console.print(report.make_table("co-located servers", COLUMNS, table_rows))
    env = report.environment(seed=0)
    report.write_json(out / "colocate.json", {"kind": "colocate", "environment": env, "args": vars(args),
                                              "device_at_start": mem0, "weights_mib": weights_mib,
                                              "summary": rows, "bursts": bursts, "samples": sampler.samples})
    (out / "colocate.md").write_text("\n".join(["# vmkv compare colocate", "", f"Command: `{env['command']}`", "",
                                                title, "", report.markdown_table(COLUMNS, table_rows), ""]))
    _plot(sampler.samples, servers, out / "memory.png")
    console.print(f"wrote {out}/colocate.json, colocate.md, memory.png")
    return 0 if ok else 1
