"""visual.preprocess against transformers' Qwen2VLImageProcessorPil (HF oracle, models.md §7.5)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from visual.image_io import ImageError
from visual.preprocess import (
    PreprocessConfig,
    image_grid,
    num_image_tokens,
    preprocess_image,
    preprocess_images,
    smart_resize,
)

TINY = PreprocessConfig(min_pixels=32 * 32, max_pixels=128 * 128)


def hf_processor(config: PreprocessConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
    )


# (width, height): square, landscape, portrait, thin strip, needs upscaling, needs downscaling, tiny
SIZES = [(64, 64), (300, 200), (90, 170), (640, 12), (20, 28), (1001, 333), (7, 9)]


@pytest.mark.parametrize("width,height", SIZES)
def test_matches_hf_processor_bit_exactly(width, height, make_image):
    image = make_image(width, height, seed=width * 1000 + height)
    ours = preprocess_image(image, TINY)
    reference = hf_processor(TINY)([image])
    assert list(ours.grid_thw) == reference["image_grid_thw"][0].tolist()
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == reference["pixel_values"].shape
    assert np.array_equal(ours.pixel_values, reference["pixel_values"])  # byte-identical
    t, h, w = ours.grid_thw
    assert ours.num_tokens == t * h * w // 4 == num_image_tokens(height, width, TINY)


def test_batch_of_images_matches_hf(make_image):
    images = [make_image(64, 64, 1), make_image(120, 40, 2), make_image(33, 250, 3)]
    pixel_values, grid_thw = preprocess_images(images, TINY)
    reference = hf_processor(TINY)(images)
    assert grid_thw.dtype == np.int64
    assert np.array_equal(grid_thw, reference["image_grid_thw"])
    assert np.array_equal(pixel_values, reference["pixel_values"])
    assert pixel_values.shape[1] == 1536


def test_real_checkpoint_defaults_match_hf(make_image):
    # default pixel range of the released checkpoints: a 64x64 image is upscaled to 256x256
    config = PreprocessConfig()
    image = make_image(64, 64, seed=5)
    ours = preprocess_image(image, config)
    reference = hf_processor(config)([image])
    assert ours.grid_thw == (1, 16, 16) and ours.num_tokens == 64
    assert np.array_equal(ours.pixel_values, reference["pixel_values"])


def test_transparent_and_grey_images_match_hf(make_image):
    for image in (make_image(50, 70, seed=7, mode="RGBA"), make_image(45, 45, seed=8, mode="L")):
        ours = preprocess_image(image, TINY)
        reference = hf_processor(TINY)([image])
        assert np.array_equal(ours.pixel_values, reference["pixel_values"]), image.mode


def test_patch_rows_follow_merge_window_order():
    # a 64x32 image whose every 16x16 patch has one constant value: patch (row r, col c) = 10r + c
    patches = np.arange(4)[:, None] * 10 + np.arange(2)[None, :]  # [4 rows, 2 cols]
    pixels = np.kron(patches, np.ones((16, 16))).astype(np.uint8)
    image = Image.fromarray(np.repeat(pixels[..., None], 3, axis=2))
    config = PreprocessConfig(min_pixels=16, max_pixels=64 * 64)
    ours = preprocess_image(image, config)
    assert ours.grid_thw == (1, 4, 2)
    first_values = np.rint((ours.pixel_values[:, 0] * 0.5 + 0.5) * 255).astype(int)
    # window (0,0) holds patches (0,0) (0,1) (1,0) (1,1), then window (1,0)
    assert first_values.tolist() == [0, 1, 10, 11, 20, 21, 30, 31]
    # each row is (C, T, P, P): both temporal copies equal
    rows = ours.pixel_values.reshape(8, 3, 2, 16, 16)
    assert np.array_equal(rows[:, :, 0], rows[:, :, 1])


def test_smart_resize_agrees_with_hf_on_many_sizes():
    rng = np.random.default_rng(0)
    configs = [TINY, PreprocessConfig()]
    for _ in range(400):
        height, width = (int(v) for v in rng.integers(1, 5000, size=2))
        if max(height, width) / min(height, width) > 200:
            continue
        for config in configs:
            expected = hf_smart_resize(
                height, width, config.factor, config.min_pixels, config.max_pixels
            )
            got = smart_resize(height, width, config)
            assert got == expected, (height, width)
            assert got[0] % 32 == 0 and got[1] % 32 == 0
            # HF keeps at least one merge window per side, so thin strips may exceed max_pixels
            assert got[0] * got[1] <= config.max_pixels or min(got) == 32
            assert image_grid(height, width, config) == (1, got[0] // 16, got[1] // 16)


def test_extreme_aspect_ratio_is_an_image_error():
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 2010, TINY)


def test_config_from_preprocessor_json_matches_hf_loader(tmp_path, make_image):
    hf_processor(TINY).save_pretrained(tmp_path)
    config = PreprocessConfig.from_pretrained(tmp_path)
    assert config == TINY
    reloaded = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    image = make_image(100, 60, seed=9)
    assert np.array_equal(
        preprocess_image(image, config).pixel_values, reloaded([image])["pixel_values"]
    )


def test_config_accepts_legacy_min_max_pixels():
    config = PreprocessConfig.from_dict(
        {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "image_mean": [0.1, 0.2, 0.3],
        }
    )
    assert (config.min_pixels, config.max_pixels, config.patch_size) == (3136, 12845056, 14)
    assert config.image_mean == (0.1, 0.2, 0.3) and config.image_std == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="max_pixels"):
        PreprocessConfig(min_pixels=100, max_pixels=10)
