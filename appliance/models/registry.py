"""HF `architectures` name -> model class. The only place that picks a model family."""

from __future__ import annotations

from torch import nn

from appliance.models.config import TextConfig
from appliance.models.qwen3_5 import Qwen3_5ForCausalLM

_TEXT_MODELS: dict[str, type[nn.Module]] = {
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
}


def register(architecture: str, cls: type[nn.Module]) -> None:
    _TEXT_MODELS[architecture] = cls


def model_class(cfg: TextConfig) -> type[nn.Module]:
    try:
        return _TEXT_MODELS[cfg.architecture]
    except KeyError:
        known = ", ".join(sorted(_TEXT_MODELS))
        raise ValueError(f"architecture {cfg.architecture!r} is not supported (known: {known})") from None
