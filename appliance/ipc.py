"""Role plumbing: the ZMQ addresses of one appliance, socket setup, the first call every spawned
role makes (`child_init`) and its link back to the launcher (`RoleLink`).

Imported by every role process and by the launcher; imports nothing of the roles.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from appliance.logging import get_logger, setup_logging
from appliance.messages import (
    Heartbeat,
    ProcessReady,
    StartupFailed,
    StartupProgress,
    VisualInfo,
    WorkerInfo,
    encode,
)

HEARTBEAT_INTERVAL_S = 1.0  # a role's heartbeat period; the launcher's deadline is in envs
FAILURE_LINGER_MS = 2000  # how long a failing role waits for its StartupFailed to leave

logger = get_logger(__name__)
_ready = False  # this process sent its ProcessReady: a later exception is a fault, shown whole


@dataclass(frozen=True)
class Addresses:
    """ZMQ endpoints of every role; each PULL socket is bound by its owner, peers connect PUSH."""

    launcher: str  # launcher PULL: ProcessReady / StartupProgress / Drained from every role
    server_control: str  # server PULL: EngineReady / Drain / Fatal from the launcher
    server: str  # server PULL: DetokOutput from the detokenizer
    router: str  # router PULL: TokenizedRequest / AbortRequest / StatusQuery / FinishRequest
    router_results: str  # router PULL: StepResult from worker rank 0
    detokenizer: str  # detokenizer PULL: RouterOutput from the router
    workers: list[str] = field(default_factory=list)  # worker rank r PULL: StepPlan from the router
    dist_init: str = ""  # torch.distributed init_method (file:// in the run dir)
    # visual PULL: what the server sends the router (relayed) and ReleaseImages from the router
    visual: str = ""

    @classmethod
    def allocate(cls, transport: str, tp: int, run_dir: Path) -> Addresses:
        names = ["launcher", "server_control", "server", "router", "router_results", "detokenizer"]
        names.append("visual")
        names += [f"worker{r}" for r in range(tp)]
        if transport == "ipc":
            addr = {n: f"ipc://{run_dir}/{n}" for n in names}
        else:
            addr = {n: f"tcp://127.0.0.1:{_free_port()}" for n in names}
        return cls(
            addr["launcher"],
            addr["server_control"],
            addr["server"],
            addr["router"],
            addr["router_results"],
            addr["detokenizer"],
            [addr[f"worker{r}"] for r in range(tp)],
            f"file://{run_dir}/dist_init",
            addr["visual"],
        )

    @property
    def run_dir(self) -> Path | None:
        """The launcher's run folder (the ipc sockets and dist_init file live there)."""
        return Path(self.dist_init.removeprefix("file://")).parent if self.dist_init else None

    def remove_run_dir(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def for_server(self, with_visual: bool) -> Addresses:
        """The server's view: with a visual server, its engine socket ("router") is the visual
        server's inbox, which relays text-only traffic and encodes images on the way."""
        return dataclasses.replace(self, router=self.visual) if with_visual else self


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zmq_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    else:
        sock.setsockopt(zmq.SNDHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def child_init(role: str, on_orphan: Callable[[], object] | None = None) -> None:
    """First call in every spawned role: logging, signals, and exit if the launcher disappears.

    Each role runs in its own session, so signals sent to the launcher's process group (Ctrl-C,
    `timeout`, a supervisor) reach only the launcher, which drains and then stops the roles with
    SIGTERM (default action: exit). A role whose launcher vanished (`kill -9`, the OOM killer)
    runs `on_orphan` (what the launcher would have removed after it: the run folder, shared
    memory) and exits within a second.
    """
    mp.current_process().name = role
    _set_process_title(f"appliance-{role.replace(' ', '')}")
    setup_logging()
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch_parent() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                if on_orphan is not None:
                    try:
                        on_orphan()
                    except Exception:  # exiting regardless; nothing to report it to
                        pass
                os._exit(1)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()


def _set_process_title(title: str) -> None:
    """The role's name in ps/top (/proc/PID/comm, 15 characters); best effort, Linux only."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, title.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def is_startup_failure(exc: BaseException) -> bool:
    """Whether `exc`, raised while a role starts, is a fact about its input or machine (a checkpoint
    that does not match the model, an unsupported option or file, too little host or device
    memory), said in one line, rather than a fault in the code, whose traceback is wanted."""
    return (
        isinstance(exc, (ValueError, OSError, MemoryError))
        or type(exc).__name__ == "OutOfMemoryError"  # torch's, a RuntimeError
    )


def run_role(target, role: str, launcher: str, *args) -> None:
    """Every spawned role's entry: `target(*args)`. An exception `is_startup_failure` names, raised
    before the role was ready, goes to the launcher as one StartupFailed line and the process
    exits 1 without a traceback (APPLIANCE_LOG_LEVEL=debug logs it); anything else propagates and
    multiprocessing prints it whole."""
    try:
        target(*args)
    except Exception as exc:
        if _ready or not is_startup_failure(exc):
            raise
        logger.debug("%s failed during startup", role, exc_info=True)
        sock = zmq_socket(zmq.Context.instance(), zmq.PUSH, launcher, bind=False)
        sock.setsockopt(zmq.LINGER, FAILURE_LINGER_MS)  # close() waits until it is delivered
        sock.send(encode(StartupFailed(role, f"{type(exc).__name__}: {exc}")))
        sock.close()
        sys.exit(1)


def read_failures(sock: zmq.Socket, dec, failures: dict[str, str], wait_ms: int = 50) -> None:
    """Reads what `sock` (a launcher's inbox) holds, waiting up to `wait_ms` for each next message,
    keeping each StartupFailed's reason by role; the rest is dropped (a role died: the caller is
    failing). A failing role sends its reason just before it exits (run_role)."""
    while sock.poll(wait_ms):
        msg = dec.decode(sock.recv())
        if isinstance(msg, StartupFailed):
            failures.setdefault(msg.role, msg.reason)


class RoleLink:
    """A role's PUSH socket to the launcher: progress lines and the ready message; and, from its
    own thread and socket, a Heartbeat every HEARTBEAT_INTERVAL_S. The thread beats while the main
    thread computes (a long step releases the GIL); a stopped or hung process beats no more."""

    def __init__(self, address: str, role: str, rank: int = 0) -> None:
        self.role, self.rank = role, rank
        self._ctx = zmq.Context.instance()
        self._sock = zmq_socket(self._ctx, zmq.PUSH, address, bind=False)
        beat = zmq_socket(self._ctx, zmq.PUSH, address, bind=False)
        threading.Thread(target=self._beat, args=(beat,), name="heartbeat", daemon=True).start()

    def _beat(self, sock: zmq.Socket) -> None:
        wire = encode(Heartbeat(self.role, self.rank))
        while True:
            sock.send(wire)
            time.sleep(HEARTBEAT_INTERVAL_S)

    def progress(self, stage: str) -> None:
        self._sock.send(encode(StartupProgress(self.role, self.rank, stage)))

    def ready(
        self, worker: WorkerInfo | None = None, visual: VisualInfo | None = None, port: int = 0
    ) -> None:
        global _ready
        _ready = True
        msg = ProcessReady(self.role, self.rank, os.getpid(), worker, visual, port)
        self._sock.send(encode(msg))

    def send(self, msg) -> None:
        self._sock.send(encode(msg))
