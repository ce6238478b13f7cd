"""The MTP verify step's time over a paused step's (plain decode + draft pass) at each captured
verify batch, measured by the runner once its graphs are captured (CUDA only) and sent to the
router in WorkerInfo, whose verify policy (router/mtp_policy.py) weighs it against the accept
length it sees."""

from __future__ import annotations

import torch

from appliance.engine.draft_graphs import DraftGraphs
from appliance.engine.graphs import DecodeGraphs
from appliance.engine.mtp_graphs import MtpGraphs


def _replay_ms(replays: list[torch.cuda.CUDAGraph], reps: int) -> float:
    """Mean device milliseconds of one replay of `replays` in order (after one warm-up)."""
    for graph in replays:
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for graph in replays:
            graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def verify_costs(
    verify: MtpGraphs, decode: DecodeGraphs, draft: DraftGraphs, reps: int = 5
) -> dict[int, float]:
    """{verify bucket: verify step ms / (decode + draft pass) ms}, on padding rows (every input at
    its padding value: the same weights, state and KV traffic per row as live requests, over a
    short context). Empty unless all three are captured."""
    if not (verify.graphs and decode.graphs and draft.graphs):
        return {}
    verify.inputs.stage([[] for _ in verify.inputs.pad])  # every column padding
    decode.inputs.stage([[] for _ in decode.inputs.pad])
    costs = {}
    for bs in verify.batch_sizes:
        plain_bs = decode.bucket(bs)  # the bucket a plain step of bs requests replays
        plain = _replay_ms([decode.graphs[plain_bs], draft.graphs[plain_bs]], reps)
        costs[bs] = _replay_ms(verify.graphs[bs], reps) / plain
    return costs
