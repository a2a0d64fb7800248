"""Which exceptions stop the engine, and which fail only the requests they belong to.

Failure isolation (DESIGN.md, "a bad request is that request's failure, never the server's"): an
exception while processing one request fails that request (``finish_reason="error"``, its KV freed,
the message in ``RequestOutput.error``); an exception in the batched forward that cannot be pinned
on one request fails the requests of that step's batch; the engine keeps serving everyone else.

Only an error that leaves the device unusable stops the engine (:func:`is_fatal_error`): after a
sticky CUDA error (an illegal address, a device-side assert, a launch failure, ...) every later
kernel launch and copy in the process fails, so the only honest answer is to stop and report it
(the server's ``/health`` then says so).  Torch-free: importable by the server without the model.
"""

from __future__ import annotations

import sys

__all__ = ["InvalidRequestError", "PromptTooLongError", "RequestFailedError", "FatalEngineError", "is_fatal_error",
           "check_device", "POISONING_MARKERS"]

#: substrings (matched case-insensitively) of the messages of CUDA errors that poison the context:
#: the CUDA runtime's texts as torch prints them ("CUDA error: an illegal memory access was
#: encountered") and the driver API's enum names (cuda-python, ``VMMError``)
POISONING_MARKERS = (
    "illegal memory access", "an illegal instruction", "misaligned address", "device-side assert",
    "unspecified launch failure", "hardware stack error", "invalid program counter",
    "uncorrectable ecc error", "context is destroyed", "the launch timed out",
    "cuda_error_illegal_address", "cuda_error_illegal_instruction", "cuda_error_misaligned_address",
    "cuda_error_assert", "cuda_error_launch_failed", "cuda_error_hardware_stack_error",
    "cuda_error_invalid_pc", "cuda_error_ecc_uncorrectable", "cuda_error_context_is_destroyed",
    "cuda_error_launch_timeout",
)


class InvalidRequestError(ValueError):
    """A request field the engine refuses before it takes the request, naming the field.

    Attributes:
        param: the request field at fault (an OpenAI API field name: ``"stop"``, ``"n"``,
            ``"cache_salt"``, ``"messages[2].content"``, ...), so that the server's 400 names it
            instead of guessing the prompt.
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """An exception while processing this request failed it (and only it); the engine runs on.

    Raised by iterating :class:`vmkv.server.async_engine.RequestStream`; the offline engine reports
    the same failure as a finished :class:`~vmkv.engine.outputs.RequestOutput` with ``error`` set.

    Attributes:
        request_id: the failed request.
        message: what failed (the stage and the exception), as in ``RequestOutput.error``.
        output: the request's final ``RequestOutput`` (tokens produced before the failure), or ``None``.
    """

    def __init__(self, request_id: str, message: str, output=None) -> None:
        self.request_id = request_id
        self.message = message
        self.output = output
        super().__init__(message)


class FatalEngineError(RuntimeError):
    """The engine cannot go on (e.g. a tensor-parallel worker process failed or died: the ranks can no
    longer run a step together).  Always fatal (:func:`is_fatal_error`)."""


def is_fatal_error(exc: BaseException) -> bool:
    """Whether ``exc`` must stop the engine instead of failing only the requests concerned.

    Fatal: anything that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``); a
    :class:`FatalEngineError` (or one in the chain); a ``torch.AcceleratorError`` (torch raises it for CUDA runtime errors, after which the context's
    state is unknown); and any exception whose message, or that of its ``__cause__`` /
    ``__context__`` chain, names a sticky CUDA error (:data:`POISONING_MARKERS`).  Everything else,
    including ``torch.OutOfMemoryError``, ``KVCacheFullError``, a ``VMMError`` such as
    ``CUDA_ERROR_OUT_OF_MEMORY`` and a Triton launcher's ``ValueError``, fails requests only.
    """
    if not isinstance(exc, Exception):
        return True
    torch = sys.modules.get("torch")
    accel = getattr(torch, "AcceleratorError", None) if torch is not None else None
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FatalEngineError) or (accel is not None and isinstance(e, accel)):
            return True
        text = str(e).lower()
        if any(m in text for m in POISONING_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def check_device(device) -> None:
    """After a non-fatal exception on a CUDA ``device``: synchronize, so an asynchronous kernel
    error (which surfaces at the next sync) shows up now.  Raises what the sync raises."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


class PromptTooLongError(ValueError):
    """The prompt leaves no room for an output token within ``max_model_len``.

    Attributes:
        prompt_len: tokens in the prompt (a lower bound when ``at_least``: the text was rejected
            from its length, before tokenizing).
        max_model_len: positions per sequence.
    """

    def __init__(self, prompt_len: int, max_model_len: int, *, at_least: bool = False) -> None:
        self.prompt_len = int(prompt_len)
        self.max_model_len = int(max_model_len)
        super().__init__(
            f"prompt has {'at least ' if at_least else ''}{self.prompt_len} tokens but max_model_len is "
            f"{self.max_model_len}; the "
            f"prompt must be at most {self.max_model_len - 1} tokens (shorten it or raise max_model_len)")
