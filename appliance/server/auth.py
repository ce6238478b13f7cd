"""API-key authentication and CORS for the HTTP server.

`install_auth(app, config)` is called by app.py. With keys configured (`--api-key` or
APPLIANCE_API_KEY, comma-separated) every route needs one, sent as `Authorization: Bearer <key>` or
`x-api-key: <key>`, except /health and (unless `--metrics-require-key`) /metrics; a missing or
wrong key is a 401 in the OpenAI error shape. CORS is off unless `--allowed-origins` names some.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from appliance import envs
from appliance.config import ServerConfig
from appliance.logging import get_logger
from appliance.server.errors import Unauthorized, error_response

logger = get_logger(__name__)

_LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def split_list(text: str) -> tuple[str, ...]:
    """A comma-separated flag as its non-empty, stripped parts."""
    return tuple(part for part in (p.strip() for p in text.split(",")) if part)


def api_keys(config: ServerConfig) -> tuple[str, ...]:
    """The accepted keys: `--api-key` if given, else APPLIANCE_API_KEY; () = no authentication."""
    return split_list(config.api_key or envs.APPLIANCE_API_KEY)


def open_paths(config: ServerConfig) -> frozenset[str]:
    """Routes served without a key: the liveness probe, and the scrape target unless told not to.
    Everything else (/v1/*, /debug/*, /openapi.json, unknown paths) needs one."""
    return frozenset({"/health"} if config.metrics_require_key else {"/health", "/metrics"})


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries: `Authorization: Bearer <key>`, else `x-api-key: <key>`."""
    fallback = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            fallback = value.strip()
    return fallback


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant-time comparison against every key (no early exit that would tell which matched)."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


class APIKeyAuth:
    """ASGI middleware: a 401 before the route (and before the body is read) without a valid key."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = presented_key(scope.get("headers") or [])
        if presented is None:
            err = Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        elif not key_matches(presented, self.keys):
            err = Unauthorized("Incorrect API key provided.")
        else:
            await self.app(scope, receive, send)
            return
        await error_response(err)(scope, receive, send)


def install_auth(app: FastAPI, config: ServerConfig) -> None:
    """Adds CORS (outside, so a 401 still carries its headers and preflights need no key) and the
    key check. Warns when the server listens beyond loopback without a key."""
    keys = api_keys(config)
    if keys:
        app.add_middleware(APIKeyAuth, keys=keys, open_paths=open_paths(config))
    elif config.host not in _LOOPBACK_HOSTS:
        logger.warning(
            "no API key set (--api-key / APPLIANCE_API_KEY) and listening on %s: anyone who "
            "reaches this port can use the model",
            config.host,
        )
    origins = split_list(config.allowed_origins)
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],  # SDKs send their own (x-stainless-*, openai-organization)
            expose_headers=["x-request-id", "retry-after", "x-should-retry"],
        )
