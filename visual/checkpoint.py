"""What a checkpoint folder says about image input, without torch: does it carry a vision tower,
which preprocessing settings does it use, which token stands for an image.

Called by the launcher (spawn the visual server or not, through appliance/encoder/startup.py), the
API server (accept image parts, count `<|image_pad|>` tokens) and the visual server; all three must
agree, so they read it here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from visual.preprocess import PreprocessConfig

VISION_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict; {} when the folder has none (a test server with no checkpoint)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def has_vision_tower(model_dir: str | Path) -> bool:
    """True for Qwen3-VL / Qwen3.5 multimodal checkpoints (a vision_config, not text-only)."""
    raw = read_config(model_dir)
    return (
        raw.get("model_type") in VISION_MODEL_TYPES
        and bool(raw.get("vision_config"))
        and not raw.get("language_model_only", False)
        and raw.get("image_token_id") is not None
    )


def image_token_id(model_dir: str | Path) -> int:
    """Id of `<|image_pad|>` (config.json image_token_id)."""
    raw = read_config(model_dir)
    if raw.get("image_token_id") is None:
        raise ValueError(f"{model_dir}: config.json has no image_token_id")
    return int(raw["image_token_id"])


def preprocess_config(model_dir: str | Path) -> PreprocessConfig:
    """The checkpoint's preprocessing settings; without a preprocessor file, the HF defaults with
    the vision tower's patch / temporal patch / merge sizes (what VisionEncoder falls back to)."""
    try:
        return PreprocessConfig.from_pretrained(model_dir)
    except FileNotFoundError:
        vision = read_config(model_dir).get("vision_config") or {}
        defaults = PreprocessConfig()
        return PreprocessConfig(
            patch_size=int(vision.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(
                vision.get("temporal_patch_size", defaults.temporal_patch_size)
            ),
            merge_size=int(vision.get("spatial_merge_size", defaults.merge_size)),
        )
