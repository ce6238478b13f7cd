"""Server-wide state shared by the route handlers, and the helpers the handler skeleton
(serving.py) uses: readiness, model name check, request ids, client-disconnect watch, deltas.

Created by process.py (or tests) and handed to `build_app` (app.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from appliance.config import ServerConfig, chat_template_defaults
from appliance.grammars import GrammarCompiler
from appliance.messages import TextDelta
from appliance.metrics import MetricsRecorder
from appliance.server.engine_client import EngineClient, RequestGroup
from appliance.server.errors import (
    APIError,
    EngineFailed,
    ModelNotFound,
    RequestTimeout,
    ServiceUnavailable,
    error_for_status,
)
from appliance.server.prompts import PromptBuilder
from appliance.server.request_metrics import MetricsReport
from appliance.stats import WindowStats

STARTING_RETRY_AFTER_S = 5  # a 503 while the model loads: the SDKs wait this long to retry
LARGE_PROMPT_CHARS = 65_536  # prompts over this many characters are built in the large lane


class PromptLanes:
    """Where prompts are rendered and tokenized, off the event loop, in two thread pools: prompts
    over LARGE_PROMPT_CHARS characters queue for a lane of their own (one thread per two cores),
    so a few maximal prompts never take every thread or core from small requests. Threads suffice:
    the fast tokenizer's Rust encode releases the GIL."""

    def __init__(self, large_threads: int = 0) -> None:
        cores = os.cpu_count() or 2
        self._small = ThreadPoolExecutor(max(2, cores), thread_name_prefix="prompt")
        large = large_threads or max(1, cores // 2)
        self._large = ThreadPoolExecutor(large, thread_name_prefix="prompt-large")

    async def run(self, num_chars: int, fn: Callable, *args):
        """`fn(*args)` in the lane for a prompt of `num_chars` characters."""
        pool = self._large if num_chars > LARGE_PROMPT_CHARS else self._small
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


@dataclass
class ServerState:
    config: ServerConfig
    model_name: str  # served model id
    model_dir: str
    prompts: PromptBuilder
    client: EngineClient
    metrics: MetricsRecorder
    ready: bool = False  # EngineReady received: admitting requests
    draining: bool = False  # Drain received: refusing new requests
    prompt_lanes: PromptLanes = field(default_factory=PromptLanes)  # where prompts are tokenized
    # fields a request leaves unset take these first (the model's generation_config.json)
    sampling_defaults: dict = field(default_factory=dict)
    scheduling_policy: str = "fcfs"  # the router's (--scheduling-policy): may requests set priority
    mtp_step: int = 0  # the router's --mtp-step: /generate reports each request's MTP counts
    created: int = field(default_factory=lambda: int(time.time()))
    # SGLang's /get_server_info: the launch settings (server_info.launch_args) and the generated
    # tokens/s of the last stats window that generated any (set by the stats ticker)
    launch_args: dict = field(default_factory=dict)
    last_gen_throughput: float = 0.0

    def note_window(self, stats: WindowStats) -> None:
        """The stats ticker's closed window: keeps its generation rate if it generated."""
        if stats.generation_tokens > 0:
            self.last_gen_throughput = stats.generation_throughput

    @functools.cached_property
    def template_defaults(self) -> dict:
        """--default-chat-template-kwargs: what chat requests render with unless they say."""
        return chat_template_defaults(self.config)

    @functools.cached_property
    def metrics_report(self) -> MetricsReport | None:
        """vLLM's per-request `metrics` settings (None: no answer carries them)."""
        return MetricsReport.of(self.config, self.mtp_step)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output guides (xgrammar loaded on the first guided request)."""
        return GrammarCompiler(
            lambda: self.prompts.tokenizer,
            self.prompts.vocab_size,
            on_compiled=self.metrics.grammar_compile.observe,
            on_cache_hit=self.metrics.grammar_cache_hits.inc,
        )

    def grammar_status(self) -> dict:
        """/debug/status: the structured-output compiler's cumulative counts."""
        if "grammars" not in self.__dict__:  # no guided request yet: nothing loaded
            return {"compiled": 0, "cache_hits": 0, "errors": 0, "compile_seconds": 0.0}
        return dataclasses.asdict(self.grammars.stats)

    @property
    def max_model_len(self) -> int:
        return self.prompts.max_model_len

    def health_error(self) -> APIError | None:
        if self.client.failure is not None:
            return EngineFailed(self.client.failure)
        if self.draining:
            return ServiceUnavailable("The server is shutting down.")
        if not self.ready:
            return ServiceUnavailable(
                "The server is starting; the model is not loaded yet.",
                retry_after_s=STARTING_RETRY_AFTER_S,
            )
        return None

    def check_accepting(self) -> None:
        err = self.health_error()
        if err is not None:
            raise err

    def check_model(self, name: str | None) -> str:
        if not name or name in (self.model_name, self.model_dir):  # "" as unset, as vLLM
            return self.model_name
        raise ModelNotFound(name)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ClientGone(Exception):
    """The client disconnected before its stream started (nothing left to answer)."""


def exit_reason(exc: BaseException) -> str:
    """Why a request's open choices are aborted when `exc` ends its handler: the client left
    (a stream's body is cancelled or closed when it does), or the request failed otherwise
    (a rejection of another choice, a bug). A passed deadline is marked where it is detected."""
    if isinstance(exc, (ClientGone, asyncio.CancelledError, GeneratorExit)):
        return "client_gone"
    return "error"


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, client: EngineClient, group: RequestGroup):
    """Watches the connection while a request runs; a client that goes away has its choices
    aborted (their KV and state slots are freed at once). Also aborts on any exit that leaves
    choices open."""

    async def watch() -> None:
        await wait_disconnect(request)
        client.abort(group, "client_gone")
        group.queue.put_nowait(None)

    task = asyncio.create_task(watch())
    try:
        yield
    except BaseException as exc:
        client.abort(group, exit_reason(exc))
        raise
    finally:
        task.cancel()
        # open choices after a normal exit: the answer was cut short because the client left
        client.abort(group, "client_gone")


