"""The server process: loads the tokenizer, runs the FastAPI app under uvicorn, and obeys the
launcher's control messages (EngineReady: start admitting; Drain: finish open requests then report;
Fatal: fail every open request and report unhealthy).

Spawned by appliance/launch.py (`run_server`). Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import uvicorn
import zmq
import zmq.asyncio

from appliance import envs
from appliance.chat_template import load_chat_template
from appliance.config import ServeConfig
from appliance.generation_defaults import describe, generation_defaults
from appliance.ipc import Addresses, RoleLink, child_init
from appliance.logging import get_logger
from appliance.messages import Drain, Drained, EngineReady, Fatal, ToServerControl, decoder
from appliance.metrics import MetricsRecorder
from appliance.server.app import build_app
from appliance.server.engine_client import EngineClient
from appliance.server.prompts import PromptBuilder
from appliance.server.server_info import launch_args
from appliance.server.state import ServerState
from appliance.stats import StatsTicker, StatsWindow

logger = get_logger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the launcher decides when the server stops."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _control_loop(state: ServerState, address: str, link: RoleLink) -> None:
    sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    dec = decoder(ToServerControl)
    while True:
        msg = dec.decode(await sock.recv())
        if isinstance(msg, EngineReady):
            state.prompts.max_model_len = msg.max_model_len
            state.ready = True
        elif isinstance(msg, Drain):
            state.draining = True
            asyncio.create_task(_drain(state, msg.timeout_s, link))
        elif isinstance(msg, Fatal):
            count = state.client.engine_failed(msg.message)
            logger.error("%s (%d open requests failed)", msg.message, count)


async def _exit_if_dispatch_dies(state: ServerState, server: uvicorn.Server) -> None:
    """Fail fast: if the engine link dies, stop serving so the launcher names the server."""
    task = state.client.dispatch_task
    if task is not None:
        await asyncio.wait({task})
        server.should_exit = True


async def _drain(state: ServerState, timeout_s: float, link: RoleLink) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while state.client.num_open and loop.time() < deadline:
        await asyncio.sleep(0.05)
    aborted = state.client.abort_all("The server is shutting down.") if state.client.num_open else 0
    await asyncio.sleep(0.2)  # let the handlers write their last bytes
    link.send(Drained(aborted))


def build_state(config: ServeConfig, model_dir: str, addrs: Addresses) -> ServerState:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    override = load_chat_template(config.server.chat_template)
    if override is not None:  # every chat route (and /tokenize) renders through this tokenizer
        tokenizer.chat_template, source = override
        logger.info("chat template: %s (--chat-template), not the checkpoint's", source)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning(
            "%s has no chat template: /v1/chat/completions answers 400, /v1/completions serves",
            model_dir,
        )
    # the folder's own name, also for "." or "ckpt/" (absolute, symlinks not followed)
    name = config.server.served_model_name or Path(os.path.abspath(model_dir)).name
    window = StatsWindow()
    metrics = MetricsRecorder(name, window)
    sched = config.engine.scheduler
    client = EngineClient(
        addrs.router, addrs.server, sched.max_num_seqs + sched.max_waiting, metrics
    )
    defaults = generation_defaults(model_dir, config.server.generation_config)
    logger.info(
        "sampling defaults of unset request fields: %s (--generation-config %s)",
        describe(defaults),
        config.server.generation_config,
    )
    return ServerState(
        config.server,
        name,
        model_dir,
        PromptBuilder(tokenizer, 0, config.server.max_prompt_chars),
        client,
        metrics,
        sampling_defaults=defaults,
        scheduling_policy=config.engine.scheduler.scheduling_policy,
        mtp_step=config.engine.scheduler.mtp_step,
        launch_args=launch_args(config, name),
    )


def run_server(config: ServeConfig, model_dir: str, addrs: Addresses) -> None:
    child_init("server", on_orphan=addrs.remove_run_dir)
    link = RoleLink(addrs.launcher, "server")
    link.progress("loading tokenizer")
    state = build_state(config, model_dir, addrs)
    ticker = StatsTicker(
        state.metrics.window, envs.APPLIANCE_LOG_STATS_INTERVAL, on_window=state.note_window
    )
    server: _Server | None = None
    app = build_app(
        state,
        background=[
            lambda: _control_loop(state, addrs.server_control, link),
            lambda: _exit_if_dispatch_dies(state, server),
            ticker.run_async,
        ],
    )
    server = _Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
    )

    async def main() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                return
            await asyncio.sleep(0.02)
        sockets = [sock for srv in server.servers for sock in srv.sockets]
        link.ready(port=sockets[0].getsockname()[1] if sockets else config.server.port)
        await serving

    asyncio.run(main())
    sys.exit(1)  # uvicorn only returns when it failed (port in use) or was told to stop
