"""The embedded default model: a tiny random Qwen3.5 dense checkpoint with the test BPE tokenizer.

Resolved by `resolve_model_dir` (assets/resolve.py; the CLI and the offline `LLM`) when no model
is given, so the appliance starts (and CI runs end to end) without any download. Built once,
deterministically, under APPLIANCE_HOME/default-model-v<N>.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from appliance import envs
from appliance.logging import get_logger
from appliance.progress import Progress

logger = get_logger(__name__)

# Bump when the recipe below changes so old builds are not reused.
DEFAULT_MODEL_VERSION = 2  # 2: preprocessor_config.json with a pixel range fit for its tiny ViT
_RECIPE = {
    "moe": False,
    "layer_types": ["linear", "full", "linear", "full"],
    "seed": 0,
    "tokenizer": "bpe",
    "mtp": True,
}
_REQUIRED = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "preprocessor_config.json",
)


def default_model_dir() -> pathlib.Path:
    home = pathlib.Path(os.path.expanduser(envs.APPLIANCE_HOME))
    return home / f"default-model-v{DEFAULT_MODEL_VERSION}"


def _complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED)


def ensure_default_model() -> pathlib.Path:
    """Path of the default model directory, building it first if it is missing (a few seconds)."""
    target = default_model_dir()
    if _complete(target):
        return target
    from appliance.testing.tiny import build_qwen3_5  # torch + transformers only when building
    from appliance.testing.tiny_vl import write_preprocessor_config

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the embedded default model in %s", target)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".default-model-", dir=target.parent))
    try:
        with Progress("building the embedded default model"):
            build_qwen3_5(tmp, **_RECIPE)
            # Its own image preprocessing (small images: at most 64 image tokens), so the visual
            # server neither falls back with a warning nor reserves gigabytes for a tiny ViT.
            write_preprocessor_config(tmp)
        if target.exists() and not _complete(target):
            shutil.rmtree(target)  # leftover of an interrupted older layout
        try:
            os.rename(tmp, target)
        except OSError:  # another process renamed its build first
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
