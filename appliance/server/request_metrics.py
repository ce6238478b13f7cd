"""vLLM's per-request metrics: the `metrics` object of a chat / completions / responses answer of
one choice (--enable-per-request-metrics: queue time, TTFT, decode time, mean ITL, tokens/s) and
its `speculative_decoding` part (--per-request-spec-decode-metrics summary | detailed: the
request's MTP accept length, rate and histograms). The times are the router's (RequestTiming:
queued -> first scheduled -> first token -> last token), the MTP counts the Scheduler's
(SpecCounts), both carried by the choice's TextDeltas; a choice's deltas are fed to a
ChoiceMetrics, and MetricsReport words the object. An answer of several choices (n > 1, several
prompts) has `metrics: null`, as vLLM's: its times are not one stream's. Used by
appliance/server/serving.py and responses_output.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.config import ServerConfig
from appliance.messages import RequestTiming, SpecCounts, TextDelta


@dataclass
class ChoiceMetrics:
    """What one choice's deltas tell of its timing and its MTP verify steps."""

    timing: RequestTiming | None = None
    spec: SpecCounts | None = None
    num_tokens: int = 0
    steps: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) a step

    def feed(self, delta: TextDelta) -> None:
        self.num_tokens = delta.num_output_tokens
        if delta.timing is not None:
            self.timing = delta.timing
        spec, before = delta.spec, self.spec
        if spec is None:
            return
        # one router update a step, one delta an update: a delta adds at most one verify step
        if spec.verify_steps == (before.verify_steps if before else 0) + 1:
            drafted = spec.draft_tokens - (before.draft_tokens if before else 0)
            accepted = spec.accepted_tokens - (before.accepted_tokens if before else 0)
            self.steps.append((drafted, accepted))
        self.spec = spec


@dataclass(frozen=True)
class MetricsReport:
    """The server's per-request metrics settings; None (`of`) when neither is on."""

    timing: bool  # --enable-per-request-metrics
    spec_level: str  # --per-request-spec-decode-metrics: summary | detailed (none: no part)
    mtp_step: int  # the router's --mtp-step (0: MTP off, `speculative_decoding` null)

    @classmethod
    def of(cls, config: ServerConfig, mtp_step: int) -> MetricsReport | None:
        level = config.per_request_spec_decode_metrics
        if not config.enable_per_request_metrics and level == "none":
            return None
        return cls(config.enable_per_request_metrics, level, mtp_step)

    def field(self, choices: Sequence[ChoiceMetrics]) -> dict[str, Any]:
        """{"metrics": ...} for an answer of these choices."""
        if len(choices) != 1:
            return {"metrics": None}
        choice = choices[0]
        metrics: dict[str, Any] = {}
        if self.timing:
            metrics.update(timing_fields(choice.timing, choice.num_tokens))
        if self.spec_level != "none":
            metrics["speculative_decoding"] = (
                spec_fields(choice, self.mtp_step, self.spec_level == "detailed")
                if self.mtp_step
                else None
            )
        return {"metrics": metrics}


def timing_fields(timing: RequestTiming | None, num_tokens: int) -> dict[str, float | None]:
    """vLLM's timing fields in ms: TTFT from first scheduled, decode time from the first to the
    last token, queue time, mean ITL over the decode (null below two tokens), tokens per second
    from first scheduled to the last token; null where not known."""
    ms = 1000.0
    if timing is None:
        names = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms")
        return {**dict.fromkeys(names), "tokens_per_second": None}
    generated = num_tokens > 0
    inference = timing.ttft_s + timing.generation_s
    return {
        "time_to_first_token_ms": timing.ttft_s * ms if generated else None,
        "generation_time_ms": timing.generation_s * ms if generated else None,
        "queue_time_ms": timing.queue_s * ms,
        "mean_itl_ms": timing.generation_s * ms / (num_tokens - 1) if num_tokens > 1 else None,
        "tokens_per_second": num_tokens / inference if generated and inference > 0 else None,
    }


def spec_fields(choice: ChoiceMetrics, k: int, detailed: bool) -> dict[str, Any]:
    """vLLM's `metrics.speculative_decoding`: mean accept length (1 + accepted / verify steps),
    accepted / drafted, verify steps by accepted drafts (0..k) overall and by draft length (the
    lengths seen), the counts, k; with `detailed` each step's accepted and drafted counts."""
    spec = choice.spec or SpecCounts([[0] * (d + 2) for d in range(k)])
    steps, accepted, drafted = spec.verify_steps, spec.accepted_tokens, spec.draft_tokens
    fields: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_histogram": spec.histogram,
        "acceptance_histogram_by_draft_length": {
            str(d): list(row) for d, row in enumerate(spec.by_length, 1) if any(row)
        },
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": k,
    }
    if detailed:
        fields["per_step_accepted"] = [a for _, a in choice.steps]
        fields["per_step_drafted"] = [d for d, _ in choice.steps]
    return fields
