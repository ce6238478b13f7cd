"""POST /start_profile and /stop_profile: torch.profiler on every worker rank, as SGLang and vLLM
serve them (their bench_serving `--profile` POSTs the pair around a run). The switch rides in the
router's next plan; each rank writes `<output_dir>/<profile_id>-TP-<rank>.trace.json.gz`
(appliance/engine/profiler.py). The body is optional JSON, whatever its Content-Type; SGLang's
fields: `output_dir` (else APPLIANCE_TORCH_PROFILER_DIR, else <tmp>/appliance-profiles),
`num_steps` (stop by itself after so many device steps), `activities` (CPU, GPU, MEM; SGLang's
default CPU + GPU), `record_shapes`, `with_stack`, `profile_id` / `profile_prefix` (the file
stem). `start_step`, `profile_by_stage` and `merge_profiles` are refused when set; other fields
are ignored.

Used by app.py.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from appliance import envs
from appliance.messages import PROFILE_ACTIVITIES, ProfileAction, ProfileAnswer
from appliance.server.errors import BadRequest
from appliance.server.protocol import _Schema

START_TIMEOUT_S = 120.0  # the switch waits for the step in flight (a long prefill chunk)
STOP_TIMEOUT_S = 600.0  # writing the traces of many steps takes a while
_ALIASES = {"CUDA": "GPU"}  # vLLM's / torch's word for the device's kernels


class StartProfileRequest(_Schema):
    output_dir: str | None = None
    num_steps: int | None = Field(None, ge=1)
    activities: list[str] | None = None
    record_shapes: bool = False
    with_stack: bool = False
    profile_id: str | None = None
    profile_prefix: str | None = None
    # SGLang's, refused when set: an absolute step to start at, traces split by prefill / decode
    start_step: int | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False


def read_start_body(raw: bytes) -> StartProfileRequest | None:
    """The optional JSON body whatever its Content-Type (`curl -d` sends a form's); its errors
    as the app words any body's."""
    if not raw.strip():
        return None
    try:
        return StartProfileRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def start_action(body: StartProfileRequest | None) -> ProfileAction:
    """The workers' action for a start request; BadRequest naming a field it cannot take."""
    body = body or StartProfileRequest()
    for name in ("start_step", "profile_by_stage", "merge_profiles"):
        if getattr(body, name) not in (None, False):
            raise BadRequest(
                f"{name} is not supported: POST /start_profile when the steps to trace begin "
                "(num_steps bounds them); every rank writes one trace of every step",
                name,
            )
    asked = ["CPU", "GPU"] if body.activities is None else body.activities
    wanted = [_ALIASES.get(a.upper(), a.upper()) for a in asked]
    unknown = [a for a, w in zip(asked, wanted) if w not in PROFILE_ACTIVITIES]
    if unknown or not wanted:
        expected = ", ".join(PROFILE_ACTIVITIES)
        raise BadRequest(
            f"activities {body.activities}: expected a non-empty list of {expected}", "activities"
        )
    stem = body.profile_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"
    if body.profile_prefix:
        stem = f"{body.profile_prefix}-{stem}"
    if not re.fullmatch(r"[\w.\-]+", stem):
        raise BadRequest(
            f"profile id {stem!r}: letters, digits, '_', '-' and '.' only", "profile_id"
        )
    folder = body.output_dir or envs.APPLIANCE_TORCH_PROFILER_DIR
    folder = folder or os.path.join(tempfile.gettempdir(), "appliance-profiles")
    return ProfileAction(
        start=True,
        output_dir=os.path.abspath(os.path.expanduser(folder)),
        profile_id=stem,
        activities=list(dict.fromkeys(wanted)),
        record_shapes=body.record_shapes,
        with_stack=body.with_stack,
        num_steps=body.num_steps or 0,
    )


def answer_body(answer: ProfileAnswer, action: ProfileAction | None) -> dict[str, Any]:
    """The route's JSON for an applied switch; BadRequest with the reason for a refused one."""
    if not answer.ok:
        raise BadRequest(f"Profiling: {answer.message}.")
    if action is None:
        return {"message": "Stop profiling.", "detail": answer.message, "files": answer.files}
    return {
        "message": "Start profiling.",
        "detail": answer.message,
        "output_dir": action.output_dir,
        "profile_id": action.profile_id,
        "num_steps": action.num_steps or None,
    }
