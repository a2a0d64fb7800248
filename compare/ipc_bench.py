"""How to carry one engine step's outputs from the engine core process to the HTTP front: encodings and
transports measured side by side (issue 22: "choose by measurement and say why").

    python -m vmkv.compare.ipc_bench [--num-requests 256] [--repeats 2000] [--out DIR]

A step's message holds, per running request, its id and the token id(s) it sampled (a decode step:
one token each).  Measured, in one process run, as the median over ``--repeats`` messages:

- encoding: encode + decode time per message for msgspec (msgpack, typed structs: the server's
  :mod:`vmkv.server.core_protocol`), pickle of the same structs, and pickle of the engine's
  ``RequestOutput`` objects (what a naive port would send);
- transport: one message's round trip between two processes (a child echoes it) over a ZMQ PUSH/PULL
  pair on ``ipc://`` and over a ``multiprocessing.Pipe``.

Writes ``ipc_bench.json`` (raw samples' medians and the environment) and prints a table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["main", "step_message"]


def step_message(num_requests: int, tokens_per_request: int = 1) -> Any:
    """A decode step's :class:`~vmkv.server.core_protocol.StepOutputs` of ``num_requests`` requests."""
    from vmkv.server import core_protocol as proto

    return proto.StepOutputs([
        proto.RequestDelta(f"cmpl-{i:032x}-0", [proto.CompletionDelta(0, [1000 + i + k for k in range(tokens_per_request)])],
                           False, 0, None)
        for i in range(num_requests)])


def _request_outputs(num_requests: int) -> list[Any]:
    from vmkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    return [RequestOutput(f"cmpl-{i:032x}-0", None, list(range(512)),
                          [CompletionOutput(0, "", list(range(200)), delta_token_ids=[1000 + i])], False, 0,
                          RequestMetrics(0.0, 0.1, 0.2, 0.3, None, [0.1] * 200))
            for i in range(num_requests)]


def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _zmq_echo(addr_in: str, addr_out: str, n: int) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    for _ in range(n):
        push.send(pull.recv(copy=False), copy=False)
    push.close(linger=1000)
    pull.close()
    ctx.term()


def _pipe_echo(conn: Any, n: int) -> None:
    for _ in range(n):
        conn.send_bytes(conn.recv_bytes())
    conn.close()


def _round_trip_us(send: Callable[[bytes], Any], recv: Callable[[], Any], payload: bytes, repeats: int) -> float:
    """Median round trip of ``payload`` to an echoing child (50 untimed first)."""
    for _ in range(50):
        send(payload)
        recv()
    return _median_us(lambda: (send(payload), recv()), repeats)


def _round_trips(payload: bytes, repeats: int) -> dict[str, float]:
    import zmq

    mp = multiprocessing.get_context("spawn")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        a, b = f"ipc://{d}/a", f"ipc://{d}/b"
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(a)
        pull.bind(b)
        child = mp.Process(target=_zmq_echo, args=(a, b, repeats + 50))
        child.start()
        out["zmq_ipc_round_trip_us"] = _round_trip_us(push.send, pull.recv, payload, repeats)
        child.join(30)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    parent, child_end = mp.Pipe()
    child = mp.Process(target=_pipe_echo, args=(child_end, repeats + 50))
    child.start()
    out["mp_pipe_round_trip_us"] = _round_trip_us(parent.send_bytes, parent.recv_bytes, payload, repeats)
    child.join(30)
    return out


def main(argv: list[str] | None = None) -> int:
    from vmkv.compare import report
    from vmkv.server import core_protocol as proto

    p = argparse.ArgumentParser(prog="python -m vmkv.compare.ipc_bench", description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256, help="requests in the step's message")
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--out", default=None, help="directory for ipc_bench.json")
    args = p.parse_args(argv)

    msg = step_message(args.num_requests)
    packed = proto.encoder.encode(msg)
    pickled = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    outputs = _request_outputs(args.num_requests)
    pickled_outputs = pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL)
    r = args.repeats
    result: dict[str, Any] = {
        "num_requests": args.num_requests,
        "bytes": {"msgspec": len(packed), "pickle_structs": len(pickled), "pickle_request_outputs": len(pickled_outputs)},
        "encode_decode_us": {
            "msgspec": _median_us(lambda: proto.from_core_decoder.decode(proto.encoder.encode(msg)), r),
            "pickle_structs": _median_us(lambda: pickle.loads(pickle.dumps(msg, protocol=5)), r),
            "pickle_request_outputs": _median_us(lambda: pickle.loads(pickle.dumps(outputs, protocol=5)), r),
        },
    }
    result["transport"] = _round_trips(packed, r)
    result["environment"] = report.environment()
    enc = result["encode_decode_us"]
    print(f"one step of {args.num_requests} requests' outputs")
    print(f"{'encoding':<26}{'bytes':>10}{'encode+decode us':>20}{'vs msgspec':>12}")
    for k in ("msgspec", "pickle_structs", "pickle_request_outputs"):
        print(f"{k:<26}{result['bytes'][k]:>10}{enc[k]:>20.1f}{enc[k] / enc['msgspec']:>12.2f}")
    t = result["transport"]
    print(f"round trip of the msgspec message: zmq ipc {t['zmq_ipc_round_trip_us']:.1f} us, "
          f"multiprocessing.Pipe {t['mp_pipe_round_trip_us']:.1f} us")
    if args.out:
        report.write_json(Path(args.out) / "ipc_bench.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
