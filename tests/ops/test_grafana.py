"""The Grafana dashboard: in sync with its generator; every series it reads is in metrics.py."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import yaml

from appliance.metrics import MetricsRecorder

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops/grafana/dashboards/appliance.json"
SERIES_RE = re.compile(r"\b(appliance_[a-z0-9_]+)\b")


def load_builder():
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", ROOT / "ops/grafana/build_dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            queries.append(var["query"]["query"])
    return queries


def test_committed_json_matches_the_generator() -> None:
    assert DASHBOARD.read_text() == load_builder().render(), (
        "run: python ops/grafana/build_dashboard.py"
    )


def test_every_referenced_series_is_defined() -> None:
    defined = MetricsRecorder("m").sample_names()
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    referenced = {name for q in queries for name in SERIES_RE.findall(q)}
    assert len(referenced) >= 20
    assert not referenced - defined, sorted(referenced - defined)
    # Raw counters are only read through rate(); histograms only through _bucket/_sum/_count.
    for q in queries:
        for name in SERIES_RE.findall(q):
            if name.endswith("_total") and "label_values" not in q:
                assert f"rate({name}" in q, q


def test_required_panels_are_present() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    text = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in panels}
    want = {
        "Requests finished / s by reason": "appliance_requests_finished_total",
        "HTTP responses / s by status": "appliance_http_requests_total",
        "Tokens / s": "appliance_generation_tokens_total",
        "Time to first token": "histogram_quantile(0.99",
        "Inter-token latency / time per output token": "appliance_inter_token_latency_seconds",
        "Requests running / waiting / in frontend": "appliance_num_requests_waiting",
        "KV cache and linear-state usage": "appliance_linear_state_usage_ratio",
        "Image embedding cache hit rate": "appliance_mm_cache_queries_total",
        "MTP acceptance per draft position": "by (position)",
        "Image stage latency": "by (le, stage)",
    }
    for title, fragment in want.items():
        assert fragment in text[title], title
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def test_provisioning_points_at_the_dashboard_and_datasource() -> None:
    prov = ROOT / "ops/grafana/provisioning"
    ds = yaml.safe_load((prov / "datasources/prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((prov / "dashboards/appliance.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads(DASHBOARD.read_text())
    ds_var = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert ds_var["current"]["value"] == ds["uid"]
