"""OpenAI-style errors: one exception type, the error body, and FastAPI exception handlers.

Every non-2xx reply has the body ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API
reference, "Error codes"), so the official ``openai`` client raises ``BadRequestError`` /
``NotFoundError`` / ``InternalServerError`` with the message intact.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vmkv.server.protocol import ErrorInfo, ErrorResponse

__all__ = ["OpenAIError", "error_response", "error_body", "install_error_handlers", "validation_message"]

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


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages.0.content"`` (drops union tags)."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif isinstance(item, str) and item.isidentifier():
            parts.append(item)
        else:  # a union member tag such as "list[int]" or "function-after[...]": stop here
            break
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
    seen: dict[str, str] = {}
    first_param = _param_of(tuple(first.get("loc", ())))
    for e in errors:
        param = _param_of(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        key = param or ""
        if key in seen:  # one message per field (a union reports one error per member)
            continue
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None and e.get("type") == "missing" \
            else f" (got {got!r})"
        seen[key] = f"{param}: {msg}{shown}" if param else f"{msg}{shown}"
    if first_param is None:  # a whole-model check whose message starts with the field it is about
        head, colon, _ = str(first.get("msg", "")).removeprefix("Value error, ").partition(":")
        first_param = head if colon and head.isidentifier() else None
    code = "invalid_type" if str(first.get("type", "")).endswith("_type") else "invalid_value"
    if first.get("type") == "missing":
        code = "missing_required_parameter"
    return "; ".join(seen.values()), first_param, code


def code_is_body_type(error: dict[str, Any]) -> bool:
    """Whether a validation error says the body as a whole is not a JSON object."""
    return error.get("type") in ("model_attributes_type", "dict_type") and len(error.get("loc", ())) <= 1


def install_error_handlers(app: FastAPI) -> None:
    """Turn every error into an OpenAI error body: validation -> 400, HTTP errors keep their status,
    :class:`OpenAIError` its own, anything else -> 500."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        ctype = request.headers.get("content-type", "")
        if errors and code_is_body_type(errors[0]) and ctype and "json" not in ctype.lower():
            # FastAPI only parses JSON bodies sent as JSON; `curl -d` sends form content
            return error_response(OpenAIError(
                415, f"Content-Type must be application/json, got {ctype.split(';')[0]!r}; send the "
                     "JSON body with the header 'Content-Type: application/json' (curl: -H)",
                code="unsupported_media_type"))
        message, param, code = validation_message(errors)
        return error_response(OpenAIError(400, message, param=param, code=code))

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's reply to a body that is not UTF-8 (or not decodable at all)
            message, code = "request body is not valid JSON (not UTF-8 text); send a JSON object", "invalid_json"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models and /docs"
        return error_response(OpenAIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                          code="internal_error"))
