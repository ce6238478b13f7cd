"""The embedded default model, resolved by `resolve_model_dir` (assets/resolve.py; the CLI and the
offline `LLM`) when no model is given, so the appliance starts without any download.

The trained one: a small Qwen3.5 VLM with MTP shipped as package data in appliance/assets/default/
(built by `python -m ops.train.train_default`, see that folder's README.md), served in place when
its files are all there. Otherwise the fallback: a tiny random Qwen3.5 dense checkpoint with the
test BPE tokenizer, built once, deterministically, under APPLIANCE_HOME/default-model-v<N>.
"""

from __future__ import annotations

import json
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


SHIPPED_DIR = pathlib.Path(__file__).parent / "default"
_SHIPPED_REQUIRED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
)


def shipped_model_dir(folder: pathlib.Path | None = None) -> pathlib.Path | None:
    """The trained default model's folder (SHIPPED_DIR) when all its files are present (the shards
    named by the index, or one model.safetensors), else None."""
    folder = SHIPPED_DIR if folder is None else folder
    if not all((folder / name).is_file() for name in _SHIPPED_REQUIRED):
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return folder if all((folder / name).is_file() for name in shards) else None
    return folder if (folder / "model.safetensors").is_file() else None


def default_model_dir() -> pathlib.Path:
    home = pathlib.Path(os.path.expanduser(envs.APPLIANCE_HOME))
    return home / f"default-model-v{DEFAULT_MODEL_VERSION}"


def _complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED)


def ensure_default_model() -> pathlib.Path:
    """Path of the default model directory: the shipped trained model, else the random fallback
    (built first if it is missing, a few seconds)."""
    shipped = shipped_model_dir() if envs.APPLIANCE_DEFAULT_MODEL == "auto" else None
    if shipped is not None:
        return shipped
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
