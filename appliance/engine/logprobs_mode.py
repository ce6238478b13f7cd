"""What sampled tokens' logprobs report, by vLLM's `--logprobs-mode` (ModelConfig.logprobs_mode):

- raw_logprobs (the default, vLLM's): the log-softmax of the model's logits, before any edit of
  the request (penalties, bias, allowed ids, the grammar's mask, bad words, min_tokens) and
  before its temperature;
- processed_logprobs: the log-softmax of the logits the token was drawn from: every edit, then
  the temperature (greedy rows: none) and the top-k / top-p / min-p cut (-inf outside it);
- raw_logits / processed_logits: those logits themselves.

-inf (a token the request cannot sample) reads LOGPROB_FLOOR: JSON has no -inf. Prompt logprobs
(engine/prompt_logprobs.py) are the log-softmax of the model's logits in every mode. Called by the
eager sampler (engine/sampler.py) and the fused MTP step's edits (engine/verify_edits.py) on the
rows that report logprobs only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from appliance.engine.transfer import to_device
from appliance.messages import SamplingOptions
from appliance_kernels.sampling import SAMPLING_EPS
from appliance_kernels.sampling_ref import mask_logits_ref

LOGPROB_FLOOR = -9999.0  # the logprob reported for a token the request cannot sample (-inf)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax of logits [R, V] (fp32), clamped at LOGPROB_FLOOR (a row left nothing to
    sample, e.g. a grammar outside its allowed ids, reads the floor, not NaN: JSON has no NaN)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return torch.nan_to_num_(lp, nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)


def processed_logits(edited: torch.Tensor, rows: Sequence[SamplingOptions]) -> torch.Tensor:
    """The logits rows [R, V] were drawn from: `edited` (every edit applied) over the temperature
    (1 for greedy rows), then cut to top-k / top-p / min-p, as the sampling kernel cuts them."""
    device = edited.device

    def col(values: list[float], dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, device)

    temperature = [r.temperature if r.temperature >= SAMPLING_EPS else 1.0 for r in rows]
    scaled = edited.float() / col(temperature, torch.float32)[:, None]
    return mask_logits_ref(
        scaled,
        col([r.top_k for r in rows], torch.long),
        col([r.top_p for r in rows], torch.float32),
        col([r.min_p for r in rows], torch.float32),
    )


def reported(
    raw: torch.Tensor,  # [R, V] the model's logits of the rows
    edited: torch.Tensor,  # [R, V] the same after the request's edits
    rows: Sequence[SamplingOptions],
    mode: str,
) -> torch.Tensor:
    """The values [R, V] fp32 that the rows' logprobs report under `mode`."""
    values = raw.float() if mode.startswith("raw") else processed_logits(edited, rows)
    if mode.endswith("logprobs"):
        return log_probs(values)
    return torch.nan_to_num(values, nan=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
