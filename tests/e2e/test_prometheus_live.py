"""A real Prometheus (Debian's package) scrapes the live appliance's /metrics with the shipped
scrape config (target rewritten to the test port); values read back through Prometheus's HTTP API
equal what the test sent, and every series the Grafana dashboard queries is live in /metrics."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.ops.test_grafana import SERIES_RE, dashboard_queries
from tests.ops.test_prometheus import DASHBOARD, run_prometheus, scalar, wait_for

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
    with run_prometheus(tmp_path, appliance.port) as base:
        finished = 'sum(appliance_requests_finished_total{job="appliance"})'
        assert wait_for(lambda: scalar(base, finished) == 3, 60)
        usage = scalar(base, 'sum(appliance_generation_tokens_total{job="appliance"})')
        assert usage == 12  # 3 requests x max_tokens 4 (ignore_eos)
    live = exposed_names(httpx.get(f"{appliance.url}/metrics").text)
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = {n for q in dashboard_queries(dashboard) for n in SERIES_RE.findall(q)}
    assert wanted and not (wanted - live), sorted(wanted - live)
