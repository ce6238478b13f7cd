"""MetricsRecorder: /metrics values after simulated request events and router/visual reports."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.messages import RouterStats, SchedulerStats, VisualStats, encode
from appliance.metrics import MetricsRecorder
from appliance.stats import StatsWindow


def scrape(recorder: MetricsRecorder) -> dict[tuple[str, tuple], float]:
    body, content_type = recorder.render()
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    labels.setdefault("model_name", "m")
    return samples[(name, tuple(sorted(labels.items())))]


def bucket(samples: dict, name: str, le: str, **labels: str) -> float:
    return value(samples, name + "_bucket", le=le, **labels)


def run_request(
    rec: MetricsRecorder,
    rid: str,
    reason: str,
    prompt: int,
    deliveries: list[int],
    ttft: float,
    interval: float,
) -> None:
    rec.on_first_token(rid, ttft_s=ttft, prompt_tokens=prompt, num_tokens=deliveries[0])
    for n in deliveries[1:]:
        rec.on_tokens(rid, num_tokens=n, interval_s=interval)
    gen = sum(deliveries)
    e2e = ttft + interval * (len(deliveries) - 1)
    rec.on_request_finished(
        rid,
        reason,
        e2e_s=e2e,
        prompt_tokens=prompt,
        generation_tokens=gen,
        ttft_s=ttft,
        queue_time_s=0.002,
    )


def test_request_events_fill_counters_and_histograms() -> None:
    rec = MetricsRecorder("m")
    # r1: 10 prompt tokens, deliveries 1 + 1 + 3 (an MTP step) every 30 ms -> 5 tokens.
    run_request(rec, "r1", "stop", 10, [1, 1, 3], ttft=0.05, interval=0.03)
    # r2: 7 prompt tokens, 4 single-token deliveries every 8 ms, hits max_tokens.
    run_request(rec, "r2", "length", 7, [1, 1, 1, 1], ttft=0.5, interval=0.008)
    s = scrape(rec)
    assert value(s, "appliance_prompt_tokens_total") == 17
    assert value(s, "appliance_generation_tokens_total") == 9
    assert value(s, "appliance_requests_finished_total", finish_reason="stop") == 1
    assert value(s, "appliance_requests_finished_total", finish_reason="length") == 1
    assert value(s, "appliance_requests_finished_total", finish_reason="abort") == 0
    assert value(s, "appliance_time_to_first_token_seconds_count") == 2
    assert value(s, "appliance_time_to_first_token_seconds_sum") == pytest.approx(0.55)
    assert bucket(s, "appliance_time_to_first_token_seconds", "0.06") == 1
    assert bucket(s, "appliance_time_to_first_token_seconds", "0.5") == 2
    # ITL: r1 gives 1 sample of 30 ms and 3 samples of 10 ms; r2 gives 3 samples of 8 ms.
    assert value(s, "appliance_inter_token_latency_seconds_count") == 7
    assert value(s, "appliance_inter_token_latency_seconds_sum") == pytest.approx(
        0.03 + 0.03 + 0.024
    )
    assert bucket(s, "appliance_inter_token_latency_seconds", "0.01") == 6
    # TPOT per request: r1 (0.11 - 0.05) / 4 = 15 ms, r2 (0.524 - 0.5) / 3 = 8 ms.
    assert value(s, "appliance_request_time_per_output_token_seconds_count") == 2
    assert value(s, "appliance_request_time_per_output_token_seconds_sum") == pytest.approx(0.023)
    assert value(s, "appliance_e2e_request_latency_seconds_count") == 2
    assert value(s, "appliance_e2e_request_latency_seconds_sum") == pytest.approx(0.11 + 0.524)
    assert value(s, "appliance_request_queue_time_seconds_count") == 2
    assert value(s, "appliance_request_prompt_tokens_sum") == 17
    assert value(s, "appliance_request_generation_tokens_sum") == 9


def test_unknown_finish_reason_counts_as_error_and_single_token_has_no_tpot() -> None:
    rec = MetricsRecorder("m")
    rec.on_first_token("a", 0.1, prompt_tokens=3)
    rec.on_request_finished(
        "a", "weird", e2e_s=0.1, prompt_tokens=3, generation_tokens=1, ttft_s=0.1
    )
    s = scrape(rec)
    assert value(s, "appliance_requests_finished_total", finish_reason="error") == 1
    assert value(s, "appliance_request_time_per_output_token_seconds_count") == 0
    assert value(s, "appliance_request_queue_time_seconds_count") == 0


def test_router_snapshots_set_gauges_and_keep_counters_monotonic() -> None:
    rec = MetricsRecorder("m")
    rec.apply_router_stats(
        {
            "num_running": 3,
            "num_waiting": 2,
            "kv_usage": 0.25,
            "state_usage": 0.5,
            "mtp_drafts": 10,
            "mtp_draft_tokens": 30,
            "mtp_accepted_tokens": 18,
            "mtp_accepted_per_position": [9, 6, 3],
            "mtp_paused_steps": 4,
            "num_preemptions": 1,
            "queue_time_s": [0.1, 0.2],
        }
    )
    # Cumulative again: only the increase is added.
    rec.apply_router_stats(
        {
            "num_running": 1,
            "num_waiting": 0,
            "kv_usage": 0.1,
            "state_usage": 0.2,
            "mtp_drafts": 12,
            "mtp_draft_tokens": 36,
            "mtp_accepted_tokens": 22,
            "mtp_accepted_per_position": [11, 7, 4],
            "mtp_paused_steps": 9,
            "num_preemptions": 1,
            "queue_time_s": [0.3],
            "prefix_cache_queries": 500,
            "prefix_cache_hits": 300,
            "prefix_cache_tokens": 4096,
            "snapshot_usage": 0.5,
        }
    )
    s = scrape(rec)
    assert value(s, "appliance_num_requests_running") == 1
    assert value(s, "appliance_num_requests_waiting") == 0
    assert value(s, "appliance_kv_cache_usage_ratio") == pytest.approx(0.1)
    assert value(s, "appliance_linear_state_usage_ratio") == pytest.approx(0.2)
    assert value(s, "appliance_mtp_drafts_total") == 12
    assert value(s, "appliance_mtp_draft_tokens_total") == 36
    assert value(s, "appliance_mtp_accepted_tokens_total") == 22
    assert value(s, "appliance_mtp_paused_steps_total") == 9
    for position, expected in enumerate([11, 7, 4]):
        assert (
            value(s, "appliance_mtp_accepted_tokens_per_position_total", position=str(position))
            == expected
        )
    assert value(s, "appliance_preemptions_total") == 1
    assert value(s, "appliance_prefix_cache_queries_total") == 500
    assert value(s, "appliance_prefix_cache_hits_total") == 300
    assert value(s, "appliance_prefix_cache_tokens") == 4096
    assert value(s, "appliance_prefix_cache_snapshot_usage_ratio") == pytest.approx(0.5)
    assert value(s, "appliance_request_queue_time_seconds_count") == 3
    assert value(s, "appliance_request_queue_time_seconds_sum") == pytest.approx(0.6)

    # The router restarted: its cumulative counters start again from a small value.
    rec.apply_router_stats({"mtp_drafts": 2, "mtp_accepted_tokens": 1})
    s = scrape(rec)
    assert value(s, "appliance_mtp_drafts_total") == 14
    assert value(s, "appliance_mtp_accepted_tokens_total") == 23
    assert value(s, "appliance_num_requests_running") == 1  # gauges absent: unchanged


def test_two_router_sources_sum_counts_and_max_usage() -> None:
    rec = MetricsRecorder("m")
    rec.apply_router_stats({"num_running": 2, "kv_usage": 0.3, "mtp_drafts": 10}, source="dp0")
    rec.apply_router_stats({"num_running": 5, "kv_usage": 0.7, "mtp_drafts": 10}, source="dp1")
    s = scrape(rec)
    assert value(s, "appliance_num_requests_running") == 7
    assert value(s, "appliance_kv_cache_usage_ratio") == pytest.approx(0.7)
    assert value(s, "appliance_mtp_drafts_total") == 20
    rec.forget_source("dp1")
    assert value(scrape(rec), "appliance_num_requests_running") == 2


def test_router_stats_accepts_the_router_report() -> None:
    # RouterStats embeds the scheduler's snapshot; its usage ratios come from the slot counts.
    sched = SchedulerStats(
        num_running=4,
        num_waiting=9,
        kv_used=30,
        kv_total=120,
        state_used=4,
        state_total=8,
        num_preemptions=2,
    )
    report = RouterStats(scheduler=sched, queue_time_s=[0.5])
    rec = MetricsRecorder("m")
    rec.apply_router_stats(msgspec.msgpack.decode(encode(report), type=RouterStats))
    s = scrape(rec)
    assert value(s, "appliance_num_requests_waiting") == 9
    assert value(s, "appliance_kv_cache_usage_ratio") == pytest.approx(0.25)
    assert value(s, "appliance_linear_state_usage_ratio") == pytest.approx(0.5)
    assert value(s, "appliance_preemptions_total") == 2
    assert value(s, "appliance_request_queue_time_seconds_count") == 1
    with pytest.raises(TypeError):
        rec.apply_router_stats([1, 2])


def test_image_stages_and_visual_reports() -> None:
    rec = MetricsRecorder("m")
    rec.on_image_stage("fetch_decode", 0.02)
    rec.apply_visual_stats(VisualStats(1, 0, 64, 3, 1, [0.004, 0.006], [0.05]))
    rec.apply_visual_stats(VisualStats(1, 0, 64, 4, 1, [], [0.07]))
    s = scrape(rec)
    name = "appliance_image_stage_seconds"
    assert value(s, name + "_count", stage="fetch_decode") == 1
    assert value(s, name + "_count", stage="preprocess") == 2
    assert value(s, name + "_sum", stage="preprocess") == pytest.approx(0.01)
    assert value(s, name + "_count", stage="encode") == 2
    assert value(s, "appliance_mm_cache_queries_total") == 4
    assert value(s, "appliance_mm_cache_hits_total") == 1
    with pytest.raises(ValueError, match="stage"):
        rec.on_image_stage("resize", 0.1)


def test_http_and_frontend_metrics() -> None:
    rec = MetricsRecorder("m")
    rec.on_http_response("/v1/chat/completions", 200)
    rec.on_http_response("/v1/chat/completions", 400)
    rec.on_http_response("/v1/chat/completions", 400)
    rec.frontend_enter()
    rec.frontend_enter()
    rec.frontend_exit()
    s = scrape(rec)
    assert (
        value(s, "appliance_http_requests_total", route="/v1/chat/completions", status="400") == 2
    )
    assert value(s, "appliance_num_requests_frontend") == 1


def test_recorder_feeds_the_stats_window() -> None:
    window = StatsWindow(clock=lambda: 0.0)
    rec = MetricsRecorder("m", window=window)
    run_request(rec, "ok", "stop", 10, [1, 2], ttft=0.1, interval=0.1)
    run_request(rec, "gone", "abort", 50, [1, 1, 1], ttft=0.1, interval=0.1)
    rec.apply_router_stats(
        {"num_running": 0, "num_waiting": 0, "mtp_drafts": 60, "mtp_accepted_tokens": 15}
    )
    stats = window.roll(now=2.0)
    # The aborted request is on /metrics but not in the window's throughput.
    s = scrape(rec)
    assert value(s, "appliance_generation_tokens_total") == 6
    assert (stats.prompt_tokens, stats.generation_tokens) == (10, 3)
    assert (stats.finished, stats.aborted) == (2, 1)
    assert stats.mtp_accept_length == pytest.approx(1.25)


def test_every_series_is_prefixed_and_labelled_with_the_model() -> None:
    rec = MetricsRecorder("qwen")
    for family in text_string_to_metric_families(rec.render()[0].decode()):
        assert family.name.startswith("appliance_")
        for sample in family.samples:
            assert sample.labels.get("model_name") == "qwen", sample
    names = rec.sample_names()
    assert "appliance_time_to_first_token_seconds_bucket" in names
    assert "appliance_prompt_tokens_total" in names
    assert "appliance_num_requests_running" in names


def test_a_request_that_generates_nothing_still_counts_its_prompt() -> None:
    """max_tokens 0 (prompt logprobs; lm-eval's loglikelihood requests): no first token, but the
    prompt was computed, so prompt tokens and the stats window count it; an aborted request that
    never got a token does not (its prompt may never have run)."""
    window = StatsWindow(clock=lambda: 0.0)
    rec = MetricsRecorder("m", window=window)
    rec.on_request_finished("a", "length", e2e_s=0.2, prompt_tokens=12, generation_tokens=0)
    rec.on_request_finished("b", "abort", e2e_s=0.1, prompt_tokens=30, generation_tokens=0)
    s = scrape(rec)
    assert value(s, "appliance_prompt_tokens_total") == 12
    assert value(s, "appliance_generation_tokens_total") == 0
    assert window.roll(now=1.0).prompt_tokens == 12
