"""The offline `LLM`'s keyword options: vLLM's spellings mapped to this appliance's settings, then
split over the engine's config sections. Called by offline/llm.py (and tests that build runners)."""

from __future__ import annotations

import os
from dataclasses import fields, replace

from appliance.config import EngineConfig
from appliance.logging import get_logger

logger = get_logger(__name__)


def build_engine_config(model_dir: str | None, tp: int, options: dict) -> EngineConfig:
    """Splits flat keyword options over the engine's config sections (model, scheduler, parallel,
    cache, kernels, graphs); unknown names raise ValueError naming the option."""
    sections = {f.name: f.default_factory() for f in fields(EngineConfig)}
    values: dict[str, dict] = {name: {} for name in sections}
    for key, value in options.items():
        owner = next((name for name, cfg in sections.items() if hasattr(cfg, key)), None)
        if owner is None:
            raise ValueError(f"{key}: unknown option")
        values[owner][key] = value
    values["model"]["model_dir"] = str(model_dir or "")
    values["parallel"]["tp"] = tp
    return EngineConfig(**{name: replace(cfg, **values[name]) for name, cfg in sections.items()})


def vllm_keywords(options: dict, tp: int, model: str | None) -> int:
    """vLLM's spellings of the same options, as `appliance serve` takes its flags
    (`tensor_parallel_size` for `tp`, `enforce_eager` ...) and the keywords of the flags that
    `appliance serve` translates (`speculative_config`, `enable_prefix_caching`, SGLang's
    `context_length` ..., flag_aliases.FOREIGN_FLAGS): moved to ours in `options`, an INFO line for
    each that changes nothing here; returns the tensor-parallel size. A keyword given as None means
    its default, as in vLLM (`quantization=None`, `max_model_len=None`). Theirs that mean something
    else here, or ask for what this appliance cannot do, raise ValueError naming them."""
    from appliance.flag_aliases import FLAG_ALIASES, FLAG_HINTS
    from appliance.flag_translation import keyword, translate_keywords

    for name in [name for name, value in options.items() if value is None]:
        del options[name]
    tokenizer = options.pop("tokenizer", model)
    if os.path.normpath(str(tokenizer)) != os.path.normpath(str(model)):
        raise ValueError(
            f"tokenizer: {tokenizer!r} differs from the model; the model folder's own tokenizer "
            "is used (leave tokenizer unset)"
        )
    foreign = translate_keywords(options)
    sections = [section.default_factory() for section in fields(EngineConfig)]
    for name, value in foreign.settings.items():
        if any(hasattr(section, name) for section in sections) or name == "vision":
            options[name] = value  # vision: the LLM's own keyword (no images, no ViT)
        else:  # reasoning, tool parsers ...: the HTTP server's (offline outputs are raw)
            source = foreign.sources[name]
            foreign.notes.append(f"{source}: ignored offline ({name} is a server setting)")
    for note in foreign.notes:
        logger.info(note)
    for ours, flags in FLAG_ALIASES.items():
        for theirs in map(keyword, flags):
            if theirs in options:
                value = options.pop(theirs)
                if ours == "tp":
                    tp = value
                else:
                    options[ours] = value
    for theirs, hint in ((keyword(flag), hint) for flag, hint in FLAG_HINTS.items()):
        if theirs in options:
            ours, _, why = hint.partition(" ")
            raise ValueError(f"{theirs}: use {keyword(ours)} {why}".rstrip())
    return tp


def read_priorities(priority: list[int] | None, num_prompts: int, policy: str) -> list[int]:
    """`LLM.generate`'s priority (vLLM's): one value a prompt, lower admitted first; values other
    than 0 only under the priority scheduling policy (a ValueError otherwise, as vLLM's)."""
    if priority is None:
        return [0] * num_prompts
    if len(priority) != num_prompts:
        raise ValueError(f"priority: {len(priority)} given for {num_prompts} prompts")
    if any(priority) and policy != "priority":
        raise ValueError(
            "priority: this LLM schedules first come, first served; make it with "
            'scheduling_policy="priority" to order requests by priority'
        )
    return [int(p) for p in priority]
