"""The launcher: the only place that spawns processes (server, detokenizer, router, a worker per
rank, and the visual server for checkpoints with a vision tower).

Called by `appliance serve` (cli.py) and by benchmarks. It allocates every address, shows startup
progress from each role's messages, names a role that dies (failing every open request through the
server, then exiting non-zero), and on SIGTERM/SIGINT drains the server and exits 0.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import zmq

from appliance import envs
from appliance.config import ServeConfig
from appliance.ipc import Addresses, read_failures, run_role, zmq_socket
from appliance.logging import get_logger
from appliance.messages import (
    Drain,
    Drained,
    EngineReady,
    Fatal,
    Heartbeat,
    ProcessReady,
    StartupFailed,
    StartupProgress,
    ToLauncher,
    VisualInfo,
    WorkerInfo,
    decoder,
    encode,
)
from appliance.stats import format_config_block

logger = get_logger(__name__)


# ------------------------------------------------------------------ the launcher


class LaunchError(RuntimeError):
    """A role died or startup failed; the message names the role."""


class Launcher:
    """Spawns and supervises the roles of one appliance; `run()` blocks, returns the exit code."""

    def __init__(self, config: ServeConfig) -> None:
        from appliance.encoder.startup import wants_visual_server

        self.config = config
        self.model_dir = config.engine.model.model_dir  # resolved by the caller (cli.py)
        self.tp = config.engine.parallel.tp
        self.port = config.server.port  # the server's ProcessReady says which, for --port 0
        self.with_visual = wants_visual_server(self.model_dir, config.server.visual)
        self.visual_info: VisualInfo | None = None
        self._run_dir = Path(tempfile.mkdtemp(prefix="appliance-"))
        self.addrs = Addresses.allocate(config.launch.transport, self.tp, self._run_dir)
        self._mp = mp.get_context("spawn")
        self._procs: dict[str, mp.process.BaseProcess] = {}
        self._ctx = zmq.Context.instance()
        self._inbox = zmq_socket(self._ctx, zmq.PULL, self.addrs.launcher, bind=True)
        self._control = zmq_socket(self._ctx, zmq.PUSH, self.addrs.server_control, bind=False)
        self._decoder = decoder(ToLauncher)
        self._stop_signal: int | None = None
        self._t0 = time.monotonic()
        self._last_beat: dict[str, float] = {}  # role -> monotonic time of its last Heartbeat
        self._failures: dict[str, str] = {}  # role -> the reason its StartupFailed gave
        self._serving_since = float("inf")  # set when every role is ready
        self._heartbeat_timeout = float(envs.APPLIANCE_HEARTBEAT_TIMEOUT)

    # -------------------------------------------------------------- spawning
    def _spawn(self, role: str, target, *args) -> None:
        launcher = self.addrs.launcher
        proc = self._mp.Process(
            target=run_role, args=(target, role, launcher, *args), name=role, daemon=False
        )
        proc.start()
        self._procs[role] = proc
        logger.debug("spawned %s (pid %d)", role, proc.pid)

    def _spawn_frontends(self) -> None:
        """Visual server (its reservation must be known before the workers size their pools),
        detokenizer and server; the workers follow at once when there is no visual server."""
        from appliance.detokenizer.process import run_detokenizer
        from appliance.server.process import run_server

        if self.with_visual:
            from appliance.encoder.process import run_visual

            self._spawn("visual", run_visual, self.config, self.model_dir, self.addrs)
        self._spawn("detokenizer", run_detokenizer, self.model_dir, self.addrs)
        server_addrs = self.addrs.for_server(self.with_visual)
        self._spawn("server", run_server, self.config, self.model_dir, server_addrs)
        if not self.with_visual:
            self._spawn_workers()

    def _spawn_workers(self) -> None:
        """One worker per rank. The ViT shares worker rank 0's device (appliance/encoder), so rank 0
        alone leaves the visual server's reservation out of its pools."""
        from appliance.engine.worker import run_worker

        reserved = self.visual_info.reserved_bytes if self.visual_info is not None else 0
        for rank in range(self.tp):
            self._spawn(
                f"worker {rank}",
                run_worker,
                self.config.engine,
                self.addrs,
                rank,
                self.tp,
                self.config.launch.runner,
                reserved if rank == 0 else 0,
            )

    def _spawn_router(self, info: WorkerInfo) -> None:
        from appliance.router.process import run_router

        self._spawn("router", run_router, self.config.engine, self.addrs, info, self.with_visual)

    # -------------------------------------------------------------- supervision
    def _dead_role(self, when: str = "") -> str | None:
        """A line naming a role that exited (`when` follows "failed" / "exited"): the reason its
        StartupFailed gave if one did, which is then the role named."""
        dead = [(role, proc) for role, proc in self._procs.items() if proc.exitcode is not None]
        if not dead:
            return None
        read_failures(self._inbox, self._decoder, self._failures)
        for role, proc in dead:
            if role in self._failures:
                return f"{role} (pid {proc.pid}) failed{when}: {self._failures[role]}"
        role, proc = dead[0]
        return f"{role} (pid {proc.pid}) exited with code {proc.exitcode}{when}"

    def _silent_role(self) -> str | None:
        """A role that sent no Heartbeat for APPLIANCE_HEARTBEAT_TIMEOUT seconds (stopped, hung in
        native code) is killed and reported like a dead one. Checked once serving began: a slow
        start-up is the progress display's business."""
        if self._heartbeat_timeout <= 0:
            return None
        now = time.monotonic()
        for role, proc in self._procs.items():
            silent = now - max(self._last_beat.get(role, 0.0), self._serving_since)
            if silent > self._heartbeat_timeout and proc.exitcode is None:
                proc.kill()  # SIGKILL ends a stopped process too; SIGTERM would wait for SIGCONT
                proc.join(1.0)
                return f"{role} (pid {proc.pid}) stopped answering: no heartbeat for {silent:.1f}s"
        return None

    def _poll(self, timeout_ms: int):
        """The next message, or None after timeout_ms or as soon as a role dies: its exit wakes the
        wait, so the role that died first is the one reported (a TP peer that aborts on the
        broken collective a few ms later is not)."""
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        for proc in self._procs.values():
            if proc.exitcode is None:
                poller.register(proc.sentinel, zmq.POLLIN)
        if self._inbox not in dict(poller.poll(timeout_ms)):
            return None
        msg = self._decoder.decode(self._inbox.recv())
        if isinstance(msg, Heartbeat):
            role = msg.role if msg.role != "worker" else f"worker {msg.rank}"
            self._last_beat[role] = time.monotonic()
        elif isinstance(msg, StartupFailed):
            self._failures.setdefault(msg.role, msg.reason)
        return msg

    def _wait_startup(self) -> WorkerInfo:
        """Waits for every role's ProcessReady, spawning the router once the workers are ready."""
        pending = {f"worker {r}" for r in range(self.tp)} | {"detokenizer", "server", "router"}
        if self.with_visual:
            pending.add("visual")
        total = len(pending)
        info: WorkerInfo | None = None
        while pending:
            if self._stop_signal is not None:
                raise KeyboardInterrupt
            dead = self._dead_role(" during startup")
            if dead is not None:
                raise LaunchError(dead)
            msg = self._poll(100)
            if isinstance(msg, StartupProgress):
                who = msg.role if msg.role != "worker" else f"worker {msg.rank}"
                logger.info("[%5.1fs] %s: %s", self._elapsed(), who, msg.stage)
            elif isinstance(msg, ProcessReady):
                who = msg.role if msg.role != "worker" else f"worker {msg.rank}"
                pending.discard(who)
                if msg.worker is not None:
                    info = msg.worker
                logger.info(
                    "[%5.1fs] %s ready (pid %d, %d/%d)",
                    self._elapsed(),
                    who,
                    msg.pid,
                    total - len(pending),
                    total,
                )
                if msg.port:
                    self.port = msg.port  # --port 0: the port the server got
                if msg.visual is not None:
                    self.visual_info = msg.visual
                    self._spawn_workers()
                if (
                    who.startswith("worker")
                    and info is not None
                    and "router" not in self._procs
                    and not any(p.startswith("worker") for p in pending)
                ):
                    self._spawn_router(info)
        assert info is not None
        return info

    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:
            logger.warning("second signal: stopping now without draining")
            for proc in self._procs.values():
                if proc.exitcode is None:
                    proc.kill()
            self._remove_leftovers()
            os._exit(1)
        self._stop_signal = signum

    def run(self) -> int:
        """Starts everything, serves until a signal (exit 0 after draining) or a death (exit 1)."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._spawn_frontends()
            # after the spawn: importing torch for the look-up overlaps the roles' start-up, and
            # their progress messages wait in the inbox until the block is out
            logger.info("%s", format_config_block(self.config, resolved_backends(self.config)))
            info = self._wait_startup()
            self._control.send(encode(EngineReady(info.max_model_len, info.num_kv_slots)))
            host = self.config.server.host
            logger.info(
                "ready in %.1fs: http://%s:%d (tp %d, max_model_len %d, %d KV slots)",
                self._elapsed(),
                f"[{host}]" if ":" in host else host,  # an IPv6 address, as a URL writes it
                self.port,
                self.tp,
                info.max_model_len,
                info.num_kv_slots,
            )
            return self._serve()
        except KeyboardInterrupt:
            logger.info("stopped during startup")
            return 0
        except LaunchError as exc:
            logger.error("%s", exc)
            return 1
        finally:
            self._stop_all()
            for s, handler in old.items():
                signal.signal(s, handler)

    def _serve(self) -> int:
        self._serving_since = time.monotonic()
        while True:
            dead = self._dead_role() or self._silent_role()
            if dead is not None:
                return self._fail(dead)
            if self._stop_signal is not None:
                return self._drain()
            self._poll(100)

    def _fail(self, dead: str) -> int:
        logger.error("%s: failing open requests and stopping the appliance", dead)
        role = dead.split(" (pid")[0]
        if role != "server" and self._procs["server"].exitcode is None:
            self._control.send(encode(Fatal(role, f"The appliance failed: {dead}.")))
            time.sleep(self.config.launch.fatal_grace_s)
        return 1

    def _drain(self) -> int:
        timeout = self.config.launch.drain_timeout_s
        logger.info(
            "signal %d: draining (up to %.0fs for open requests)", self._stop_signal, timeout
        )
        self._control.send(encode(Drain(timeout)))
        deadline = time.monotonic() + timeout + 10.0
        while time.monotonic() < deadline:
            dead = self._dead_role() or self._silent_role()
            if dead is not None:
                logger.warning("%s while draining", dead)
                return 1
            msg = self._poll(100)
            if isinstance(msg, Drained):
                logger.info("drained (%d requests aborted); stopping", msg.aborted)
                return 0
        logger.warning("server did not report drained in time; stopping anyway")
        return 0

    def _stop_all(self) -> None:
        procs = [p for p in self._procs.values() if p.exitcode is None]
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        self._remove_leftovers()
        self._inbox.close()
        self._control.close()

    def _remove_leftovers(self) -> None:
        """The run folder (ipc sockets) and any image embeddings a killed visual server left in
        shared memory: after every stop, the second signal's too."""
        visual = self._procs.get("visual")
        if visual is not None:
            from visual.cache import remove_leftover_segments

            if remove_leftover_segments(visual.pid):  # only after a crash: SIGTERM cleans up
                logger.warning("removed image embeddings the visual server left in shared memory")
        shutil.rmtree(self._run_dir, ignore_errors=True)


