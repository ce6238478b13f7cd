"""Typed API errors and their one mapping to OpenAI-format HTTP responses.

Raised by the request handlers (serving.py, serving_chat.py, serving_completion.py, prompts.py);
installed on the app by `install_error_handlers` (app.py). The body of every error is
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from appliance.logging import get_logger

logger = get_logger(__name__)


class APIError(Exception):
    """An error the client sees; subclasses fix the HTTP status and the OpenAI error type."""

    status = 500
    type = "server_error"
    headers: dict[str, str] = {}  # extra HTTP headers of the response

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code  # OpenAI's machine-readable code: a string, or None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param, "context_length_exceeded")


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.", "model", "model_not_found")


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"
    headers = {"WWW-Authenticate": "Bearer"}

    def __init__(self, message: str):
        super().__init__(message, None, "invalid_api_key")


class RequestTimeout(APIError):
    """The request ran past the server's per-request deadline (`--request-timeout`)."""

    status = 408
    type = "timeout_error"
    # the OpenAI SDKs retry a 408 twice by default: each retry would run the same generation into
    # the same deadline, so the client is told not to (the header they honour)
    headers = {"x-should-retry": "false"}

    def __init__(self, timeout_s: float, started: bool = True):
        # not started: the time went into fetching its images or building its prompt
        advice = (
            "Ask for fewer tokens or retry later."
            if started
            else (
                "It was still fetching its images or building its prompt: send smaller or "
                "fewer images, or retry later."
            )
        )
        super().__init__(
            f"The request did not finish within the server's {timeout_s:g} s limit and was "
            f"aborted. {advice}",
            None,
            "request_timeout",
        )


class RequestTooLarge(APIError):
    status = 413
    type = "invalid_request_error"

    def __init__(self, max_bytes: int):
        super().__init__(
            f"The request body is larger than the {max_bytes} bytes this server accepts.",
            None,
            "request_too_large",
        )


class TooManyRequests(APIError):
    status = 429
    type = "rate_limit_error"
    headers = {"Retry-After": "1"}  # seconds; the queue drains at the step rate

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param, "rate_limit_exceeded")


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable_error"

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        if retry_after_s is not None:  # a server still loading: when a retry may find it up
            self.headers = {"Retry-After": str(retry_after_s)}


class EngineFailed(APIError):
    status = 500
    type = "server_error"
    headers = {"x-should-retry": "false"}  # the SDKs' retries would meet the same failure


def error_for_status(status: int, message: str) -> APIError:
    """The typed error for a status carried in a message (router rejections, engine failures)."""
    cls = {400: BadRequest, 404: NotFound, 429: TooManyRequests, 503: ServiceUnavailable}.get(
        status, EngineFailed
    )
    if cls is BadRequest and "maximum context length" in message:
        return ContextLengthExceeded(message)
    return cls(message)


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"


class RaisedAPIError(StarletteHTTPException):
    """An APIError raised where FastAPI only lets HTTPExceptions through (while it reads and
    parses the body); the handler below answers with the wrapped error."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message)
        self.error = error


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


_TYPE_PARTS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple) -> list[str]:
    """The request fields of a pydantic error location: without "body", without the union
    members it tried ("str", "list[tagged-union[TextPart,ImagePart]]") and the tag value
    ("text") a tagged union adds after the member's index."""
    out: list[str] = []
    skip = -1
    for i, part in enumerate(str(p) for p in loc):
        if i == skip or part == "body":
            continue
        if "[" in part or part in _TYPE_PARTS:
            if "tagged-union[" in part:
                skip = i + 2 if part.startswith("list[") else i + 1
            continue
        out.append(part)
    return out


def _validation_error(exc: RequestValidationError) -> BadRequest:
    errors = exc.errors()
    if not errors:
        return BadRequest("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return BadRequest(f"Malformed JSON body: {first.get('msg', 'invalid JSON')}.")
    # A union field fails once per member; the member that got furthest into the value is the
    # one the client meant (a content-part list missing its `text`, not "not a string").
    field = _field_path(first.get("loc", ()))
    rivals = [e for e in errors if _field_path(e.get("loc", ()))[: len(field)] == field]
    first = max(rivals, key=lambda e: len(e.get("loc", ())))  # the first of the deepest
    loc = _field_path(first.get("loc", ()))
    param = loc[0] if loc else None
    path = ".".join(loc)
    kind = first.get("type", "")
    if kind == "missing":
        return BadRequest(f"{path or 'body'}: field required.", param, "missing_required_parameter")
    # OpenAI's codes: a wrong JSON type is "invalid_type"; a right type with a wrong value
    # (a number below its minimum, a role it does not know) is "invalid_value".
    code = (
        "invalid_type" if kind.endswith("_type") or kind.startswith("union_") else "invalid_value"
    )
    return BadRequest(f"{path or 'body'}: {first.get('msg', 'invalid value')}.", param, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, RaisedAPIError):
            return error_response(exc.error)
        if exc.status_code == 400:  # FastAPI's "There was an error parsing the body"
            return error_response(BadRequest(f"{exc.detail}."))
        codes = {404: (NotFound, "not_found"), 405: (MethodNotAllowed, "method_not_allowed")}
        cls, code = codes.get(exc.status_code, (APIError, None))
        err = cls(str(exc.detail), code=code)
        err.status = exc.status_code
        err.headers = dict(exc.headers or {})  # e.g. a 405's Allow
        return error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(EngineFailed(f"Internal server error: {type(exc).__name__}."))


def sse_error(err: APIError) -> str:
    """An error event inside an SSE stream (the openai SDK raises it as APIError)."""
    return f"data: {json.dumps(err.body())}\n\n"
