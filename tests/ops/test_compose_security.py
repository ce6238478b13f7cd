"""compose.yaml's security defaults: ports on 127.0.0.1 unless APPLIANCE_BIND says otherwise, an
API key and a Grafana admin password that must be set, no anonymous Grafana viewers."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from tests.ops.test_compose import COMPOSE, ROOT, SECRETS_ENV

BIND = "${APPLIANCE_BIND:-127.0.0.1}:"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_every_published_port_binds_loopback_by_default(services) -> None:
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith(BIND), f"{name} publishes {port} on every interface"


def test_the_api_key_and_grafana_password_are_required(services) -> None:
    app_env = services["appliance"]["environment"]
    assert app_env["APPLIANCE_API_KEY"].startswith("${APPLIANCE_API_KEY:?")
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana
    assert grafana["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert "--api-key" not in services["appliance"]["command"]  # keys stay out of `ps`


def _compose_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="needs Debian's docker-compose package (apt-get install docker-compose)",
)
def test_compose_resolves_secrets_and_binds() -> None:
    base = {k: v for k, v in os.environ.items() if k not in SECRETS_ENV and k != "APPLIANCE_BIND"}
    for missing in SECRETS_ENV:
        env = {**base, **{k: v for k, v in SECRETS_ENV.items() if k != missing}}
        result = _compose_config(env)
        assert result.returncode != 0 and missing in result.stderr, result.stderr
    resolved = yaml.safe_load(_compose_config({**base, **SECRETS_ENV}).stdout)["services"]
    assert resolved["appliance"]["environment"]["APPLIANCE_API_KEY"] == "sk-test"
    assert resolved["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "pw-test"
    assert "127.0.0.1:8000:8000" in str(resolved["appliance"]["ports"])
    opened = _compose_config({**base, **SECRETS_ENV, "APPLIANCE_BIND": "0.0.0.0"}).stdout
    assert "0.0.0.0:8000:8000" in str(yaml.safe_load(opened)["services"]["appliance"]["ports"])
