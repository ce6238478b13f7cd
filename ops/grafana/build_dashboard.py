"""Writes ops/grafana/dashboards/appliance.json, the Grafana dashboard compose provisions.

Run `python ops/grafana/build_dashboard.py` after changing a panel; tests/ops/test_grafana.py checks
the committed JSON equals this output and uses only series that appliance/metrics.py defines.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "dashboards" / "appliance.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{model_name=~"$model_name"}'
RI = "[$__rate_interval]"


def rate(series: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({series}{SEL}{RI}))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{SEL}{RI})))"


def mean(histogram: str) -> str:
    return f"{rate(histogram + '_sum')} / {rate(histogram + '_count')}"


def latency_targets(histogram: str, name: str, by: str = "") -> list[tuple[str, str]]:
    suffix = f" {{{{{by}}}}}" if by else ""
    targets = [
        (quantile(0.5, histogram, by), f"{name} p50{suffix}"),
        (quantile(0.99, histogram, by), f"{name} p99{suffix}"),
    ]
    if not by:
        targets.append((mean(histogram), f"{name} mean"))
    return targets


# (row title, [(panel title, unit, [(expr, legend)], description)])
ROWS = [
    (
        "Traffic",
        [
            (
                "Requests finished / s by reason",
                "reqps",
                [(rate("appliance_requests_finished_total", "finish_reason"), "{{finish_reason}}")],
                "Finished requests/s by finish reason (stop, length, tool_calls, abort, error).",
            ),
            (
                "HTTP responses / s by status",
                "reqps",
                [(rate("appliance_http_requests_total", "status"), "{{status}}")],
                "HTTP responses by status code; 4xx are client errors (400 guards, 429 overload).",
            ),
            (
                "Tokens / s",
                "short",
                [
                    (rate("appliance_prompt_tokens_total"), "prompt"),
                    (rate("appliance_generation_tokens_total"), "generation"),
                ],
                "Prompt tokens whose prefill completed and generated tokens, per second.",
            ),
            (
                "Requests running / waiting / in frontend",
                "short",
                [
                    (f"sum(appliance_num_requests_running{SEL})", "running"),
                    (f"sum(appliance_num_requests_waiting{SEL})", "waiting (router queue)"),
                    (
                        f"sum(appliance_num_requests_frontend{SEL})",
                        "frontend (parse, images, tokenize)",
                    ),
                ],
                "Router gauges plus requests still in the HTTP server before the router sees them.",
            ),
        ],
    ),
    (
        "Latency",
        [
            (
                "Time to first token",
                "s",
                latency_targets("appliance_time_to_first_token_seconds", "TTFT"),
                "Server arrival to first generated token.",
            ),
            (
                "Inter-token latency / time per output token",
                "s",
                latency_targets("appliance_inter_token_latency_seconds", "ITL")[:2]
                + latency_targets("appliance_request_time_per_output_token_seconds", "TPOT")[:2],
                "ITL: one sample per token (an MTP step of n tokens gives n samples of gap/n)."
                " TPOT: one sample per request, (e2e - ttft) / (tokens - 1).",
            ),
            (
                "End-to-end request latency",
                "s",
                latency_targets("appliance_e2e_request_latency_seconds", "e2e"),
                "Server arrival to last token.",
            ),
            (
                "Queue time",
                "s",
                latency_targets("appliance_request_queue_time_seconds", "queue"),
                "Router queue arrival to first scheduling.",
            ),
        ],
    ),
    (
        "Capacity and caches",
        [
            (
                "KV cache and linear-state usage",
                "percentunit",
                [
                    (f"max(appliance_kv_cache_usage_ratio{SEL})", "KV slots"),
                    (
                        f"max(appliance_linear_state_usage_ratio{SEL})",
                        "linear-attention state slots",
                    ),
                ],
                "Share of KV token slots and of Gated-DeltaNet state slots in use.",
            ),
            (
                "Preemptions / s",
                "short",
                [(rate("appliance_preemptions_total"), "preemptions")],
                "Requests freed and re-queued under memory pressure.",
            ),
            (
                "Image embedding cache hit rate",
                "percentunit",
                [
                    (
                        f"{rate('appliance_mm_cache_hits_total')}"
                        f" / {rate('appliance_mm_cache_queries_total')}",
                        "image embedding cache (images)",
                    ),
                ],
                "Hits / queries as a ratio of rates over the panel's window.",
            ),
            (
                "MTP acceptance per draft position",
                "percentunit",
                [
                    (
                        f"{rate('appliance_mtp_accepted_tokens_per_position_total', 'position')}"
                        f" / ignoring(position) group_left {rate('appliance_mtp_drafts_total')}",
                        "position {{position}}",
                    ),
                    (
                        f"{rate('appliance_mtp_accepted_tokens_total')}"
                        f" / {rate('appliance_mtp_draft_tokens_total')}",
                        "all drafted tokens",
                    ),
                ],
                "Share of drafts whose token at this position was accepted.",
            ),
            (
                "MTP mean accept length",
                "short",
                [
                    (
                        f"1 + {rate('appliance_mtp_accepted_tokens_total')}"
                        f" / {rate('appliance_mtp_drafts_total')}",
                        "tokens per verify step",
                    )
                ],
                "1 (bonus token) + accepted draft tokens per draft.",
            ),
            (
                "MTP steps with verify off / s",
                "short",
                [(rate("appliance_mtp_paused_steps_total"), "steps verifying no drafts")],
                "Steps whose decodes verified no drafts, paused by the verify policy "
                "(--mtp-disable-batch-size).",
            ),
        ],
    ),
    (
        "Images",
        [
            (
                "Image stage latency",
                "s",
                latency_targets("appliance_image_stage_seconds", "", "stage"),
                "Per image: fetch_decode (server), preprocess and encode (visual server).",
            ),
            (
                "Images / s by stage",
                "short",
                [(rate("appliance_image_stage_seconds_count", "stage"), "{{stage}}")],
                "Images passing each stage per second.",
            ),
        ],
    ),
]


def panel(
    panel_id: int,
    title: str,
    unit: str,
    targets: list[tuple[str, str]],
    description: str,
    x: int,
    y: int,
) -> dict:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend.strip(),
            }
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def templating() -> dict:
    model_query = "label_values(appliance_requests_finished_total, model_name)"
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {"text": "Prometheus", "value": "appliance-prometheus"},
                "hide": 0,
            },
            {
                "name": "model_name",
                "label": "Model",
                "type": "query",
                "datasource": DATASOURCE,
                "definition": model_query,
                "query": {"query": model_query, "refId": "model_name"},
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "refresh": 2,
                "sort": 1,
                "current": {"text": "All", "value": "$__all"},
                "hide": 0,
            },
        ]
    }


def build() -> dict:
    panels, next_id, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        for i, spec in enumerate(row_panels):
            panels.append(panel(next_id, *spec, x=12 * (i % 2), y=y + 8 * (i // 2)))
            next_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": "appliance-overview",
        "title": "Appliance",
        "tags": ["appliance"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": templating(),
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
