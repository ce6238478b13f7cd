"""The FastAPI app: OpenAI routes, SGLang's native /generate, /health, /debug/status, the
prefix-cache reset, the workers' profiler, /metrics, the access log.

`build_app(state)` is called by process.py (under uvicorn) and by tests (TestClient). The engine
client's sockets are opened in the app's lifespan, so they live on the serving event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from appliance import __version__
from appliance.logging import log_access
from appliance.messages import ProfileAction, RouterStats, VisualStats
from appliance.metrics import flat_report
from appliance.server.auth import install_auth
from appliance.server.errors import error_response, install_error_handlers
from appliance.server.limits import BodyLimit, LimitedJSONRoute
from appliance.server.profiling import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    answer_body,
    read_start_body,
    start_action,
)
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest, error_responses
from appliance.server.responses_request import ResponsesRequest
from appliance.server.responses_store import ResponseNotFound, StoredResponse, new_store
from appliance.server.server_info import server_info
from appliance.server.serving import serve
from appliance.server.serving_beam import serve_beam_search
from appliance.server.serving_chat import CHAT
from appliance.server.serving_completion import COMPLETION
from appliance.server.serving_generate import generate, health_generate, model_info
from appliance.server.serving_responses import serve_responses
from appliance.server.sglang_request import GenerateRequest
from appliance.server.state import ServerState
from appliance.server.tokenize_api import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)

_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/input_items",
    "/v1/models",
    "/v1/models/{model}",
    "/health",
    "/metrics",
    "/debug/status",
    "/reset_prefix_cache",
    "/flush_cache",
    "/start_profile",
    "/stop_profile",
    "/tokenize",
    "/detokenize",
    "/version",
    "/generate",
    "/health_generate",
    "/get_model_info",
    "/model_info",
)


class AccessLog:
    """ASGI middleware: one line per HTTP request (never the prompt) and the HTTP metric."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode() or uuid.uuid4().hex[:16]

        async def send_wrapper(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            self.state.metrics.on_http_response(route_label(path), status)
            if self.state.config.access_log:
                # probes (/health, /metrics) at DEBUG; control characters in the id neutralised.
                # serve() leaves the completion id and the request's group in the scope's state.
                served = scope.get("state") or {}
                group = served.get("request_group")
                log_access(
                    scope.get("method", ""),
                    path,
                    status,
                    time.monotonic() - start,
                    request_id,
                    completion=served.get("completion_id", ""),
                    aborted=(group.abort_reason or "") if group is not None else "",
                )


def route_label(path: str) -> str:
    """The route template of a path for the HTTP metric (unknown paths are "other")."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    parts = path.split("/")  # "", "v1", "responses", id[, "input_items"]
    if path.startswith("/v1/responses/") and parts[3] and len(parts) <= 5:
        if len(parts) == 4:
            return "/v1/responses/{response_id}"
        if parts[4] == "input_items":
            return "/v1/responses/{response_id}/input_items"
    return path if path in _ROUTES else "other"


def _router_view(stats: RouterStats, visual: VisualStats | None) -> dict[str, Any]:
    """/debug/status "router": one flat object, as before the scheduler snapshot was nested in
    RouterStats and the visual server's cache numbers moved out of it."""
    view = dict(flat_report(stats))
    for field in ("entries", "pinned", "bytes", "queries", "hits"):
        view[f"mm_cache_{field}"] = getattr(visual, f"cache_{field}") if visual is not None else 0
    return view


def _openapi_with_limits(app: FastAPI, state: ServerState) -> dict[str, Any]:
    """The generated schema plus the limits this server's config sets (`n` <= --max-n)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            schema["components"]["schemas"][name]["properties"]["n"]["maximum"] = state.config.max_n
    return app.openapi_schema


def build_app(
    state: ServerState, background: Sequence[Callable[[], Awaitable[None]]] = ()
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.client.start()
        tasks = [asyncio.create_task(job()) for job in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await state.client.close()

    app = FastAPI(title="appliance", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi_with_limits(app, state)
    app.router.route_class = LimitedJSONRoute  # JSON bodies: nesting depth, no NaN
    install_error_handlers(app)
    # Added innermost first: AccessLog sees (and counts) every answer, 401s and 413s included.
    app.add_middleware(BodyLimit, max_bytes=state.config.max_request_bytes)
    install_auth(app, state.config)
    app.add_middleware(AccessLog, state=state)
    generation_errors = error_responses(400, 401, 404, 408, 413, 429, 500, 503)

    @app.post("/v1/chat/completions", responses=generation_errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.use_beam_search:
            return await serve_beam_search(CHAT, state, body, request)
        return await serve(CHAT, state, body, request)

    @app.post("/v1/completions", responses=generation_errors)
    async def completions(body: CompletionRequest, request: Request):
        if body.use_beam_search:
            return await serve_beam_search(COMPLETION, state, body, request)
        return await serve(COMPLETION, state, body, request)

    # OpenAI's Responses API (vLLM's subset), served through the chat route's pieces; the kept
    # responses (--responses-store) live in this process. The store's routes are `async def`:
    # every use of the store stays on the event loop (a plain def would run in a thread).
    store = new_store(state.config)

    @app.post("/v1/responses", responses=generation_errors)
    async def responses(body: ResponsesRequest, request: Request):
        return await serve_responses(state, store, body, request)

    def stored(response_id: str) -> StoredResponse:
        found = store.get(response_id) if store is not None else None
        if found is None:
            raise ResponseNotFound(response_id, store is not None)
        return found

    @app.get("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def get_response(response_id: str):
        return JSONResponse(stored(response_id).response)

    @app.delete("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def delete_response(response_id: str):
        if store is None or not store.delete(response_id):
            raise ResponseNotFound(response_id, store is not None)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 404))
    async def input_items(
        response_id: str,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ):
        stored(response_id)
        return store.input_items_page(response_id, limit, order, after)

    # SGLang's native API (its scripts, RL and eval frameworks), on the completions route's pieces
    @app.put("/generate", include_in_schema=False)  # SGLang takes PUT too
    @app.post("/generate", responses=generation_errors)
    async def generate_route(body: GenerateRequest, request: Request):
        return await generate(state, body, request)

    @app.get("/health_generate", responses=error_responses(401, 503))
    async def health_generate_route():
        return await health_generate(state)

    @app.get("/get_model_info", responses=error_responses(401))
    @app.get("/model_info", responses=error_responses(401))  # SGLang's newer name
    async def model_info_route():
        return model_info(state)

    @app.get("/get_server_info", responses=error_responses(401, 500, 503))
    @app.get("/server_info", responses=error_responses(401, 500, 503))  # SGLang's newer name
    async def server_info_route():
        state.check_accepting()
        stats = (await state.client.status()).stats.scheduler
        info = server_info(state.launch_args, state.max_model_len, stats, state.last_gen_throughput)
        return JSONResponse(info)

    # vLLM's (and SGLang's) token counting, built as the two routes above build their prompts
    @app.post("/tokenize", responses=error_responses(400, 401, 404, 413, 500, 503))
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(state, body)

    @app.post("/detokenize", responses=error_responses(400, 401, 404, 413, 500, 503))
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(state, body)

    def model_card() -> dict[str, Any]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "appliance",
            "root": state.model_name,  # never the folder's path on the host
            "parent": None,
            "max_model_len": state.max_model_len,
            "permission": [],
        }

    # The model list answers what /health answers while the server cannot serve (starting,
    # draining, a role died): a 200 there would tell a client the model is ready when it is not.
    @app.head("/v1/models", include_in_schema=False)  # uptime checkers send HEAD
    @app.get("/v1/models", responses=error_responses(401, 500, 503))
    async def models():
        state.check_accepting()
        return {"object": "list", "data": [model_card()]}

    @app.head("/v1/models/{model:path}", include_in_schema=False)  # uptime checkers send HEAD
    @app.get("/v1/models/{model:path}", responses=error_responses(401, 404, 500, 503))
    async def model(model: str):
        state.check_accepting()
        state.check_model(model)
        return model_card()

    @app.head("/health", include_in_schema=False)  # uptime checkers send HEAD
    @app.get("/health", responses=error_responses(500, 503))
    async def health():
        err = state.health_error()
        if err is not None:
            return error_response(err)
        return Response(status_code=200)

    @app.head("/version", include_in_schema=False)  # uptime checkers send HEAD
    @app.get("/version", responses=error_responses(401))
    async def version():
        return {"version": __version__}

    @app.get("/debug/status", responses=error_responses(401, 500, 503))
    async def debug_status():
        state.check_accepting()
        status = await state.client.status()
        router = _router_view(status.stats, state.client.visual_stats)
        requests = [msgspec.structs.asdict(r) for r in status.requests]
        return JSONResponse(
            {
                "router": router,
                "requests": requests,
                "detokenizer": {"live_requests": state.client.detok_live},
                "server": {
                    "open_sequences": state.client.num_open,
                    "ready": state.ready,
                    "draining": state.draining,
                },
                "grammar": state.grammar_status(),
            }
        )

    # Empties the prefix cache (benchmarks measuring cold prefills, stale entries) but for what
    # live requests hold. vLLM's route, and SGLang's, which its bench_serving --flush-cache POSTs
    # (SGLang's answer is text its clients do not read, only the status): the same JSON from both
    async def reset_cache() -> JSONResponse:
        state.check_accepting()
        report = msgspec.structs.asdict(await state.client.reset_prefix_cache())
        del report["query_id"]
        return JSONResponse(report)

    @app.post("/reset_prefix_cache", responses=error_responses(401, 500, 503))
    async def reset_prefix_cache():
        return await reset_cache()

    @app.post("/flush_cache", responses=error_responses(401, 500, 503))
    @app.get("/flush_cache", responses=error_responses(401, 500, 503))
    async def flush_cache():
        return await reset_cache()

    # torch.profiler on the workers (SGLang's and vLLM's pair, which their bench_serving --profile
    # POSTs around a run): the traces' folder and names in the answer
    @app.post("/start_profile", responses=error_responses(400, 401, 500, 503))
    async def start_profile(request: Request):
        action = start_action(read_start_body(await request.body()))
        state.check_accepting()
        answer = await state.client.profile(action, START_TIMEOUT_S)
        return JSONResponse(answer_body(answer, action))

    @app.post("/stop_profile", responses=error_responses(400, 401, 500, 503))
    async def stop_profile():
        state.check_accepting()
        answer = await state.client.profile(ProfileAction(start=False), STOP_TIMEOUT_S)
        return JSONResponse(answer_body(answer, None))

    @app.head("/metrics", include_in_schema=False)  # uptime checkers send HEAD
    @app.get("/metrics", responses=error_responses(401))
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    return app
