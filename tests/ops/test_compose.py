"""compose.yaml (+ compose.override.yaml on GPU hosts, compose.cpu.yaml on CPU hosts) and the
Dockerfiles: keys operators rely on, env flags, compose's own check of each variant."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from appliance import envs

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
GPU_OVERRIDE = ROOT / "compose.override.yaml"  # merged by a plain `docker compose up`
CPU_OVERRIDE = ROOT / "compose.cpu.yaml"  # `-f compose.yaml -f compose.cpu.yaml`
CPU_DOCKERFILE = ROOT / "ops/docker/Dockerfile.cpu"
DOCKERFILE = ROOT / "ops/Dockerfile"
DEFAULT_RE = re.compile(r"^\$\{(?P<name>\w+):-(?P<default>.*)\}$")
REQUIRED_RE = re.compile(r"^\$\{(?P<name>\w+):\?.+\}$")  # compose refuses to start without it
REQUIRED = {"APPLIANCE_API_KEY"}  # secrets without a default (docs/operations.md, Security)
SECRETS_ENV = {"APPLIANCE_API_KEY": "sk-test", "GRAFANA_ADMIN_PASSWORD": "pw-test"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_appliance_service_gpu_shm_health_restart(compose) -> None:
    app = compose["services"]["appliance"]
    # The GPU block is in the override a plain `up` reads: a CPU variant could not remove it.
    assert "deploy" not in app
    gpu = yaml.safe_load(GPU_OVERRIDE.read_text())["services"]["appliance"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert gpu["ulimits"] == {"memlock": -1}
    assert app["ipc"] == "host"
    assert app["ulimits"] == {"stack": 67108864}
    health = app["healthcheck"]
    assert health["test"] == ["CMD", "curl", "-fsS", "http://localhost:8000/health"]
    assert health["start_period"] == "600s"
    assert app["restart"] == "unless-stopped"
    assert app["ports"] == ["${APPLIANCE_BIND:-127.0.0.1}:${APPLIANCE_PORT:-8000}:8000"]
    assert app["build"] == {"context": ".", "dockerfile": "ops/Dockerfile"}


def test_model_volume_is_read_only(compose) -> None:
    volumes = compose["services"]["appliance"]["volumes"]
    assert "${MODELS_DIR:-./models}:/models:ro" in volumes
    assert set(compose["volumes"]) >= {"hf-cache", "prometheus-data", "grafana-data"}


def test_every_env_flag_is_passed_with_its_default(compose) -> None:
    env = compose["services"]["appliance"]["environment"]
    for name, var in envs.registry().items():
        assert name in env, f"{name} missing from compose.yaml appliance.environment"
        if name in REQUIRED:
            match = REQUIRED_RE.match(env[name])
            assert match and match["name"] == name, env[name]
            continue
        match = DEFAULT_RE.match(env[name])
        assert match and match["name"] == name, env[name]
        default = match["default"]
        parsed = var.default if default == "" else var.parse(default)
        assert parsed == var.default, f"{name}: compose default {default!r} != {var.default!r}"


def test_monitoring_services_mount_the_shipped_configs(compose) -> None:
    prom = compose["services"]["prometheus"]
    assert "./ops/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    graf = compose["services"]["grafana"]
    assert "./ops/grafana/provisioning:/etc/grafana/provisioning:ro" in graf["volumes"]
    assert "./ops/grafana/dashboards:/var/lib/grafana/dashboards:ro" in graf["volumes"]
    for rel in (
        "ops/prometheus/prometheus.yml",
        "ops/grafana/provisioning",
        "ops/grafana/dashboards/appliance.json",
    ):
        assert (ROOT / rel).exists(), rel
    scrape = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())
    job = scrape["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["appliance:8000"]


def test_dockerfile_base_entrypoint_and_health() -> None:
    text = (ROOT / "ops/Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:13\.\d+\.\d+-devel-ubuntu24\.04$", text, re.M)
    assert "download.pytorch.org/whl/cu130" in text
    assert 'ENTRYPOINT ["appliance", "serve"]' in text
    assert "HEALTHCHECK" in text and "--start-period=600s" in text
    assert "python3.12" in text


def compose_config(*files: Path) -> dict:
    """`docker-compose [-f FILE]... config`, resolved; no files = what a plain `up` reads."""
    flags = [arg for f in files for arg in ("-f", str(f))]
    result = subprocess.run(
        ["docker-compose", *flags, "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **SECRETS_ENV},
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="needs Debian's docker-compose package (apt-get install docker-compose)",
)


@needs_compose
def test_docker_compose_config_accepts_the_file() -> None:
    app = compose_config(COMPOSE)["services"]["appliance"]
    assert app["healthcheck"]["start_period"] in ("10m", "600s", "10m0s")
    assert app["environment"]["APPLIANCE_LOG_STATS_INTERVAL"] == "10"
    assert "deploy" not in app  # the GPU block comes from compose.override.yaml


@needs_compose
def test_a_plain_up_reserves_the_gpus() -> None:
    """No -f: compose reads compose.yaml and merges compose.override.yaml (v1.28+ and v2 alike)."""
    app = compose_config()["services"]["appliance"]
    devices = app["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert app["ulimits"] == {"memlock": -1, "stack": 67108864}
    assert app["build"]["dockerfile"] == "ops/Dockerfile"


@needs_compose
def test_the_cpu_variant_has_no_gpu_settings() -> None:
    resolved = compose_config(COMPOSE, CPU_OVERRIDE)
    app = resolved["services"]["appliance"]
    assert "deploy" not in app and "memlock" not in app["ulimits"]  # memlock -1 fails on VMs
    assert app["build"]["dockerfile"] == "ops/docker/Dockerfile.cpu"
    assert app["command"] == ["", "--host", "0.0.0.0", "--port", "8000"]
    # Everything else is the base file's: keys, env flags, volumes, ports.
    base = compose_config(COMPOSE)["services"]["appliance"]
    for key in ("environment", "ports", "ipc", "restart"):
        assert app[key] == base[key], key
    assert sorted(app["volumes"]) == sorted(base["volumes"])  # merged in another order
    prom = resolved["services"]["prometheus"]
    assert prom["build"]["dockerfile"] == "Dockerfile.prometheus"
    assert prom["command"] == compose_config(COMPOSE)["services"]["prometheus"]["command"]
    assert resolved["services"]["grafana"]["profiles"] == ["grafana"]


def _command(path: Path) -> list[str]:
    return yaml.safe_load(path.read_text())["services"]["appliance"]["command"]


@pytest.mark.parametrize(
    ("compose_file", "dockerfile", "model_dir"),
    [
        (COMPOSE, DOCKERFILE, "/models/Qwen3.5-27B-FP8"),
        (CPU_OVERRIDE, CPU_DOCKERFILE, ""),  # "" = the embedded default model
    ],
    ids=["gpu", "cpu"],
)
def test_the_appliance_command_parses(compose_file, dockerfile, model_dir) -> None:
    """The service's command, after the image's entrypoint (`appliance serve`) and with compose's
    defaults substituted, is accepted by the real CLI parser (a bad flag once made compose loop)."""
    from appliance.cli import build_parser

    def substitute(arg: str) -> str:
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), str(arg))

    entrypoint = re.search(r'^ENTRYPOINT \["appliance", "serve"\]', dockerfile.read_text(), re.M)
    assert entrypoint, f"{dockerfile.name}'s entrypoint is no longer `appliance serve`"
    argv = ["serve", *[substitute(a) for a in _command(compose_file)]]
    parser, _ = build_parser()
    args = parser.parse_args(argv)  # exits (SystemExit) on an unknown flag
    assert args.model_dir == model_dir and args.tp in (1, None) and args.port == 8000
    assert args.host == "0.0.0.0"
