"""Request-body limits of the HTTP server: a byte limit enforced while the body is read, and a JSON
parser that refuses deep nesting and the non-JSON constants NaN / Infinity.

`BodyLimit` is installed as ASGI middleware by app.py (`--max-request-bytes`); `LimitedJSONRoute`
is the route class of the POST routes, so FastAPI parses their bodies through `LimitedRequest`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.server.errors import BadRequest, RaisedAPIError, RequestTooLarge, error_response

MAX_JSON_DEPTH = 64  # nested arrays / objects in a request body; tool schemas need about 10


def declared_length(scope: Scope) -> int | None:
    """The Content-Length header as an int (None when absent or not a number)."""
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    """ASGI middleware: 413 when Content-Length says the body is too large (before reading any of
    it), or as soon as the bytes received pass the limit (chunked bodies, lying headers): nothing
    past the limit is buffered."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await error_response(RequestTooLarge(self.max_bytes))(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RaisedAPIError(RequestTooLarge(self.max_bytes))
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RaisedAPIError as exc:  # raised outside a route's error handlers
            if started:
                raise
            await error_response(exc.error)(scope, receive, send)


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays / objects nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(body: bytes) -> Any:
    """The body as JSON, or a 400: malformed, NaN / Infinity, or nested past MAX_JSON_DEPTH."""
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        value = None
        deep = True
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN / Infinity
        raise RaisedAPIError(BadRequest(f"Malformed JSON body: {exc}.")) from None
    else:
        deep = json_depth_exceeds(value, MAX_JSON_DEPTH)
    if deep:
        raise RaisedAPIError(
            BadRequest(f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels.")
        )
    return value


class LimitedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class LimitedJSONRoute(APIRoute):
    """An APIRoute whose handler parses JSON bodies through `LimitedRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited_handler(request: Request) -> Response:
            return await handler(LimitedRequest(request.scope, request.receive))

        return limited_handler
