"""Shared fixtures for the vision tests: tiny VLM checkpoints (one build per session), images."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from appliance.testing.tiny_vl import build_tiny_qwen3_5_vl, build_tiny_qwen3_vl


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), tokenizer="none", seed=1)


@pytest.fixture(scope="session")
def qwen3_vl_moe_dir(tmp_path_factory):
    # two deepstack mergers so their order is checked too
    return build_tiny_qwen3_vl(
        tmp_path_factory.mktemp("qwen3_vl_moe"),
        moe=True,
        tokenizer="none",
        seed=2,
        deepstack_visual_indexes=(0, 1),
    )


@pytest.fixture(scope="session")
def qwen3_5_vl_dir(tmp_path_factory):
    return build_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"), tokenizer="none", seed=3)


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels if channels > 1 else pixels[..., 0])  # RGB / RGBA / L by shape
    assert image.mode == mode, (image.mode, mode)
    return image


@pytest.fixture
def make_image():
    """random_image(width, height, seed=0, mode="RGB") -> PIL image of uniform random pixels."""
    return random_image
