"""Prometheus metrics for `GET /metrics`: every `appliance_*` series, owned by the server process.

Multi-process design: only the server process holds a registry. It records its own request events
(`on_first_token`, `on_tokens`, `on_request_finished`, ...) directly; the router and the visual
server send typed stat messages (cumulative counters + gauges + new histogram observations) that
the server folds in with `apply_router_stats` / `apply_visual_stats`. No multiprocess dir.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from appliance.logging import get_logger
from appliance.stats import CumulativeTracker, StatsWindow

logger = get_logger(__name__)

# "rejected": refused by the router with a client error (400 too long, 429 queue full) after
# submission; "error": a server-side failure. Requests refused before submission (validation, auth)
# never reach this counter: appliance_http_requests_total{status} counts them.
FINISH_REASONS = ("stop", "length", "tool_calls", "repetition", "abort", "rejected", "error")
IMAGE_STAGES = ("fetch_decode", "preprocess", "encode")

# fmt: off
# Bucket edges in seconds (and tokens for the length histograms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000, 200000, 500000, 1000000)

# attribute, type, name, help text, labels besides model_name, buckets
METRICS: tuple[tuple[str, str, str, str, tuple[str, ...], tuple[float, ...] | None], ...] = (
    ("requests_finished", "counter", "appliance_requests_finished",
     "Finished requests by finish reason.", ("finish_reason",), None),
    ("http_requests", "counter", "appliance_http_requests",
     "HTTP responses by route template and status code.", ("route", "status"), None),
    ("prompt_tokens", "counter", "appliance_prompt_tokens",
     "Prompt tokens of requests whose prefill completed.", (), None),
    ("generation_tokens", "counter", "appliance_generation_tokens",
     "Generated tokens (all requests, aborted included).", (), None),
    ("ttft", "histogram", "appliance_time_to_first_token_seconds",
     "Server arrival to first generated token.", (), TTFT_BUCKETS),
    ("itl", "histogram", "appliance_inter_token_latency_seconds",
     "Gap between token deliveries divided by the tokens delivered; one sample per token.", (),
     ITL_BUCKETS),
    ("tpot", "histogram", "appliance_request_time_per_output_token_seconds",
     "Per request: (e2e - ttft) / (generation tokens - 1).", (), ITL_BUCKETS),
    ("e2e", "histogram", "appliance_e2e_request_latency_seconds",
     "Server arrival to the last token.", (), E2E_BUCKETS),
    ("queue_time", "histogram", "appliance_request_queue_time_seconds",
     "Router queue arrival to first scheduling.", (), E2E_BUCKETS),
    ("request_prompt_tokens", "histogram", "appliance_request_prompt_tokens",
     "Prompt length per finished request.", (), LENGTH_BUCKETS),
    ("request_generation_tokens", "histogram", "appliance_request_generation_tokens",
     "Generated tokens per finished request.", (), LENGTH_BUCKETS),
    ("image_stage", "histogram", "appliance_image_stage_seconds",
     "Per image: fetch_decode (server), preprocess and encode (visual server).", ("stage",),
     STAGE_BUCKETS),
    ("running", "gauge", "appliance_num_requests_running",
     "Requests holding a request slot.", (), None),
    ("waiting", "gauge", "appliance_num_requests_waiting",
     "Requests queued in the router.", (), None),
    ("frontend", "gauge", "appliance_num_requests_frontend",
     "Requests in the server before the router sees them (parse, image fetch, tokenize).", (),
     None),
    ("kv_usage", "gauge", "appliance_kv_cache_usage_ratio",
     "Used KV token slots / all (0-1).", (), None),
    ("state_usage", "gauge", "appliance_linear_state_usage_ratio",
     "Used linear-attention state slots / all (0-1).", (), None),
    ("mm_cache_queries", "counter", "appliance_mm_cache_queries",
     "Images looked up in the visual embedding cache.", (), None),
    ("mm_cache_hits", "counter", "appliance_mm_cache_hits",
     "Images whose embeddings were already cached.", (), None),
    ("mtp_drafts", "counter", "appliance_mtp_drafts",
     "MTP draft sequences verified (one per request per step).", (), None),
    ("mtp_draft_tokens", "counter", "appliance_mtp_draft_tokens",
     "MTP draft tokens proposed.", (), None),
    ("mtp_accepted_tokens", "counter", "appliance_mtp_accepted_tokens",
     "MTP draft tokens accepted.", (), None),
    ("mtp_paused_steps", "counter", "appliance_mtp_paused_steps",
     "Steps whose decodes verified no MTP drafts (the verify policy paused them: "
     "--mtp-disable-batch-size).", (), None),
    ("mtp_accepted_per_position", "counter", "appliance_mtp_accepted_tokens_per_position",
     "MTP draft tokens accepted at each draft position (0 = first draft token).", ("position",),
     None),
    ("grammar_compile", "histogram", "appliance_grammar_compile_seconds",
     "Structured-output grammar compile time in the server (cache misses).", (), STAGE_BUCKETS),
    ("grammar_cache_hits", "counter", "appliance_grammar_cache_hits",
     "Structured-output guides whose compiled grammar the server had cached.", (), None),
    ("preemptions", "counter", "appliance_preemptions",
     "Requests preempted (freed and re-queued) by the router.", (), None),
    ("prefix_cache_queries", "counter", "appliance_prefix_cache_queries",
     "Prompt tokens of admitted requests looked up in the prefix cache.", (), None),
    ("prefix_cache_hits", "counter", "appliance_prefix_cache_hits",
     "Prompt tokens found in the prefix cache (KV reused, GDN state restored).", (), None),
    ("prefix_cache_tokens", "gauge", "appliance_prefix_cache_tokens",
     "Token positions (KV slots) held by the prefix tree.", (), None),
    ("snapshot_usage", "gauge", "appliance_prefix_cache_snapshot_usage_ratio",
     "Used prefix-cache GDN state snapshot slots / all (0-1).", (), None),
)

# Keys of the router's report (RouterStats with its SchedulerStats flattened, or a flat mapping).
# Counters are cumulative since router start.
ROUTER_GAUGES = ("num_running", "num_waiting", "kv_usage", "state_usage", "prefix_cache_tokens",
                 "snapshot_usage")
ROUTER_COUNTERS = {  # snapshot key -> MetricsRecorder attribute
    "mtp_drafts": "mtp_drafts", "mtp_draft_tokens": "mtp_draft_tokens",
    "mtp_accepted_tokens": "mtp_accepted_tokens", "num_preemptions": "preemptions",
    "mtp_paused_steps": "mtp_paused_steps",
    "prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
}
# fmt: on


class MetricsRecorder:
    """The server's registry plus the event methods that feed it (and optionally a StatsWindow)."""

    def __init__(
        self,
        model_name: str,
        window: StatsWindow | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.model_name = model_name
        self.window = window
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._cumulative = CumulativeTracker()
        self._router_gauges: dict[str, dict[str, float]] = {}  # source -> gauge key -> value
        self._define()

    # ------------------------------------------------------------------ definitions
    def _define(self) -> None:
        """One attribute per METRICS row; rows without extra labels are bound to model_name."""
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        for attr, kind, name, doc, labels, buckets in METRICS:
            extra = {"buckets": buckets} if buckets else {}
            metric = kinds[kind](
                name, doc, ["model_name", *labels], registry=self.registry, **extra
            )
            setattr(self, attr, metric if labels else metric.labels(model_name=self.model_name))
        # Create the labelled children up front so dashboards see zeros instead of no data.
        for reason in FINISH_REASONS:
            self.requests_finished.labels(model_name=self.model_name, finish_reason=reason)
        for stage in IMAGE_STAGES:
            self.image_stage.labels(model_name=self.model_name, stage=stage)

    # ------------------------------------------------------------------ server-side events
    def on_first_token(
        self, request_id: str, ttft_s: float, prompt_tokens: int, num_tokens: int = 1
    ) -> None:
        """First delivery of a request: its prompt is computed and `num_tokens` tokens exist."""
        with self._lock:
            self.ttft.observe(ttft_s)
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(num_tokens)
            if self.window is not None:
                self.window.on_prompt(request_id, prompt_tokens)
                self.window.on_generation(request_id, num_tokens)

    def on_tokens(self, request_id: str, num_tokens: int, interval_s: float) -> None:
        """A later delivery: `num_tokens` new tokens, `interval_s` after the previous delivery.

        Several tokens in one delivery (MTP) become `num_tokens` equal ITL samples."""
        if num_tokens <= 0:
            return
        with self._lock:
            per_token = interval_s / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)
            self.generation_tokens.inc(num_tokens)
            if self.window is not None:
                self.window.on_generation(request_id, num_tokens)

    def on_request_finished(
        self,
        request_id: str,
        finish_reason: str,
        e2e_s: float,
        prompt_tokens: int,
        generation_tokens: int,
        ttft_s: float | None = None,
        queue_time_s: float | None = None,
        prompt_counted: bool = False,
    ) -> None:
        """A request ended (any reason). Token counters were fed live; this records the rest.
        `prompt_counted`: another choice of its prompt already counted the prompt's tokens.
        The per-request histograms (e2e, prompt and generation tokens) take the requests that
        were served: a first token, or a finish without one (max_tokens 0); refusals and aborts
        before any token are only counted by finish reason."""
        reason = finish_reason if finish_reason in FINISH_REASONS else "error"
        served = ttft_s is not None or reason in ("stop", "length")
        with self._lock:
            if ttft_s is None and reason in ("stop", "length") and not prompt_counted:
                # finished without a token (max_tokens 0: prompt logprobs, lm-eval's scoring):
                # its prompt was computed all the same, which no first token has counted
                self.prompt_tokens.inc(prompt_tokens)
                if self.window is not None:
                    self.window.on_prompt(request_id, prompt_tokens)
            self.requests_finished.labels(model_name=self.model_name, finish_reason=reason).inc()
            if served:
                self.e2e.observe(e2e_s)
                self.request_prompt_tokens.observe(prompt_tokens)
                self.request_generation_tokens.observe(generation_tokens)
            if ttft_s is not None and generation_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (generation_tokens - 1))
            if queue_time_s is not None:
                self.queue_time.observe(queue_time_s)
            if self.window is not None:
                self.window.on_finished(request_id, reason)
        logger.debug(
            "request %s finished: reason=%s prompt=%d generated=%d ttft=%s e2e=%.3fs",
            request_id,
            reason,
            prompt_tokens,
            generation_tokens,
            "-" if ttft_s is None else f"{ttft_s:.3f}s",
            e2e_s,
        )

    def on_http_response(self, route: str, status: int) -> None:
        """One HTTP response; `route` is the route template (e.g. /v1/chat/completions)."""
        self.http_requests.labels(model_name=self.model_name, route=route, status=str(status)).inc()

    def on_image_stage(self, stage: str, seconds: float) -> None:
        if stage not in IMAGE_STAGES:
            raise ValueError(f"stage: expected one of {', '.join(IMAGE_STAGES)}, got {stage!r}")
        self.image_stage.labels(model_name=self.model_name, stage=stage).observe(seconds)

    def frontend_enter(self) -> None:
        self.frontend.inc()

    def frontend_exit(self) -> None:
        self.frontend.dec()

    # ------------------------------------------------------------------ other processes
    def apply_router_stats(self, stats: Any, source: str = "router") -> None:
        """Fold one router report (RouterStats, or a flat mapping of the same keys) into gauges and
        counters.

        Gauges: num_running, num_waiting, kv_usage, state_usage, prefix_cache_tokens,
        snapshot_usage (summed / maxed over sources).
        Cumulative counters: mtp_drafts, mtp_draft_tokens, mtp_accepted_tokens, mtp_paused_steps,
        num_preemptions,
        prefix_cache_queries, prefix_cache_hits, mtp_accepted_per_position (list, one per
        position).
        New observations since the last snapshot: queue_time_s (list of seconds)."""
        stats = flat_report(stats)
        with self._lock:
            gauges = {k: float(stats[k]) for k in ROUTER_GAUGES if stats.get(k) is not None}
            self._router_gauges.setdefault(source, {}).update(gauges)
            self._publish_router_gauges()
            for key, attr in ROUTER_COUNTERS.items():
                if stats.get(key) is not None:
                    inc = self._cumulative.delta(source, key, float(stats[key]))
                    getattr(self, attr).inc(inc)
            for position, value in enumerate(stats.get("mtp_accepted_per_position") or ()):
                inc = self._cumulative.delta(source, f"mtp_pos{position}", float(value))
                self.mtp_accepted_per_position.labels(
                    model_name=self.model_name, position=str(position)
                ).inc(inc)
            for seconds in stats.get("queue_time_s") or ():
                self.queue_time.observe(float(seconds))
            if self.window is not None:
                self.window.on_router_stats(stats, source)

    def apply_visual_stats(self, stats: Any, source: str = "visual") -> None:
        """Fold one visual-server report: new `preprocess_s` / `encode_s` observations (lists, one
        per image) and cumulative `cache_queries` / `cache_hits` (images)."""
        stats = flat_report(stats)
        with self._lock:
            for stage, key in (("preprocess", "preprocess_s"), ("encode", "encode_s")):
                child = self.image_stage.labels(model_name=self.model_name, stage=stage)
                for seconds in stats.get(key) or ():
                    child.observe(float(seconds))
            for key, metric in (
                ("cache_queries", self.mm_cache_queries),
                ("cache_hits", self.mm_cache_hits),
            ):
                if stats.get(key) is not None:
                    metric.inc(self._cumulative.delta(source, key, float(stats[key])))

    def forget_source(self, source: str) -> None:
        """A sender stopped (e.g. a router replica): drop its gauges from the sums."""
        with self._lock:
            self._router_gauges.pop(source, None)
            self._publish_router_gauges()

    def _publish_router_gauges(self) -> None:
        per_source = self._router_gauges.values()
        self.running.set(sum(g.get("num_running", 0.0) for g in per_source))
        self.waiting.set(sum(g.get("num_waiting", 0.0) for g in per_source))
        self.kv_usage.set(max((g.get("kv_usage", 0.0) for g in per_source), default=0.0))
        self.state_usage.set(max((g.get("state_usage", 0.0) for g in per_source), default=0.0))
        self.prefix_cache_tokens.set(sum(g.get("prefix_cache_tokens", 0.0) for g in per_source))
        self.snapshot_usage.set(
            max((g.get("snapshot_usage", 0.0) for g in per_source), default=0.0)
        )

    # ------------------------------------------------------------------ exposition
    def render(self) -> tuple[bytes, str]:
        """Body and content type for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def sample_names(self) -> set[str]:
        """Every series name /metrics can expose (with _total/_bucket/_sum/_count/_created)."""
        names: set[str] = set()
        for family in self.registry.collect():
            if family.type == "counter":
                names.update({family.name + "_total", family.name + "_created"})
            elif family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count", "_created"))
            else:
                names.add(family.name)
        return names


def flat_report(stats: Any) -> Mapping[str, Any]:
    """A flat mapping of a report: RouterStats' nested SchedulerStats (with its usage ratios) is
    merged into the top level."""
    if isinstance(stats, Mapping):
        return stats
    fields = getattr(stats, "__struct_fields__", None)  # a msgspec.Struct
    if fields is None:
        raise TypeError(
            f"stats: expected a mapping or a msgspec Struct, got {type(stats).__name__}"
        )
    flat = {name: getattr(stats, name) for name in fields}
    inner = flat.pop("scheduler", None)
    if inner is not None:
        flat.update(flat_report(inner))
        flat["kv_usage"], flat["state_usage"] = inner.kv_usage, inner.state_usage
        flat["snapshot_usage"] = inner.snapshot_usage
    return flat
