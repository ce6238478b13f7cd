"""The CPU compose stack for real: builds the images (ops/docker/local-images.sh, then
`docker-compose -f compose.yaml -f compose.cpu.yaml build`), brings the appliance and Prometheus up
under a unique project name on free loopback ports, sends an OpenAI vision chat through the
published port, reads the appliance's counters back from the Prometheus container's HTTP API, and
runs `down -v` whatever happens. Skipped only when no Docker client, daemon or docker-compose
answers, and failed instead under REQUIRE_DOCKER_E2E=1 (.ci/run installs and starts Debian's
docker.io and sets it).

Wall time on a 2-core dev VM: about 6 min from nothing (local base image 2 min, image builds 3 min),
45 s with the images cached (up, health, one chat, one scrape, down)."""

from __future__ import annotations

import base64
import io
import os
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.e2e.live import free_port

ROOT = Path(__file__).resolve().parents[2]
FILES = ("-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "compose.cpu.yaml"))
BUILD_TIMEOUT_S = 1200  # a cold build pulls ~1 GB of wheels and Debian packages
HEALTH_TIMEOUT_S = 300  # the embedded default model is built at first start
SCRAPE_TIMEOUT_S = 60  # Prometheus scrapes every 5 s (ops/prometheus/prometheus.yml)
MAX_TOKENS = 4


def docker_client() -> str | None:
    """Debian's client first: a static one elsewhere on PATH may lack the builder compose needs."""
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def why_no_docker() -> str | None:
    docker = docker_client()
    if docker is None:
        return "no docker CLI (apt-get install docker.io)"
    if shutil.which("docker-compose") is None:
        return "no docker-compose CLI (apt-get install docker-compose)"
    try:
        info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the docker daemon did not answer `docker info` within 30 s"
    if info.returncode != 0:
        said = (info.stderr + info.stdout).splitlines()  # 20.10 says why on stdout
        detail = next((line.strip() for line in said if "ERROR" in line), " ".join(said[-1:]))
        return f"no docker daemon answers `docker info` ({detail}); start dockerd"
    return None


_NO_DOCKER = why_no_docker()
# .ci/run sets REQUIRE_DOCKER_E2E=1 after installing and starting the engine: there a missing
# Docker is a failure, not a skip.
_DOCKER_REQUIRED = os.environ.get("REQUIRE_DOCKER_E2E") == "1"
pytestmark = pytest.mark.skipif(
    _NO_DOCKER is not None and not _DOCKER_REQUIRED, reason=str(_NO_DOCKER)
)


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    api_key: str
    app_url: str
    prom_url: str

    def compose(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker-compose", *FILES, "-p", self.project, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def must(self, what: str, *args: str, timeout: float = 120) -> str:
        result = self.compose(*args, timeout=timeout)
        assert result.returncode == 0, f"{what} failed:\n{_tail(result.stdout + result.stderr)}"
        return result.stdout

    def logs(self, service: str) -> str:
        return _tail(self.compose("logs", "--no-color", "--tail", "60", service).stdout)

    def container_state(self, service: str) -> str:
        """'running 0 0' style: status, restart count, last exit code ('' before it exists)."""
        ids = self.compose("ps", "-q", service).stdout.split()
        if not ids:
            return ""
        fmt = "{{.State.Status}} {{.RestartCount}} {{.State.ExitCode}}"
        inspect = [self.env["DOCKER"], "inspect", "-f", fmt, ids[0]]
        return subprocess.run(inspect, capture_output=True, text=True, timeout=30).stdout.strip()


def _tail(text: str, chars: int = 6000) -> str:
    return text[-chars:]


def _env(docker: str, models_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        # compose v1 builds through the `docker` on PATH (BuildKit: RUN --mount in Dockerfile.cpu).
        "PATH": f"{Path(docker).parent}:{os.environ.get('PATH', '')}",
        "DOCKER": docker,
        "DOCKER_BUILDKIT": "1",
        "COMPOSE_DOCKER_CLI_BUILD": "1",
        "APPLIANCE_BIND": "127.0.0.1",
        "APPLIANCE_PORT": str(free_port()),
        "PROMETHEUS_PORT": str(free_port()),
        "GRAFANA_PORT": str(free_port()),
        "APPLIANCE_API_KEY": "sk-" + secrets.token_hex(12),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(12),
        "MODELS_DIR": str(models_dir),  # not ./models in the checkout
        "CPU_MODEL": "",  # the embedded default model
    }


def wait_until(check: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return False


def wait_healthy(stack: Stack) -> None:
    """200 from /health through the published port; a container that exits or restarts (a broken
    command loops under `restart: unless-stopped`) fails at once with its logs."""

    def healthy() -> bool:
        state = stack.container_state("appliance")
        status, restarts = (state.split() + ["", "0"])[:2]
        assert status in ("", "created", "running") and restarts == "0", (
            f"the appliance container is {state!r}:\n{stack.logs('appliance')}"
        )
        try:
            return httpx.get(f"{stack.app_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    ok = wait_until(healthy, HEALTH_TIMEOUT_S)
    assert ok, f"no 200 from /health in {HEALTH_TIMEOUT_S} s:\n{stack.logs('appliance')}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    if _NO_DOCKER is not None:
        pytest.fail(f"REQUIRE_DOCKER_E2E=1 but {_NO_DOCKER}")
    docker = docker_client()
    assert docker is not None
    env = _env(docker, tmp_path_factory.mktemp("models"))
    stack = Stack(
        project=f"appliance-e2e-{uuid.uuid4().hex[:8]}",
        env=env,
        api_key=env["APPLIANCE_API_KEY"],
        app_url=f"http://127.0.0.1:{env['APPLIANCE_PORT']}",
        prom_url=f"http://127.0.0.1:{env['PROMETHEUS_PORT']}",
    )
    local = subprocess.run(
        [str(ROOT / "ops/docker/local-images.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        start_new_session=True,  # mmdebstrap's cleanup signals its whole process group
    )
    assert local.returncode == 0, f"local base images failed:\n{_tail(local.stdout + local.stderr)}"
    try:
        stack.must("image build", "build", timeout=BUILD_TIMEOUT_S)
        stack.must("compose up", "up", "-d", "--no-build")
        wait_healthy(stack)
        yield stack
    finally:
        down = stack.compose("down", "-v", "--remove-orphans", timeout=180)
        assert down.returncode == 0, _tail(down.stdout + down.stderr)


def png_data_url(width: int = 32, height: int = 24) -> str:
    image = Image.new("RGB", (width, height))
    image.putdata([(x * 8 % 256, y * 10 % 256, 128) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vision_chat(stack) -> dict:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": png_data_url()}},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    url = f"{stack.app_url}/v1/chat/completions"
    response = httpx.post(url, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_compose_healthcheck_passes_in_the_image(stack) -> None:
    """Docker's own health state (the compose healthcheck runs curl inside the image)."""
    ids = stack.compose("ps", "-q", "appliance").stdout.split()
    inspect = [stack.env["DOCKER"], "inspect", "-f", "{{.State.Health.Status}}", *ids]

    def docker_says_healthy() -> bool:
        return subprocess.run(inspect, capture_output=True, text=True).stdout.strip() == "healthy"

    assert wait_until(docker_says_healthy, 60), stack.logs("appliance")


def test_a_vision_chat_through_the_published_port(stack, vision_chat) -> None:
    choice = vision_chat["choices"][0]
    assert choice["finish_reason"] == "length"
    usage = vision_chat["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    # The image's tokens are in the prompt: far more than the text alone.
    assert usage["prompt_tokens"] > 10
    # The key compose requires is enforced through the published port.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    no_key = httpx.post(f"{stack.app_url}/v1/chat/completions", json=body, timeout=30)
    assert no_key.status_code == 401, no_key.text


def prom_query(stack: Stack, query: str) -> list[dict]:
    response = httpx.get(f"{stack.prom_url}/api/v1/query", params={"query": query}, timeout=10)
    response.raise_for_status()
    payload = response.json()
    assert payload["status"] == "success", payload
    return payload["data"]["result"]


def prom_value(stack: Stack, query: str) -> float | None:
    try:
        result = prom_query(stack, query)
    except httpx.HTTPError:
        return None
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_the_appliance_container(stack, vision_chat) -> None:
    finished = 'sum(appliance_requests_finished_total{job="appliance"})'
    tokens = 'sum(appliance_generation_tokens_total{job="appliance"})'
    encoded = 'sum(appliance_image_stage_seconds_count{job="appliance", stage="encode"})'

    def scraped_after_the_chat() -> bool:
        return (prom_value(stack, finished) or 0) >= 1

    if not wait_until(scraped_after_the_chat, SCRAPE_TIMEOUT_S):
        targets = httpx.get(f"{stack.prom_url}/api/v1/targets", timeout=10).text
        pytest.fail(
            f"Prometheus never saw the chat: targets {targets[:2000]}\n{stack.logs('prometheus')}"
        )
    # Only this test's requests reached the appliance: one vision chat of MAX_TOKENS tokens
    # (the 401 above never reaches the engine).
    assert prom_value(stack, finished) == 1
    assert prom_value(stack, tokens) == MAX_TOKENS
    assert prom_value(stack, encoded) == 1  # the image went through the visual encoder
    up = prom_query(stack, 'up{job="appliance"}')
    assert [(s["metric"]["instance"], s["value"][1]) for s in up] == [("appliance:8000", "1")]
