"""A real Prometheus (Debian's package) scrapes a MetricsRecorder served over HTTP on 127.0.0.1:
promtool accepts the shipped scrape config, values read back through the HTTP API equal what was
recorded, and every Grafana dashboard query evaluates without error."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from appliance.metrics import MetricsRecorder

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "ops/prometheus/prometheus.yml"
DASHBOARD = ROOT / "ops/grafana/dashboards/appliance.json"

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="needs Debian's prometheus package (apt-get install prometheus)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_promtool_accepts_the_shipped_scrape_config() -> None:
    result = subprocess.run(
        ["promtool", "check", "config", str(SCRAPE_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture()
def served_recorder():
    recorder = MetricsRecorder("qwen-test")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path != "/metrics":
                self.send_error(404)
                return
            body, content_type = recorder.render()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield recorder, server.server_address[1]
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def run_prometheus(tmp_path: Path, target_port: int):
    """A real Prometheus on 127.0.0.1 scraping 127.0.0.1:target_port every second with the shipped
    scrape config; yields its base URL."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    job = config["scrape_configs"][0]
    job["scrape_timeout"] = "1s"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
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
        wait_for(lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=1).status == 200, 30)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture()
def prometheus(tmp_path, served_recorder):
    recorder, target_port = served_recorder
    with run_prometheus(tmp_path, target_port) as base:
        yield recorder, base


def wait_for(check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.25)


def query(base: str, promql: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:  # 400 on a bad query: return its error body
        return json.loads(err.read())


def scalar(base: str, promql: str) -> float | None:
    result = query(base, promql)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def record_requests(recorder: MetricsRecorder, count: int, start: int) -> None:
    for i in range(start, start + count):
        rid = f"r{i}"
        recorder.on_first_token(rid, ttft_s=0.05, prompt_tokens=12)
        recorder.on_tokens(rid, num_tokens=3, interval_s=0.03)
        recorder.on_request_finished(
            rid,
            "stop",
            e2e_s=0.08,
            prompt_tokens=12,
            generation_tokens=4,
            ttft_s=0.05,
            queue_time_s=0.001,
        )


def test_prometheus_scrapes_values_and_dashboard_queries_evaluate(prometheus) -> None:
    recorder, base = prometheus
    record_requests(recorder, 3, 0)
    recorder.apply_router_stats(
        {
            "num_running": 2,
            "num_waiting": 1,
            "kv_usage": 0.5,
            "mtp_drafts": 10,
            "mtp_accepted_tokens": 12,
            "mtp_accepted_per_position": [8, 4],
        }
    )
    sel = '{job="appliance",model_name="qwen-test"}'
    wait_for(lambda: scalar(base, f"appliance_prompt_tokens_total{sel}") == 36, 30)
    assert scalar(base, f"appliance_generation_tokens_total{sel}") == 12
    assert scalar(base, f"appliance_num_requests_running{sel}") == 2
    assert scalar(base, 'appliance_requests_finished_total{finish_reason="stop"}') == 3
    assert scalar(base, f"appliance_time_to_first_token_seconds_count{sel}") == 3

    # A second batch after Prometheus has seen the first: rates and quantiles have data.
    time.sleep(1.5)
    record_requests(recorder, 5, 3)
    recorder.apply_router_stats(
        {
            "mtp_drafts": 20,
            "mtp_accepted_tokens": 24,
            "mtp_accepted_per_position": [16, 8],
        }
    )
    wait_for(lambda: scalar(base, f"appliance_prompt_tokens_total{sel}") == 96, 30)
    time.sleep(1.5)
    p50 = scalar(
        base,
        "histogram_quantile(0.5, sum by (le) "
        "(rate(appliance_time_to_first_token_seconds_bucket[1m])))",
    )
    assert p50 is not None and 0.04 < p50 <= 0.06
    assert scalar(base, f"appliance_mtp_drafts_total{sel}") == 20
    assert scalar(base, f"appliance_mtp_accepted_tokens_total{sel}") == 24
    assert scalar(base, 'appliance_mtp_accepted_tokens_per_position_total{position="1"}') == 8
    # rate() extrapolates to the window edges, so the ratio is only near the true 12/10.
    accepted_per_draft = scalar(
        base,
        "sum(rate(appliance_mtp_accepted_tokens_total[1m])) / "
        "sum(rate(appliance_mtp_drafts_total[1m]))",
    )
    assert accepted_per_draft is not None and 0.7 < accepted_per_draft < 1.8

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    with_data = 0
    for expr in exprs:
        promql = expr.replace("$model_name", ".*").replace("$__rate_interval", "1m")
        answer = query(base, promql)
        assert answer["status"] == "success", (expr, answer.get("error"))
        with_data += bool(answer["data"]["result"])
    assert with_data >= len(exprs) - 3, (with_data, len(exprs))
