"""A ``vmkv serve`` child process for ``vmkv compare serve``: its command line from an engine worker's
configuration, start on a free port, ``GET /health`` until it serves, the CPU time of its process tree
from ``/proc``, and a SIGTERM stop that checks every process of the tree has exited.

The command line is built from the same configuration dict that :mod:`vmkv.compare.engine_worker` gets
(:func:`vmkv.compare.engine_bench.worker_config`), so the served engine and the in-process one run with
the same knobs: :func:`serve_argv` maps every knob to ``vmkv serve``'s flag for it, a backend option
through its options field (:func:`vmkv.engine.option_args.option_argv`); a test parses the result with
``serve``'s own parser and compares.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from vmkv.engine.config import BACKEND_OPTION_FIELDS
from vmkv.engine.option_args import option_argv

__all__ = ["serve_argv", "free_port", "ServeProcess", "ProcessTreeSampler", "tree_cpu", "window_cpu",
           "ServerStartError"]

#: ``LLMEngine.from_args`` knob -> ``vmkv serve`` flag (values as strings; booleans below); the backend
#: options' flags are not listed: they come from their options fields (``option_argv``)
_VALUE_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
                "max_model_len": "--max-model-len", "seed": "--seed", "random_weights": "--random-weights",
                "tensor_parallel_size": "--tensor-parallel-size", "memory_bytes": "--kv-memory",
                "gpu_memory_utilization": "--gpu-memory-utilization", "kv_reservation": "--kv-reservation"}
#: knob -> (flag when True, flag when False); None: a store_true flag, nothing to pass for False
_BOOL_FLAGS = {"enforce_eager": ("--enforce-eager", None),
               "async_scheduling": ("--async-scheduling", "--no-async-scheduling")}


def serve_argv(cfg: dict, port: int, host: str = "127.0.0.1", graceful_timeout_s: float = 10.0,
               log_level: str = "warning") -> list[str]:
    """``vmkv serve`` arguments (after ``serve``) of the engine worker configuration ``cfg``.

    Args:
        cfg: :func:`vmkv.compare.engine_bench.worker_config`'s dict (``backend``, ``model``, ``device``,
            ``dtype``, ``knobs``, ``torch_threads``).
        port: TCP port to listen on.
    Raises:
        ValueError: a knob this function has no flag for (a new knob must be mapped here, or the two
            paths would run different engines).
    """
    argv = ["--backend", cfg.get("kv_backend", cfg["backend"]), "--host", host, "--port", str(port), "--log-level", log_level,
            "--graceful-timeout", f"{graceful_timeout_s:g}"]
    for key, flag in (("model", "--model"), ("device", "--device"), ("dtype", "--dtype"),
                      ("torch_threads", "--threads")):
        if cfg.get(key) is not None:
            argv += [flag, str(cfg[key])]
    for knob, value in cfg.get("knobs", {}).items():
        if knob in BACKEND_OPTION_FIELDS:
            argv += option_argv(knob, value)
        elif knob in _BOOL_FLAGS:
            on, off = _BOOL_FLAGS[knob]
            flag = on if value else off
            if flag:
                argv.append(flag)
        elif knob == "cuda_graph_sizes":
            if value:
                argv += ["--cuda-graph-sizes", *(str(int(b)) for b in value)]
        elif knob in _VALUE_FLAGS:
            if value is not None:
                argv += [_VALUE_FLAGS[knob], str(value)]
        else:
            raise ValueError(f"engine knob {knob!r} has no vmkv serve flag in vmkv.compare.serve_proc; map it "
                             "there so the served engine gets it too")
    return argv


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or did not answer ``/health`` with 200 in time (the message has its log's tail)."""


