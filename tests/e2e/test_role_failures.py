"""Every role of a live appliance killed (SIGKILL) or frozen (SIGSTOP) while a stream is open: the
stream ends with an error within 10 s, /health stops answering 200, the launcher exits non-zero
naming the role, and no role process or shared-memory segment is left behind.

One appliance start per case on the tiny dense model (--no-vision unless the visual server is the
role under test; --tp 2 for the worker cases). A frozen role is caught by its missing heartbeats
(APPLIANCE_HEARTBEAT_TIMEOUT, 3 s here). Wall time on 2 cores: 9-20 s per case, 2.5-4 min
for the 12.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from tests.e2e.live import start_appliance
from visual.cache import SEGMENT_PREFIX

HEARTBEAT_TIMEOUT_S = 3
MAX_MODEL_LEN = 4096  # room for BODY's max_tokens
ROLES = ["server", "detokenizer", "router", "worker 0", "worker 1", "visual"]
BODY = {
    "messages": [{"role": "user", "content": "count to ten"}],
    # long enough to outlast a frozen role's detection (3 s + a heartbeat period) on a fast
    # machine: 400 tokens once finished first (a "done" stream); failures end it early anyway
    "max_tokens": 4000,
    "stream": True,
    "ignore_eos": True,
    "chat_template_kwargs": {"enable_thinking": False},
}
SHM = Path("/dev/shm")
_PIXELS = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
_PNG = io.BytesIO()
Image.fromarray(_PIXELS).save(_PNG, "PNG")
IMAGE_BODY = {
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this"},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": f"data:image/png;base64,{base64.b64encode(_PNG.getvalue()).decode()}"
                    },
                },
            ],
        }
    ],
    "max_tokens": 2,
}


def _stream(url: str, started: threading.Event, outcome: dict) -> None:
    """Reads one SSE stream; `outcome` gets the time and kind of its end: "error" (an error event,
    or the connection broke) or "done" (a normal finish, which must not happen here)."""
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=BODY, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    outcome.update(kind="done")
                    break
                if line.startswith("data: "):
                    started.set()
                    if "error" in json.loads(line[6:]):
                        outcome.update(kind="error", text=line)
                        break
            else:
                outcome.setdefault("kind", "error")  # the body ended without [DONE]
    except httpx.HTTPError as exc:
        outcome.update(kind="error", text=repr(exc))
    finally:
        outcome["at"] = time.monotonic()
        started.set()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.replace(" ", ""))
def test_role_failure_fails_streams_health_and_launcher(tiny_dense, tmp_path, role, signum):
    args = ["--tp", "2"] if role.startswith("worker") else []
    if role != "visual":
        args.append("--no-vision")
    shm_before = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()
    app = start_appliance(
        tiny_dense,
        tmp_path / "appliance.log",
        *args,
        max_model_len=MAX_MODEL_LEN,
        env={"APPLIANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S)},
    )
    pids = {who: int(pid) for who, pid in re.findall(r"\ds\] (.+?) ready \(pid (\d+)", app.log())}
    target = pids[role]
    try:
        if role == "visual":  # an image in the shared-memory cache, for the leak check below
            resp = httpx.post(f"{app.url}/v1/chat/completions", json=IMAGE_BODY, timeout=60)
            assert resp.status_code == 200, resp.text
            segments = [p.name for p in SHM.iterdir() if p.name.startswith(SEGMENT_PREFIX)]
            assert any(str(target) in name for name in segments), segments
        started, outcome = threading.Event(), {}
        reader = threading.Thread(target=_stream, args=(app.url, started, outcome), daemon=True)
        reader.start()
        assert started.wait(30), "the stream never started"
        assert "kind" not in outcome, outcome
        t0 = time.monotonic()
        os.kill(target, signum)
        reader.join(30)
        assert outcome.get("kind") == "error", outcome
        stream_s = outcome["at"] - t0
        assert stream_s < 10, f"the stream ended {stream_s:.1f}s after the {role} failed"
        if role != "server":  # a dead server's streams just break
            assert role in outcome.get("text", ""), outcome
        while _healthy(app.url) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not _healthy(app.url)
        code = app.proc.wait(30)
        exit_s = time.monotonic() - t0
        log = app.log()
        assert code != 0, log[-3000:]
        assert f"{role} (pid {target})" in log, log[-3000:]
        how = "stopped answering" if signum == signal.SIGSTOP else "exited with code -9"
        assert how in log, log[-3000:]
        # another role's death is named by the launcher; no role adds a traceback to it
        # (a TP peer's failed collective is one line)
        assert "Traceback" not in log, log[log.find("Traceback") :][-2000:]
        left = [pid for pid in pids.values() if _alive(pid)]
        assert not left, f"left running: {left}"
        shm_after = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()
        leaked = [n for n in shm_after - shm_before if any(str(p) in n for p in pids.values())]
        assert not leaked, f"left in /dev/shm: {leaked}"
        name = signal.Signals(signum).name
        print(f"{role} {name}: stream error after {stream_s:.1f}s, launcher exit {exit_s:.1f}s")
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        app.stop()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_launcher_leaves_no_role_run_folder_or_segment(tiny_dense, tmp_path):
    """`kill -9` of the launcher itself (the OOM killer, a supervisor's hard stop): every role
    notices within a second and exits, the server removing the run folder (its ipc sockets) and
    the visual server its image embeddings in shared memory, which the launcher would have
    removed after them."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    app = start_appliance(tiny_dense, tmp_path / "appliance.log", env={"TMPDIR": str(temp)})
    pids = {who: int(pid) for who, pid in re.findall(r"\ds\] (.+?) ready \(pid (\d+)", app.log())}
    try:
        assert "visual" in pids, app.log()[-2000:]
        assert [p.name for p in temp.iterdir() if p.name.startswith("appliance-")]
        resp = httpx.post(f"{app.url}/v1/chat/completions", json=IMAGE_BODY, timeout=60)
        assert resp.status_code == 200, resp.text
        mine = f"{SEGMENT_PREFIX}{pids['visual']}_"
        assert [p for p in SHM.iterdir() if p.name.startswith(mine)]
        app.proc.kill()
        app.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [who for who, pid in pids.items() if _alive(pid)]
        assert not [p.name for p in temp.iterdir() if p.name.startswith("appliance-")]
        assert not [p.name for p in SHM.iterdir() if p.name.startswith(mine)]
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        app.stop()
