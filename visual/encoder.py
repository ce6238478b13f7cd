"""Vision encoder runner: checkpoint -> ViT on a device; pixels -> image embeddings (+deepstack).

Called by the visual server process (and by parity tests). API the server uses:

    encoder = VisionEncoder.from_pretrained(model_dir, device="cuda", dtype=torch.bfloat16)
    pixel_values, grid_thw = preprocess_images(images, encoder.preprocess)   # visual.preprocess
    embeds, deepstack = encoder.encode(pixel_values, grid_thw)
    per_image = encoder.split_per_image(embeds, grid_thw)                    # rows per image

`embeds` has one row per LLM image token ([sum t*h*w/merge^2, out_hidden]), images in input order;
`deepstack` holds one tensor of the same shape per `deepstack_visual_indexes` entry (Qwen3-VL;
empty for Qwen3.5). Deepstack tensor i is added to the image-token hidden states after LLM decoder
layer i.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from visual.preprocess import PreprocessConfig, preprocess_images
from visual.qwen_vit import QwenVisionTransformer, VisionConfig
from visual.weights import VisionCheckpointError, load_into, read_visual_tensors

logger = logging.getLogger(__name__)

# model_type of config.json -> does this family carry deepstack mergers
SUPPORTED_MODEL_TYPES = {
    "qwen3_vl": True,
    "qwen3_vl_moe": True,
    "qwen3_5": False,
    "qwen3_5_moe": False,
}


def read_vision_config(model_dir: str | Path) -> VisionConfig:
    """VisionConfig from `config.json`, with checks that the checkpoint is a supported VLM."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise VisionCheckpointError(f"no config.json in {model_dir}")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise VisionCheckpointError(
            f"model_type {model_type!r} has no supported vision tower; expected one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not raw.get("vision_config"):
        raise VisionCheckpointError(f"{path} has no vision_config")
    config = VisionConfig.from_hf(raw["vision_config"])
    if config.deepstack_visual_indexes and not SUPPORTED_MODEL_TYPES[model_type]:
        raise VisionCheckpointError(f"{model_type} checkpoints have no deepstack mergers")
    text_hidden = (raw.get("text_config") or {}).get("hidden_size")
    if text_hidden is not None and text_hidden != config.out_hidden_size:
        raise VisionCheckpointError(
            f"vision out_hidden_size {config.out_hidden_size} != text hidden_size {text_hidden}"
        )
    return config


class VisionEncoder:
    """A loaded vision tower plus the preprocessing settings of its checkpoint."""

    def __init__(
        self,
        tower: QwenVisionTransformer,
        preprocess: PreprocessConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.tower = tower.eval()
        self.config = tower.config
        self.preprocess = preprocess
        self.device = device
        self.dtype = dtype
        if preprocess.patch_dim != self.config.patch_dim or (
            preprocess.merge_size != self.config.spatial_merge_size
        ):
            raise VisionCheckpointError(
                "preprocessor_config.json (patch/temporal/merge size) does not match vision_config"
            )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        load_weights: bool = True,
    ) -> VisionEncoder:
        """Build the tower from `config.json`, load `model.visual.*` (or keep random weights when
        `load_weights` is False, for dummy runs), read `preprocessor_config.json` (HF defaults of
        the real checkpoints when the file is absent)."""
        model_dir = Path(model_dir)
        config = read_vision_config(model_dir)
        device = torch.device(device)
        with torch.device(device):
            tower = QwenVisionTransformer(config).to(dtype)
        if load_weights:
            load_into(tower, read_visual_tensors(model_dir))
        try:
            preprocess = PreprocessConfig.from_pretrained(model_dir)
        except FileNotFoundError:
            preprocess = PreprocessConfig(
                patch_size=config.patch_size,
                temporal_patch_size=config.temporal_patch_size,
                merge_size=config.spatial_merge_size,
            )
            logger.warning("%s has no preprocessor_config.json; using %s", model_dir, preprocess)
        num_params = sum(p.numel() for p in tower.parameters())
        logger.info(
            "vision tower: depth %d, hidden %d, out %d, deepstack %s, %.1f M params on %s/%s",
            config.depth,
            config.hidden_size,
            config.out_hidden_size,
            list(config.deepstack_visual_indexes),
            num_params / 1e6,
            device,
            dtype,
        )
        return cls(tower, preprocess, device, dtype)

    @property
    def merge_unit(self) -> int:
        return self.config.spatial_merge_size**2

    @torch.inference_mode()
    def encode(
        self, pixel_values: torch.Tensor | np.ndarray, grid_thw: torch.Tensor | np.ndarray
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [patches, patch_dim], grid_thw [images, 3] ->
        (embeds [tokens, out_hidden], deepstack: list of [tokens, out_hidden]) on the device."""
        pixel_values = torch.as_tensor(pixel_values).to(self.device, self.dtype)
        grids = [tuple(int(v) for v in row) for row in torch.as_tensor(grid_thw).tolist()]
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.config.patch_dim:
            raise ValueError(
                f"pixel_values: expected [patches, {self.config.patch_dim}], "
                f"got {list(pixel_values.shape)}"
            )
        return self.tower(pixel_values, grids)

    def encode_images(self, images: list[Image.Image]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Preprocess decoded RGB images and encode them in one forward."""
        pixel_values, grid_thw = preprocess_images(images, self.preprocess)
        return self.encode(pixel_values, grid_thw)

    def split_per_image(
        self, embeds: torch.Tensor, grid_thw: torch.Tensor | np.ndarray
    ) -> list[torch.Tensor]:
        """Cut encoder output rows back into one tensor per image (views, no copy)."""
        counts = [t * h * w // self.merge_unit for t, h, w in torch.as_tensor(grid_thw).tolist()]
        return list(embeds.split(counts))
