"""torch.profiler over a run of engine steps, switched by the plans' ProfileActions (POST
/start_profile and /stop_profile, the offline LLM's start_profile / stop_profile).

Every rank runs the same plans, so every rank applies a switch at the same point: before its
plan's step is launched. A start profiles that step and the ones after it; a stop waits for the
device work of the steps still in flight (they belong to the trace), stops and writes
`<output_dir>/<profile_id>-TP-<rank>.trace.json.gz` (Chrome / Perfetto format). Each profiled
step is one `step <id>` range in the trace. After a switch the ranks sum who succeeded (one small
all-reduce, in the same place of every rank's sequence of collectives): a start that failed on
any rank is undone on all, and rank 0's report says how many ranks wrote their trace. Failures (a
folder that cannot be written) are reported to the router, never raised: profiling must not take
the engine down. (`num_steps` is the router's: it sends the stop.)

Used by appliance/engine/runner.py (submit).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import tempfile

import torch

from appliance.logging import get_logger
from appliance.messages import PROFILE_ACTIVITIES, ProfileAction, ProfileReport
from appliance.models.layers.parallel import all_reduce

logger = get_logger(__name__)


def trace_path(output_dir: str, profile_id: str, rank: int) -> str:
    return os.path.join(output_dir, f"{profile_id}-TP-{rank}.trace.json.gz")


class StepProfiler:
    """One rank's profiler: `apply` a plan's action, `step` around each launched step."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._prof: torch.profiler.profile | None = None
        self._action: ProfileAction | None = None
        self._steps = 0  # device steps launched while profiling

    def apply(self, action: ProfileAction) -> ProfileReport:
        """Every rank calls this for every action, whatever its own state (the sum below)."""
        if action.start:
            report = self._start(action) if self._prof is None else None
            started = self._ranks_agreeing(report is not None and report.ok)
            if report is None:
                return ProfileReport(False, "the profiler is already running", started=True)
            if report.ok and started < self.world_size:  # another rank could not: undo
                self._discard()
                return ProfileReport(False, f"{self.world_size - started} rank(s) could not start")
            return report
        report = self._stop() if self._prof is not None else None
        written = self._ranks_agreeing(report is not None and report.ok)
        if report is None:
            return ProfileReport(False, "the profiler is not running")
        if report.ok and written < self.world_size:
            message = f"{report.message}; {self.world_size - written} rank(s) wrote no trace"
            return ProfileReport(False, message, files=report.files)
        return report

    def step(self, step_id: int, device_step: bool) -> contextlib.AbstractContextManager:
        """The launch of one step as a named range in the trace (nothing when not profiling)."""
        if self._prof is None:
            return contextlib.nullcontext()
        self._steps += device_step
        return torch.profiler.record_function(f"step {step_id}")

    def _ranks_agreeing(self, ok: bool) -> int:
        if self.world_size == 1:
            return int(ok)
        count = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        return int(all_reduce(count).item())

    def _start(self, action: ProfileAction) -> ProfileReport:
        unknown = [a for a in action.activities if a not in PROFILE_ACTIVITIES]
        if unknown:
            expected = ", ".join(PROFILE_ACTIVITIES)
            return ProfileReport(False, f"unknown activities {unknown}: expected {expected}")
        try:
            os.makedirs(action.output_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=action.output_dir).close()
        except OSError as exc:
            return ProfileReport(False, f"cannot write traces to {action.output_dir!r}: {exc}")
        kinds = [torch.profiler.ProfilerActivity.CPU] if "CPU" in action.activities else []
        if "GPU" in action.activities and self.device.type == "cuda":
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        if not kinds:  # MEM alone (or GPU on a CPU run): the host's ops carry the allocations
            kinds = [torch.profiler.ProfilerActivity.CPU]
        self._prof = torch.profiler.profile(
            activities=kinds,
            record_shapes=action.record_shapes,
            profile_memory="MEM" in action.activities,
            with_stack=action.with_stack,
        )
        self._prof.start()
        self._action, self._steps = action, 0
        names = ", ".join(k.name for k in kinds)
        logger.info("profiler started (%s) -> %s", names, action.output_dir)
        return ProfileReport(True, f"profiling {names}", started=True)

    def _discard(self) -> None:
        prof, self._prof, self._action = self._prof, None, None
        if prof is not None:
            prof.stop()
        logger.warning("profiler stopped unwritten: another rank could not start it")

    def _stop(self) -> ProfileReport:
        prof, action, steps = self._prof, self._action, self._steps
        self._prof = self._action = None
        assert prof is not None and action is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the steps in flight are in the trace
        prof.stop()
        path = trace_path(action.output_dir, action.profile_id, self.rank)
        try:
            _export_gzipped(prof, path)
        except (OSError, RuntimeError) as exc:
            logger.error("profiler: writing %s failed: %s", path, exc)
            return ProfileReport(False, f"writing {path} failed: {exc}")
        logger.info("profiler stopped after %d steps: %s", steps, path)
        files = [
            trace_path(action.output_dir, action.profile_id, r) for r in range(self.world_size)
        ]
        return ProfileReport(True, f"{steps} steps profiled", files=files)


def _export_gzipped(prof: torch.profiler.profile, path: str) -> None:
    """The Chrome trace, gzipped (a trace of a few steps is tens of MB of JSON); the file appears
    whole or not at all."""
    fd, raw = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
    os.close(fd)
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path + ".part", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(path + ".part", path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(raw)
