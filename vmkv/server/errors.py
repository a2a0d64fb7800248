"""OpenAI-style errors: one exception type, the error body, and FastAPI exception handlers.

Every non-2xx reply has the body ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API
reference, "Error codes"), so the official ``openai`` client raises ``BadRequestError`` /
``NotFoundError`` / ``InternalServerError`` with the message intact.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vmkv.server.protocol import ErrorInfo, ErrorResponse

__all__ = ["OpenAIError", "error_response", "error_body", "install_error_handlers", "validation_message",
           "body_parse_message"]

logger = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error reply.

    Args:
        status: HTTP status (400 bad request, 404 unknown model, 503 engine down, ...).
        message: human-readable; names the value, the allowed range and the fix.
        param: the request field at fault (dotted path), or None.
        code: machine-readable reason, e.g. ``invalid_value``, ``context_length_exceeded``.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _STATUS_TYPES.get(self.status, "invalid_request_error" if status < 500
                                               else "internal_error")


def error_body(err: OpenAIError) -> dict[str, Any]:
    """The JSON body of ``err``."""
    return ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, param=err.param,
                                         code=err.code)).model_dump()


def error_response(err: OpenAIError, headers: Mapping[str, str] | None = None) -> Response:
    """``err`` as a JSON reply.  Rendered ASCII-only (``\\uXXXX`` escapes), so no text a client sent,
    quoted in a message, can make the error reply itself fail to encode."""
    return Response(json.dumps(error_body(err)), status_code=err.status, headers=headers,
                    media_type="application/json")


#: longest rendering of a rejected value quoted in a message
_MAX_SHOWN_CHARS = 80


def _shown(value: Any) -> str:
    """A rejected value as JSON (``null``, ``true``, ``"text"``), cut to :data:`_MAX_SHOWN_CHARS`."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _MAX_SHOWN_CHARS else text[:_MAX_SHOWN_CHARS - 3] + "..."


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages.0.content"`` (drops union tags)."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif isinstance(item, str) and item.isidentifier():
            parts.append(item)
        else:  # a union member tag such as "list[TextContentPart]" or "function-after[...]": not a field
            continue
    # pydantic tags union members by type name ("str", "int", ...): those are not fields
    while parts and parts[-1] in ("str", "int", "float", "bool", "list", "dict", "none"):
        parts.pop()
    return ".".join(parts) or None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    """Summarise pydantic/FastAPI validation errors as ``(message, param, code)``."""
    if not errors:
        return "invalid request", None, "invalid_value"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"request body is not valid JSON ({detail}); send a JSON object", None, "invalid_json"
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return "request body is missing; send a JSON object", None, "invalid_json"
    if code_is_body_type(first):
        return "request body must be a JSON object", None, "invalid_type"
    # one message per field: a union reports one error per member, and the member whose type matched
    # (its error is about the value) says what is wrong, not "Input should be a valid string"
    by_param: dict[str, dict[str, Any]] = {}
    for e in errors:
        key = _param_of(tuple(e.get("loc", ()))) or ""
        if key not in by_param or _is_type_error(by_param[key]) and not _is_type_error(e):
            by_param[key] = e
    # a union member that matched the value's shape reports deeper (``messages.0.content.0.text``)
    # than the members that did not (``messages.0.content``): the deeper error is the one that applies
    for key in [k for k in by_param if any(o.startswith(f"{k}.") for o in by_param if k)]:
        del by_param[key]
    first = next(iter(by_param.values()))
    seen: dict[str, str] = {}
    first_param = _param_of(tuple(first.get("loc", ())))
    for key, e in by_param.items():
        param = key or None
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        got = e.get("input")
        # the value is added here, once: validators' messages name the rule, not the value
        # a dict or list is shown too, cut to _MAX_SHOWN_CHARS (a rejected logit_bias or tools value is
        # the request's own; the message names the field, the value and the rule)
        quiet = got is None and (e.get("type") == "missing" or "null" in msg)
        shown = "" if quiet else f" (got {_shown(got)})"
        seen[key] = f"{param}: {msg}{shown}" if param else f"{msg}{shown}"
    if first_param is None:  # a whole-model check whose message starts with the field it is about
        head, colon, _ = str(first.get("msg", "")).removeprefix("Value error, ").partition(":")
        first_param = head if colon and head.isidentifier() else None
    code = "invalid_type" if _is_type_error(first) else "invalid_value"
    if first.get("type") == "missing":
        code = "missing_required_parameter"
    return "; ".join(seen.values()), first_param, code


def _is_type_error(error: dict[str, Any]) -> bool:
    return str(error.get("type", "")).endswith("_type")


def body_parse_message(cause: BaseException | None) -> str:
    """Why a request body could not be parsed as JSON, from the exception ``json.loads`` raised."""
    if isinstance(cause, RecursionError):
        return ("request body could not be parsed: its JSON is nested too deeply (arrays/objects inside "
                "each other about a thousand levels or more); send a flatter JSON object")
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not valid JSON (not UTF-8 text); send a JSON object in UTF-8"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
        return (f"request body could not be parsed: it has an integer with more than {limit} digits; "
                "send numbers within their fields' ranges")
    return "request body could not be parsed as JSON; send a JSON object"


def code_is_body_type(error: dict[str, Any]) -> bool:
    """Whether a validation error says the body as a whole is not a JSON object."""
    return error.get("type") in ("model_attributes_type", "dict_type") and len(error.get("loc", ())) <= 1


def install_error_handlers(app: FastAPI) -> None:
    """Turn every error into an OpenAI error body: validation -> 400, HTTP errors keep their status,
    :class:`OpenAIError` its own, anything else -> 500."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        ctype = request.headers.get("content-type", "")
        if errors and code_is_body_type(errors[0]) and "json" not in ctype.lower():
            # FastAPI parses a body as JSON only when it is declared JSON (a body without a
            # Content-Type is not parsed: a browser can send one cross-site without a CORS preflight);
            # `curl -d` alone sends form content
            got = f"got {ctype.split(';')[0]!r}" if ctype else "the header is missing"
            return error_response(OpenAIError(
                415, f"Content-Type must be application/json, {got}; send the JSON body with the header "
                     "'Content-Type: application/json' (curl: -H)",
                code="unsupported_media_type"))
        message, param, code = validation_message(errors)
        return error_response(OpenAIError(400, message, param=param, code=code))

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's reply to every json.loads failure other than a syntax error; the cause says which
            message, code = body_parse_message(exc.__cause__), "invalid_json"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models and /docs"
        return error_response(OpenAIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                          code="internal_error"))
