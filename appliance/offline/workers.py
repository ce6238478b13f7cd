"""Worker processes for the offline `LLM` with tp > 1: the LLM's engine loop plays the router,
sending each StepPlan to every rank and reading rank 0's StepResult (the appliance's own seam).

Created by appliance/offline/llm.py; the workers are the appliance's (appliance/engine/worker.py).
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import weakref
from pathlib import Path

import zmq

from appliance.config import EngineConfig
from appliance.ipc import Addresses, read_failures, run_role, zmq_socket
from appliance.messages import (
    ProcessReady,
    StartupFailed,
    StepPlan,
    StepResult,
    ToLauncher,
    WorkerInfo,
    decoder,
    encode,
)


class WorkerError(RuntimeError):
    """A worker process died; the message names its rank and exit code."""


class WorkerGroup:
    """Worker processes for the offline `LLM` with tp > 1: the caller plays the router, sending each
    StepPlan to every rank and reading rank 0's StepResult (the same seam the appliance uses)."""

    def __init__(
        self,
        engine: EngineConfig,
        runner_path: str = "appliance.engine.runner:ModelRunner",
        reserved_bytes: int = 0,
    ):
        """`reserved_bytes`: device memory rank 0 (the ViT's device) leaves free for the ViT."""
        from appliance.engine.worker import run_worker

        self.tp = engine.parallel.tp
        self._run_dir = Path(tempfile.mkdtemp(prefix="appliance-llm-"))
        # an LLM never closed leaves no folder behind (collected, or at interpreter exit)
        weakref.finalize(self, shutil.rmtree, self._run_dir, True)
        self.addrs = Addresses.allocate("ipc", self.tp, self._run_dir)
        self._ctx = zmq.Context.instance()
        self._inbox = zmq_socket(self._ctx, zmq.PULL, self.addrs.launcher, bind=True)
        self._results = zmq_socket(self._ctx, zmq.PULL, self.addrs.router_results, bind=True)
        ctx = mp.get_context("spawn")
        self._procs = [
            ctx.Process(
                target=run_role,
                args=(run_worker, f"worker {r}", self.addrs.launcher)
                + (engine, self.addrs, r, self.tp, runner_path, reserved_bytes if r == 0 else 0),
                name=f"worker {r}",
                daemon=True,
            )
            for r in range(self.tp)
        ]
        for proc in self._procs:
            proc.start()
        self.info = self._wait_ready()
        self._plans = [zmq_socket(self._ctx, zmq.PUSH, a, bind=False) for a in self.addrs.workers]
        self._result_decoder = decoder(StepResult)

    def _wait_ready(self) -> WorkerInfo:
        dec, pending, info = decoder(ToLauncher), set(range(self.tp)), None
        failures: dict[str, str] = {}  # "worker r" -> the reason its StartupFailed gave
        while pending:
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
            if dead:
                read_failures(self._inbox, dec, failures)
                self.close()
                named = [(r, failures[f"worker {r}"]) for r, _ in dead if f"worker {r}" in failures]
                if named:
                    raise WorkerError(f"worker {named[0][0]} failed during startup: {named[0][1]}")
                raise WorkerError(
                    f"worker {dead[0][0]} exited with code {dead[0][1]} during startup"
                )
            if self._inbox.poll(100):
                msg = dec.decode(self._inbox.recv())
                if isinstance(msg, ProcessReady):
                    pending.discard(msg.rank)
                    info = msg.worker or info
                elif isinstance(msg, StartupFailed):
                    failures.setdefault(msg.role, msg.reason)
        assert info is not None
        return info

    def submit(self, plan: StepPlan) -> None:
        data = encode(plan)
        for sock in self._plans:
            sock.send(data)

    def collect(self) -> StepResult:
        while not self._results.poll(1000):
            dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
            if dead:
                raise WorkerError(
                    f"worker {dead[0]} died (exit code {self._procs[dead[0]].exitcode})"
                )
        return self._result_decoder.decode(self._results.recv())

    def close(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=10)
        shutil.rmtree(self._run_dir, ignore_errors=True)