# ------------------------------------------------------------------------------------------ /proc
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, str, float, int, str] | None:
    """``(ppid, comm, utime + stime seconds, start time in clock ticks, state)`` of ``pid`` from
    ``/proc/<pid>/stat``; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may hold spaces and parentheses: the fields after it start past the last ')'
    lpar, rpar = text.index("("), text.rindex(")")
    f = text[rpar + 2:].split()
    # f[0] is field 3 (state); ppid is field 4, utime 14, stime 15, starttime 22
    return int(f[1]), text[lpar + 1:rpar], (int(f[11]) + int(f[12])) / _CLK_TCK, int(f[19]), f[0]


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def tree_cpu(root_pid: int) -> dict[int, dict]:
    """CPU seconds (user + system) of ``root_pid`` and every descendant alive now, from ``/proc``:
    ``{pid: {"ppid", "comm", "cmdline", "cpu_s", "start_ticks"}}``; ``{}`` where ``/proc`` is not readable or the
    root is gone.  (Threads count in their process; a reaped child's time is not in the tree.)"""
    stats = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            stats[pid] = st
    if root_pid not in stats:
        return {}
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        ppid, comm, cpu_s, start_ticks, _ = stats[pid]
        out[pid] = {"ppid": ppid, "comm": comm, "cmdline": _cmdline(pid)[:200], "cpu_s": cpu_s,
                    "start_ticks": start_ticks}
        todo += children.get(pid, [])
    return out


class ProcessTreeSampler(threading.Thread):
    """Reads :func:`tree_cpu` of a process every ``every_s`` seconds: ``samples`` is a list of
    ``(time.perf_counter(), {pid: cpu_s})``; ``names`` keeps each pid's comm and command line;
    ``on_tree`` (optional) gets every :func:`tree_cpu` result (:meth:`ServeProcess.remember`)."""

    def __init__(self, root_pid: int, every_s: float = 0.5, on_tree=None) -> None:
        super().__init__(daemon=True, name="serve-cpu-sampler")
        self.root_pid, self.every_s, self.on_tree = root_pid, every_s, on_tree
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.names: dict[int, dict] = {}
        self._halt = threading.Event()

    def sample(self) -> None:
        tree = tree_cpu(self.root_pid)
        t = time.perf_counter()
        if self.on_tree is not None:
            self.on_tree(tree)
        for pid, info in tree.items():
            self.names.setdefault(pid, {k: info[k] for k in ("ppid", "comm", "cmdline")})
        self.samples.append((t, {pid: info["cpu_s"] for pid, info in tree.items()}))

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.every_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def window_cpu(samples: list[tuple[float, dict[int, float]]], names: dict[int, dict], t0: float,
               t1: float) -> dict:
    """CPU use of a process tree over ``[t0, t1]`` (``time.perf_counter()``) from
    :class:`ProcessTreeSampler` samples: the last sample at or before ``t0`` (else the first) to the
    first at or after ``t1`` (else the last).

    Returns:
        ``{"wall_s", "cpu_s", "cores", "processes": [{"pid", "comm", "role", "cpu_s", "cores"}]}``
        (``cores`` = CPU seconds / wall seconds; a process born in the window counts from 0), or
        ``{"wall_s": 0, ...}`` with an empty list when fewer than two samples cover it.
    """
    if len(samples) < 2:
        return {"wall_s": 0.0, "cpu_s": 0.0, "cores": None, "processes": []}
    before = [s for s in samples if s[0] <= t0]
    after = [s for s in samples if s[0] >= t1]
    a = before[-1] if before else samples[0]
    b = after[0] if after else samples[-1]
    wall = b[0] - a[0]
    if wall <= 0:
        return {"wall_s": 0.0, "cpu_s": 0.0, "cores": None, "processes": []}
    procs = []
    for pid, cpu in b[1].items():
        d = cpu - a[1].get(pid, 0.0)
        info = names.get(pid, {})
        procs.append({"pid": pid, "comm": info.get("comm", "?"), "role": _role(pid, names),
                      "cmdline": info.get("cmdline", ""), "cpu_s": d, "cores": d / wall})
    procs.sort(key=lambda p: -p["cpu_s"])
    total = sum(p["cpu_s"] for p in procs)
    return {"wall_s": wall, "cpu_s": total, "cores": total / wall, "processes": procs}


def _role(pid: int, names: dict[int, dict]) -> str:
    """``"server"`` for the root (the HTTP process), else ``"child"`` / ``"grandchild"`` ... by depth."""
    depth, p = 0, pid
    while p in names and names[p]["ppid"] in names:
        p = names[p]["ppid"]
        depth += 1
    return "server" if depth == 0 else ("child" if depth == 1 else f"descendant-{depth}")


# ------------------------------------------------------------------------------------------ the process
class ServeProcess:
    """``python -m vmkv.cli serve ARGV`` in its own session (process group), output in ``log_path``.

    Args:
        argv: ``serve``'s arguments (:func:`serve_argv`).
        port: the port in ``argv``.
        log_path: stdout and stderr of the server.
        threads: ``OMP_NUM_THREADS`` of the server (``None``: inherited).
    """

    def __init__(self, argv: list[str], port: int, log_path: Path, threads: int | None = None) -> None:
        self.argv, self.port, self.log_path = argv, port, Path(log_path)
        self.base_url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.cmd = [sys.executable, "-m", "vmkv.cli", "serve", *argv]
        self.t_start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.pid = self.proc.pid
        #: every process of the server's tree seen so far: pid -> start time (clock ticks), so a pid
        #: reused by another process later is not taken for one of ours
        self.seen: dict[int, int] = {}
        self.remember()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``GET /health`` until it answers 200; returns the seconds since the start.

        Raises:
            ServerStartError: the process exited, or no 200 within ``timeout_s``.
        """
        import httpx  # noqa: PLC0415

        deadline = time.perf_counter() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"vmkv serve exited with status {self.proc.returncode} during start-up:\n"
                                       + self.log_tail())
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.remember()
                    return time.perf_counter() - self.t_start
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                raise ServerStartError(f"vmkv serve did not answer /health with 200 within {timeout_s:g} s:\n"
                                       + self.log_tail())
            time.sleep(0.25)

    def remember(self, tree: dict[int, dict] | None = None) -> None:
        """Add the processes of the tree now (or of ``tree``, a :func:`tree_cpu` result) to ``seen``."""
        for pid, info in (tree_cpu(self.pid) if tree is None else tree).items():
            self.seen.setdefault(pid, info["start_ticks"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float) -> dict:
        """SIGTERM, wait up to ``timeout_s`` for the exit, then check that no process of the tree seen
        (``seen``: the server and its children, e.g. the engine core) is still alive; SIGKILL the
        process group past the timeout.

        Returns:
            ``{"signal", "exit_code", "stop_s", "killed", "orphans": [pid, ...], "ok"}``; ``ok``: exited
            by itself within the timeout with status 0 and no orphan.
        """
        self.remember()
        t0 = time.perf_counter()
        already = self.proc.poll()
        killed = False
        if already is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                killed = True
                self._kill_group()
                self.proc.wait(timeout=30)
        stop_s = time.perf_counter() - t0
        # children get a moment to follow their parent out
        orphans = self._alive({pid: t for pid, t in self.seen.items() if pid != self.pid})
        deadline = time.perf_counter() + 5
        while orphans and time.perf_counter() < deadline:
            time.sleep(0.1)
            orphans = self._alive({pid: self.seen[pid] for pid in orphans})
        if orphans:
            self._kill_group()
        self._log.close()
        code = self.proc.returncode
        return {"signal": None if already is not None else "SIGTERM", "exit_code": code,
                "exited_before_stop": already is not None, "stop_s": stop_s, "killed": killed,
                "orphans": sorted(orphans), "ok": already is None and not killed and code == 0 and not orphans}

    def _kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)      # the server's own session, started by us
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _alive(pids: dict[int, int]) -> set[int]:
        """The pids of ``pids`` (pid -> start ticks) still running as the same process (not a zombie)."""
        alive = set()
        for pid, start_ticks in pids.items():
            st = _stat(pid)
            if st is not None and st[3] == start_ticks and st[4] not in ("Z", "X"):
                alive.add(pid)
        return alive