def resolved_backends(config: ServeConfig) -> dict[str, str]:
    """The kernel backend each op resolves to on this machine, as the workers will resolve it. The
    look-up is silent (a fallback warning is the worker's to give, once) and leaves CUDA
    uninitialised (device properties only, no context)."""
    from appliance_kernels.backends import resolve_backends

    requested = dict(envs.kernel_backends(), attention=config.engine.kernels.attention_backend)
    quiet = logging.getLogger("appliance_kernels.backends")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return resolve_backends(**requested)
    finally:
        quiet.setLevel(level)


def check_port(host: str, port: int) -> None:
    """Binds host:port the way uvicorn will (SO_REUSEADDR, every address the host resolves to)
    and lets go: a busy port fails here, in well under a second, instead of after the model
    loaded. Raises LaunchError naming host:port."""
    if port == 0:  # the OS picks a free one
        return
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise LaunchError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                reason = exc.strerror or str(exc)
                hint = {
                    errno.EADDRINUSE: " (another server? pick --port)",
                    errno.EADDRNOTAVAIL: " (not an address of this host: pick --host)",
                    errno.EACCES: " (a port below 1024 needs privileges: pick --port)",
                }.get(exc.errno, "")
                raise LaunchError(f"cannot listen on {where}: {reason}{hint}") from None


def preflight(config: ServeConfig) -> None:
    """What can fail before any process starts or any model loads: every APPLIANCE_* env flag
    (envs.validate) and the HTTP host:port. Raises LaunchError with one line."""
    try:
        envs.validate()
    except envs.EnvError as exc:
        raise LaunchError(str(exc)) from None
    check_port(config.server.host, config.server.port)
    parallel = config.engine.parallel
    if parallel.device == "cuda":  # (auto falls back to the CPU: no look-up needed)
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < parallel.tp:
            raise LaunchError(
                f"--device cuda --tp {parallel.tp}: {found} CUDA device(s) visible "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
            )


def serve(config: ServeConfig) -> int:
    """Runs the appliance in the foreground; returns the process exit code. The config's model_dir
    must already be resolved (no ""). Raises LaunchError when `preflight` fails."""
    preflight(config)
    return Launcher(config).run()
