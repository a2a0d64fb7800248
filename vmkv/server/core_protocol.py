"""The messages between the server's front process and its engine core process (msgspec structs).

Two ZMQ sockets over local IPC (``ipc://`` paths in a private temporary directory), one per direction,
each carrying msgpack-encoded tagged structs (:data:`ToCore`, :data:`FromCore`):

- front -> core: :class:`AddRequest` (token ids and sampling parameters: the front tokenized and
  validated the request), :class:`Abort`, :class:`FinishSequences` (stop strings the front found),
  :class:`Utility` (run a function on the engine between two steps: stats for ``/metrics``, tests),
  :class:`Shutdown`.
- core -> front: :class:`Ready` once the engine is built (what the front needs to tokenize and
  validate), :class:`StartupFailed`, then one :class:`StepOutputs` per engine step that produced
  anything (every request's new token ids in one message, not one message per token), :class:`Rejected`
  for a request the engine refused, :class:`UtilityResult`, and :class:`EngineFailed` before the core
  exits on a fatal error.

Why these libraries (``python -m vmkv.compare.ipc_bench``, one step of 256 requests; 2-core CPU machine:
``docs/results/cpu/ipc_bench.json``): msgspec encodes and decodes the step's message in 148 us, pickle of
the same structs in 592 us (4.0x), pickle of the engine's ``RequestOutput`` objects in 34 ms (230x, and
68x the bytes), and msgspec checks field types on decode.  For the transport, a ``multiprocessing.Pipe``
round trip of that message is faster than ZMQ over ``ipc://`` (24 us against 65 us), both well under 1%
of a decode step; ZMQ is used because its send never blocks the core: its I/O thread queues what the
front has not read yet (``SNDHWM`` 0), where a pipe's send blocks once the OS buffer (64 KiB, about
five such messages) is full, which would make the GPU wait on a busy front.  The
utility payloads (functions, their results, the handshake's tokenizer) are pickled: both ends are the
same program, and the socket directory is private to the user (mode 0700).
"""

from __future__ import annotations

import msgspec

from vmkv.engine.sampling_params import SamplingParams

__all__ = ["AddRequest", "Abort", "FinishSequences", "Utility", "Shutdown", "Ready", "StartupFailed",
           "CompletionDelta", "RequestDelta", "StepOutputs", "Rejected", "UtilityResult", "EngineFailed",
           "ToCore", "FromCore", "encoder", "to_core_decoder", "from_core_decoder", "encode_step_outputs"]


# ---------------------------------------------------------------------- front -> core
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue a request.  ``params.detokenize`` is False and ``params.stop`` empty: the front applies
    stop strings to the text it decodes and sends :class:`FinishSequences`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """Abort these requests and free their KV before the next step."""

    request_ids: list[str]


class FinishSequences(msgspec.Struct, tag="finish", array_like=True):
    """Finish these completions with ``"stop"`` (``(request_id, index, stop_string)``) and free their KV."""

    items: list[tuple[str, int, str]]


class Utility(msgspec.Struct, tag="utility", array_like=True):
    """Run ``fn(engine, *args)`` between two steps; ``payload`` is ``pickle.dumps((fn, args))``."""

    call_id: int
    payload: bytes


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Abort what is running, release the KV memory and exit."""


ToCore = AddRequest | Abort | FinishSequences | Utility | Shutdown


# ---------------------------------------------------------------------- core -> front
class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The engine is built; ``info`` is a pickled dict (see ``engine_core.engine_info``)."""

    info: bytes


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    """Building the engine raised; ``kind`` is ``"config"`` (a bad option: ValueError, TypeError,
    FileNotFoundError) or ``"error"``."""

    message: str
    kind: str


class CompletionDelta(msgspec.Struct, array_like=True):
    """One completion's token ids new in this step and how it ended (``None`` while running)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's news in this step."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine step produced, in one message."""

    outputs: list[RequestDelta]


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    """``engine.add_request`` refused a request (a ``ValueError``; ``param`` the field it names)."""

    request_id: str
    message: str
    param: str | None = None


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    """``payload`` is the pickled return value (``ok``) or the pickled exception."""

    call_id: int
    ok: bool
    payload: bytes


class EngineFailed(msgspec.Struct, tag="engine_failed", array_like=True):
    """The engine hit a fatal error (or kept failing); the core exits after this message."""

    message: str


FromCore = Ready | StartupFailed | StepOutputs | Rejected | UtilityResult | EngineFailed

encoder = msgspec.msgpack.Encoder()


def encode_step_outputs(deltas: list[tuple]) -> bytes:
    """The bytes of ``StepOutputs([RequestDelta(*d) for d in deltas])`` (with each completion tuple a
    :class:`CompletionDelta`), encoded from ``LLMEngine.step_deltas()``'s tuples directly: array-like
    structs are msgpack arrays, so the tuples give the same bytes without building ~257 structs per step
    (4x cheaper for 256 requests).  ``tests/server/test_server_core_protocol.py`` checks the equality."""
    return encoder.encode(("outputs", deltas))
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
