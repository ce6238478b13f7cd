"""HF `architectures` name -> model class. The only place that picks a model family."""

from __future__ import annotations

import torch
from torch import nn

from appliance.models.config import TextConfig
from appliance.models.layers.parallel import tp_layout
from appliance.models.layers.quant import UnsupportedQuantization
from appliance.models.qwen3_5 import Qwen3_5ForCausalLM
from appliance.models.qwen3_5_mtp import build_draft_modules
from appliance.models.qwen3_vl import Qwen3VLForCausalLM

_TEXT_MODELS: dict[str, type[nn.Module]] = {
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3VLForConditionalGeneration": Qwen3VLForCausalLM,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLForCausalLM,
}


def register(architecture: str, cls: type[nn.Module]) -> None:
    _TEXT_MODELS[architecture] = cls


def model_class(cfg: TextConfig) -> type[nn.Module]:
    try:
        return _TEXT_MODELS[cfg.architecture]
    except KeyError:
        known = ", ".join(sorted(_TEXT_MODELS))
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported (known: {known})"
        ) from None


def quant_layout_problem(cfg: TextConfig, tp: int) -> str | None:
    """Why the model's quantised layers cannot be built over `tp` ranks (fused segments or a
    rank's rows cutting a weight-scale block: the message names the tensor-parallel size when a
    smaller one would do), found by building the model as a rank would, on the meta device (no
    memory, about a second for a 27B); None when they can. TextConfig.tp_problem covers what
    every model's widths need."""
    if cfg.quant is None:
        return None
    try:
        with tp_layout(0, tp), torch.device("meta"):
            model_class(cfg)(cfg)
    except UnsupportedQuantization as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - anything else is the workers' to report, as without it
        pass
    return None


# (text model_type, mtp_mode) -> builder(cfg, main_model, mode, step) -> list of draft modules
_DRAFTS = {
    (mt, mode): build_draft_modules
    for mt in ("qwen3_5", "qwen3_5_moe")
    for mode in ("vanilla", "eagle")
}


def draft_factory(cfg: TextConfig, mtp_mode: str):
    try:
        return _DRAFTS[(cfg.model_type.removesuffix("_text"), mtp_mode)]
    except KeyError:
        raise ValueError(
            f"MTP is not available for model_type {cfg.model_type!r} with mtp_mode {mtp_mode!r}"
        ) from None
