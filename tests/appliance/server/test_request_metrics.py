"""vLLM's per-request `metrics` object from a choice's deltas (appliance/server/request_metrics.py):
the timing fields from the router's RequestTiming, `speculative_decoding` from the cumulative
SpecCounts (each step's counts recovered from consecutive deltas), null for several choices,
nothing when both flags are off."""

from __future__ import annotations

import pytest

from appliance.config import ServerConfig
from appliance.messages import RequestTiming, SpecCounts, TextDelta
from appliance.server.request_metrics import ChoiceMetrics, MetricsReport


def delta(tokens: int, spec: SpecCounts | None = None, timing: RequestTiming | None = None):
    return TextDelta("r", "x", [1], tokens, spec=spec, timing=timing)


def fed(*deltas: TextDelta) -> ChoiceMetrics:
    choice = ChoiceMetrics()
    for d in deltas:
        choice.feed(d)
    return choice


def report(timing: bool = True, level: str = "none", mtp_step: int = 2) -> MetricsReport:
    config = ServerConfig(enable_per_request_metrics=timing, per_request_spec_decode_metrics=level)
    found = MetricsReport.of(config, mtp_step)
    assert found is not None
    return found


def test_off_by_default_and_null_for_several_choices():
    assert MetricsReport.of(ServerConfig(), 2) is None
    assert report().field([ChoiceMetrics(), ChoiceMetrics()]) == {"metrics": None}


def test_timing_fields_in_milliseconds():
    choice = fed(
        delta(1, timing=RequestTiming(0.01, 0.2, 0.0)),
        delta(5, timing=RequestTiming(0.01, 0.2, 0.4)),
    )
    metrics = report().field([choice])["metrics"]
    assert metrics == pytest.approx(
        {
            "time_to_first_token_ms": 200.0,
            "generation_time_ms": 400.0,
            "queue_time_ms": 10.0,
            "mean_itl_ms": 100.0,  # 400 ms over the 4 gaps between 5 tokens
            "tokens_per_second": 5 / 0.6,
        }
    )
    one = report().field([fed(delta(1, timing=RequestTiming(0.01, 0.2, 0.0)))])["metrics"]
    assert one["mean_itl_ms"] is None and one["time_to_first_token_ms"] == pytest.approx(200.0)
    unknown = report().field([fed(delta(3))])["metrics"]
    assert set(unknown.values()) == {None}


def test_speculative_decoding_from_cumulative_counts():
    # step 1 drafted 2 and accepted 2; step 2 drafted 2, accepted 0; step 3 drafted 1, accepted 1
    counts = [
        SpecCounts([[0, 0], [0, 0, 1]]),
        SpecCounts([[0, 0], [1, 0, 1]]),
        SpecCounts([[0, 1], [1, 0, 1]]),
    ]
    choice = fed(delta(1), *(delta(n, spec) for n, spec in zip((4, 5, 7), counts)))
    spec = report(timing=False, level="detailed").field([choice])["metrics"]
    assert spec == {
        "speculative_decoding": {
            "mean_acceptance_length": pytest.approx(2.0),
            "draft_acceptance_rate": pytest.approx(3 / 5),
            "acceptance_histogram": [1, 1, 1],
            "acceptance_histogram_by_draft_length": {"1": [0, 1], "2": [1, 0, 1]},
            "num_spec_steps": 3,
            "num_accepted_draft_tokens": 3,
            "num_draft_tokens": 5,
            "num_spec_tokens": 2,
            "per_step_accepted": [2, 0, 1],
            "per_step_drafted": [2, 2, 1],
        }
    }
    summary = report(timing=False, level="summary").field([choice])["metrics"]
    assert "per_step_accepted" not in summary["speculative_decoding"]


def test_no_verify_step_and_mtp_off():
    none_yet = report(level="summary").field([fed(delta(1))])["metrics"]["speculative_decoding"]
    assert none_yet["acceptance_histogram"] == [0, 0, 0] and none_yet["num_spec_steps"] == 0
    assert none_yet["mean_acceptance_length"] is None
    assert none_yet["acceptance_histogram_by_draft_length"] == {}
    off = report(level="summary", mtp_step=0).field([fed(delta(1))])["metrics"]
    assert off["speculative_decoding"] is None
