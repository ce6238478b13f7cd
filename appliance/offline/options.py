"""The offline `LLM`'s keyword options: vLLM's spellings mapped to this appliance's settings, then
split over the engine's config sections. Called by offline/llm.py (and tests that build runners)."""

from __future__ import annotations

import os
from dataclasses import fields, replace

from appliance.config import EngineConfig

# vLLM's LLM keywords with no setting here that a script may pass harmlessly: no remote code ever
# runs (the model classes are built in), and the tokenizer is the model folder's own
IGNORED_KEYWORDS = ("trust_remote_code",)
# vLLM's LLM keywords for settings of ours the command line spells otherwise
KEYWORD_ALIASES = {"enable_prefix_caching": "prefix_caching"}


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
    (`tensor_parallel_size` for `tp`, `enforce_eager` ...): moved to ours in `options`; returns
    the tensor-parallel size. A keyword given as None means its default, as in vLLM
    (`quantization=None`, `max_model_len=None`). Theirs that mean something else here raise
    ValueError naming ours."""
    from appliance.flag_aliases import FLAG_ALIASES, FLAG_HINTS

    def keyword(flag: str) -> str:
        return flag.lstrip("-").replace("-", "_")

    for name in [name for name, value in options.items() if value is None]:
        del options[name]
    for name in IGNORED_KEYWORDS:
        options.pop(name, None)
    tokenizer = options.pop("tokenizer", model)
    if os.path.normpath(str(tokenizer)) != os.path.normpath(str(model)):
        raise ValueError(
            f"tokenizer: {tokenizer!r} differs from the model; the model folder's own tokenizer "
            "is used (leave tokenizer unset)"
        )
    for theirs, ours in KEYWORD_ALIASES.items():
        if theirs in options:
            options[ours] = options.pop(theirs)
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
