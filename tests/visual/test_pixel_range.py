"""A request's own resize range (vLLM's mm_processor_kwargs min_pixels / max_pixels): the checks
against the ViT reservation planned for the checkpoint's range (visual.preprocess.pixel_range), and
the grid and pixels of an image resized to a range, against transformers' processor given the
same range per call."""

from __future__ import annotations

import numpy as np
import pytest

from tests.visual.test_image_preprocess import TINY, hf_processor
from tests.visual.test_reservation import _brute_max
from visual.preprocess import image_grid, pixel_range, preprocess_image, worst_case_pixels

MAX_IMAGE_PIXELS = 40_000_000


def test_unset_bounds_are_the_checkpoints():
    assert pixel_range(TINY, 0, 0, MAX_IMAGE_PIXELS) == TINY
    only_max = pixel_range(TINY, 0, 64 * 64, MAX_IMAGE_PIXELS)
    assert (only_max.min_pixels, only_max.max_pixels) == (TINY.min_pixels, 64 * 64)
    only_min = pixel_range(TINY, 64 * 64, 0, MAX_IMAGE_PIXELS)
    assert (only_min.min_pixels, only_min.max_pixels) == (64 * 64, TINY.max_pixels)
    assert only_min.factor == TINY.factor and only_min.image_mean == TINY.image_mean


@pytest.mark.parametrize(
    "low,high,words",
    [
        # the ViT's memory is reserved for the checkpoint's largest image: no more than that
        (0, 128 * 128 + 1, "max_pixels: 16385 is above 16384, the checkpoint's largest"),
        (32 * 32, 256 * 256, "max_pixels: 65536 is above 16384"),
        (64 * 64, 32 * 32, "min_pixels: 4096 is above max_pixels 1024"),
        (128 * 128 + 32, 0, "min_pixels: 16416 is above the checkpoint's max_pixels 16384"),
        (0, 512, "max_pixels: 512 is below 1024, the checkpoint's smallest"),
    ],
)
def test_a_range_outside_the_reservation_or_upside_down_is_refused(low, high, words):
    with pytest.raises(ValueError, match=words):
        pixel_range(TINY, low, high, MAX_IMAGE_PIXELS)


def test_min_pixels_is_capped_where_upscaling_would_pass_the_reservation():
    """Upscaling ceils both sides: a thin strip at a high min_pixels grows past max_pixels and past
    the worst case the reservation was measured for. The message names the largest min that fits,
    which is accepted, and its successor is not."""
    reserved = worst_case_pixels(TINY, MAX_IMAGE_PIXELS)
    with pytest.raises(ValueError, match=r"min_pixels: 16384 would upscale .* at most (\d+)") as e:
        pixel_range(TINY, 128 * 128, 128 * 128, MAX_IMAGE_PIXELS)
    limit = int(str(e.value).rsplit(" ", 1)[1])
    assert TINY.min_pixels < limit < 128 * 128
    config = pixel_range(TINY, limit, 0, MAX_IMAGE_PIXELS)
    assert worst_case_pixels(config, MAX_IMAGE_PIXELS) <= reserved
    with pytest.raises(ValueError, match="would upscale"):
        pixel_range(TINY, limit + 1, 0, MAX_IMAGE_PIXELS)


def test_every_image_of_an_accepted_range_fits_the_reservation():
    """Brute force over smart_resize: the largest image an accepted range gives is within the
    checkpoint's worst case (what the visual server reserved memory for)."""
    config = pixel_range(TINY, 48 * 48, 96 * 96, 1_000_000)
    assert _brute_max(config, 1_000_000) <= worst_case_pixels(TINY, 1_000_000)


@pytest.mark.parametrize("low,high", [(0, 64 * 64), (64 * 64, 96 * 96), (32 * 32, 48 * 48)])
@pytest.mark.parametrize("width,height", [(128, 128), (300, 200), (90, 170), (20, 28)])
def test_grid_and_pixels_for_a_range_match_hf_given_that_range(
    low, high, width, height, make_image
):
    """vLLM hands mm_processor_kwargs to the HF processor call; the grid the API server announces
    and the rows the visual server encodes are the processor's for that range."""
    config = pixel_range(TINY, low, high, MAX_IMAGE_PIXELS)
    image = make_image(width, height, seed=width + height)
    size = {"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels}
    reference = hf_processor(TINY)([image], size=size)
    ours = preprocess_image(image, config)
    assert list(ours.grid_thw) == reference["image_grid_thw"][0].tolist()
    assert ours.grid_thw == image_grid(height, width, config)
    assert np.array_equal(ours.pixel_values, reference["pixel_values"])


def test_a_smaller_max_pixels_gives_fewer_tokens():
    default = image_grid(128, 128, TINY)
    smaller = image_grid(128, 128, pixel_range(TINY, 0, 64 * 64, MAX_IMAGE_PIXELS))
    assert default == (1, 8, 8) and smaller == (1, 4, 4)  # 16 tokens -> 4
