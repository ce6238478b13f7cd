"""Helpers for live-appliance tests: `appliance serve` started as a real subprocess (launcher +
roles) on 127.0.0.1, polled until healthy, stopped with SIGTERM. Used by tests/e2e/conftest.py and
tests."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300  # a loaded 2-core CI box imports torch/transformers in four processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveAppliance:
    proc: subprocess.Popen
    port: int
    log_path: pathlib.Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def role_pid(self, role: str) -> int:
        """PID of a role from the launcher's "<role> ready (pid N, ...)" line."""
        for line in self.log().splitlines():
            if f"] {role} ready (pid " in line:
                return int(line.split("(pid ")[1].split(",")[0])
        raise AssertionError(f"no ready line for {role}:\n{self.log()}")

    def status(self) -> dict:
        return httpx.get(f"{self.url}/debug/status", timeout=10).json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """Polls /debug/status until no request holds a KV or state slot; returns the status."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            router = status["router"]
            if (
                router["kv_used"] == 0
                and router["state_used"] == 0
                and router["num_running"] == 0
                and router["num_waiting"] == 0
            ):
                return status
            if time.monotonic() > deadline:
                return status
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def start_appliance(
    model_dir: pathlib.Path | None,
    log_path: pathlib.Path,
    *args: str,
    max_model_len: int = 512,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> LiveAppliance:
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "appliance.cli",
        "serve",
        *([str(model_dir)] if model_dir is not None else []),  # None: the embedded default
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-model-len",
        str(max_model_len),
        *args,
    ]
    env = {
        **os.environ,
        "APPLIANCE_LOG_STATS_INTERVAL": "0",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    app = LiveAppliance(proc, port, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"appliance exited with {proc.returncode}:\n{app.log()}")
        try:
            if httpx.get(f"{app.url}/health", timeout=2).status_code == 200:
                return app
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            app.stop()
            raise AssertionError(f"appliance not ready in {STARTUP_TIMEOUT_S}s:\n{app.log()}")
        time.sleep(0.25)