async def _next_item(group: RequestGroup):
    """The group's next queue item, or RequestTimeout once its deadline has passed."""
    if group.deadline is None:
        return await group.queue.get()
    try:
        return await asyncio.wait_for(
            group.queue.get(), max(0.0, group.deadline - time.monotonic())
        )
    except asyncio.TimeoutError:
        group.abort_reason = group.abort_reason or "deadline"  # its choices are aborted next
        raise RequestTimeout(group.timeout_s) from None


def _check_item(group: RequestGroup, item) -> tuple[int, TextDelta] | None:
    """None when the group ended early; raises the error an item carries."""
    if item is None:  # failed (engine died, drain timeout) or client gone
        if group.error is not None:
            raise group.error
        return None
    index, delta = item
    if delta.finish_reason == "error":
        raise error_for_status(delta.error_status or 500, delta.error or "generation failed")
    return item


async def first_item(
    request: Request, client: EngineClient, group: RequestGroup
) -> tuple[int, TextDelta]:
    """Waits for a stream's first delta before any byte is sent, so that a rejection by the router
    (queue full, KV too small) still gets its real HTTP status instead of an in-stream error."""
    get = asyncio.ensure_future(_next_item(group))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            raise ClientGone
        item = _check_item(group, get.result())
        if item is None:
            raise ClientGone
        return item
    except BaseException as exc:
        get.cancel()
        client.abort(group, exit_reason(exc))
        raise
    finally:
        gone.cancel()


async def iterate_deltas(
    group: RequestGroup,
    first: tuple[int, TextDelta] | None = None,
) -> AsyncIterator[tuple[int, TextDelta]]:
    """Yields (choice index, delta) until every choice finished; raises the group's error, if any.
    `first`: an item already taken from the queue (by `first_item`)."""
    remaining = len(group.choices)
    while remaining:
        item = _check_item(group, first if first is not None else await _next_item(group))
        first = None
        if item is None:
            return
        index, delta = item
        yield index, delta
        if delta.finish_reason is not None:
            remaining -= 1
