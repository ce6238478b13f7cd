"""A real Prometheus (Debian's package) scrapes the live appliance's /metrics with the shipped
scrape config (target rewritten to the test port); values read back through Prometheus's HTTP API
equal what the test sent, and every series the Grafana dashboard queries is live in /metrics."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
import yaml

from tests.ops.test_grafana import SERIES_RE, dashboard_queries
from tests.ops.test_prometheus import DASHBOARD, SCRAPE_CONFIG, free_port, scalar, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Debian's prometheus package"
)
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exposed_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            names.update(name + s for s in SUFFIXES)
    return names


def test_prometheus_scrapes_the_live_appliance(appliance, tmp_path):
    for i in range(3):
        body = {
            "messages": [{"role": "user", "content": f"hi {i}"}],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        assert (
            httpx.post(f"{appliance.url}/v1/chat/completions", json=body, timeout=60).status_code
            == 200
        )
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    job = config["scrape_configs"][0]
    job["scrape_timeout"] = "1s"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{appliance.port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "w"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        finished = 'sum(appliance_requests_finished_total{job="appliance"})'
        assert wait_for(lambda: scalar(base, finished) == 3, 60)
        usage = scalar(base, 'sum(appliance_generation_tokens_total{job="appliance"})')
        assert usage == 12  # 3 requests x max_tokens 4 (ignore_eos)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    live = exposed_names(httpx.get(f"{appliance.url}/metrics").text)
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = {n for q in dashboard_queries(dashboard) for n in SERIES_RE.findall(q)}
    assert wanted and not (wanted - live), sorted(wanted - live)
