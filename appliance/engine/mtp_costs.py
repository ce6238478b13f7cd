"""The MTP verify step's time over a paused step's (plain decode + draft pass) at each verify
batch, measured by the runner once its graphs are captured (CUDA) and sent to the router in
WorkerInfo, whose verify policy (router/mtp_policy.py) weighs it against the accept length it
sees. Uncaptured (tests on CPU) the same programs are timed eagerly."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from appliance.engine.draft_graphs import DraftGraphs
from appliance.engine.graphs import DecodeGraphs
from appliance.engine.mtp_graphs import MtpGraphs


def _time_ms(programs: list[Callable[[], None]], device: torch.device, reps: int) -> float:
    """Mean milliseconds of one run of `programs` in order (after one warm-up run)."""
    for run in programs:
        run()
    cuda = device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        began = time.perf_counter()
    for _ in range(reps):
        for run in programs:
            run()
    if not cuda:
        return (time.perf_counter() - began) * 1e3 / reps
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _verify_programs(verify: MtpGraphs, bs: int) -> list[Callable[[], None]]:
    if bs in verify.graphs:
        return [graph.replay for graph in verify.graphs[bs]]
    return [
        lambda: verify._verify_forward(bs),
        lambda: verify._verify_sample(bs),
        lambda: verify._draft(bs),
    ]


def _paused_programs(decode: DecodeGraphs, draft: DraftGraphs, bs: int) -> list[Callable[[], None]]:
    programs = [decode.graphs[bs].replay if bs in decode.graphs else lambda: decode._forward(bs)]
    programs.append(draft.graphs[bs].replay if bs in draft.graphs else lambda: draft._draft(bs))
    return programs


@torch.inference_mode()
def verify_costs(
    verify: MtpGraphs, decode: DecodeGraphs, draft: DraftGraphs, reps: int = 5
) -> dict[int, float]:
    """{verify bucket: verify step ms / (decode + draft pass) ms}, on padding rows (every input at
    its padding value: the same weights, state and KV traffic per row as live requests, over a
    short context)."""
    verify.inputs.stage([[] for _ in verify.inputs.pad])  # every column padding
    decode.inputs.stage([[] for _ in decode.inputs.pad])
    costs = {}
    for bs in verify.batch_sizes:
        paused = _time_ms(_paused_programs(decode, draft, decode.bucket(bs)), verify.device, reps)
        costs[bs] = _time_ms(_verify_programs(verify, bs), verify.device, reps) / paused
    return costs
