"""Worst-case ViT memory: the bound on an admissible image's resized pixels (checked against a
brute-force search over smart_resize, thin strips included), the CPU memory tracker (exact bytes on
known op sequences; meta run == real run), and the reservation arithmetic (margin, rounding,
override) of the `Reservation` the visual server reports in VisualInfo."""

from __future__ import annotations

import pytest
import torch

from visual.encoder import VisionEncoder
from visual.image_io import ImageError
from visual.preprocess import PreprocessConfig, smart_resize
from visual.reservation import (
    GIB,
    RESERVE_GRANULARITY,
    MemoryTracker,
    plan_reservation,
    reservation_bytes,
    tracked_peak,
    worst_case_grid,
    worst_case_pixels,
)

MIB = 2**20


def _brute_max(config: PreprocessConfig, max_image_pixels: int) -> int:
    """Largest h_bar * w_bar over images with h <= w (smart_resize is symmetric), sampled."""
    best = 0
    for h in range(1, 160):
        for w in range(h, min(200 * h, max_image_pixels // h) + 1, 1 if h < 24 else 5):
            try:
                rh, rw = smart_resize(h, w, config)
            except ImageError:
                continue
            best = max(best, rh * rw)
    return best


@pytest.mark.parametrize(
    "min_pixels,max_pixels,max_image_pixels",
    [
        (32 * 32, 128 * 128, 40_000_000),  # the tiny checkpoints: thin strips exceed max_pixels
        (32 * 32, 64 * 64, 1_000_000),
        (64 * 64, 96 * 96, 1_000_000),  # min close to max: upscaling dominates
        (32 * 32, 128 * 128, 3_000),  # tiny decoded-image cap
    ],
)
def test_worst_case_bound_covers_every_image(min_pixels, max_pixels, max_image_pixels):
    config = PreprocessConfig(min_pixels=min_pixels, max_pixels=max_pixels)
    bound = worst_case_pixels(config, max_image_pixels)
    brute = _brute_max(config, max_image_pixels)
    assert brute <= bound
    if max_image_pixels >= 1_000_000:
        assert bound == brute  # tight when strips can reach the downscaling branch
    t, h, w = worst_case_grid(config, max_image_pixels)
    assert t == 1 and h % config.merge_size == 0 and w % config.merge_size == 0
    assert h * w * config.patch_size**2 >= bound


def test_thin_strip_exceeds_max_pixels():
    """The brief's warning, concretely: a 17x3332 strip resizes past max_pixels."""
    config = PreprocessConfig(min_pixels=32 * 32, max_pixels=128 * 128)
    rh, rw = smart_resize(17, 3332, config)
    assert (rh, rw) == (32, 1792) and rh * rw == 57344 > config.max_pixels
    assert worst_case_pixels(config, 40_000_000) == 57344
    assert worst_case_grid(config, 40_000_000) == (1, 16, 16)  # 256 >= 224 patches


def test_real_checkpoint_defaults():
    config = PreprocessConfig()  # Qwen3-VL / Qwen3.5: 16 px patches, up to 16777216 pixels
    assert worst_case_pixels(config, 40_000_000) == config.max_pixels
    assert worst_case_grid(config, 40_000_000) == (1, 256, 256)  # 65536 patches per image


def test_reservation_rounding_and_margin():
    assert reservation_bytes(0) == 0
    assert reservation_bytes(1) == RESERVE_GRANULARITY
    assert reservation_bytes(100 * MIB) == 128 * MIB  # 110 MiB rounded up to 64 MiB steps
    assert reservation_bytes(int(10 * GIB / 1.1)) == 10 * GIB
    assert reservation_bytes(10 * GIB, margin=0.0, granularity=GIB) == 10 * GIB
    assert reservation_bytes(10 * GIB + 1, margin=0.0, granularity=GIB) == 11 * GIB
    with pytest.raises(ValueError, match="peak_bytes"):
        reservation_bytes(-1)


def test_memory_tracker_counts_live_storages():
    with torch.inference_mode(), MemoryTracker() as tracker:
        a = torch.ones(1000)  # 4000 B
        b = a * 2  # 4000 B, peak 8000
        view = b[:10]  # a view: no new storage
        del a  # freed before the next op counts
        c = torch.zeros(500, dtype=torch.float64)  # 4000 B: live b + c = 8000
        d = b + 1  # 12000 B live
        del b, c, d, view
        e = torch.empty(10, dtype=torch.uint8)
    assert tracker.peak == 12_000
    assert tracker.current == 10  # only e
    del e


def test_meta_estimate_equals_a_real_cpu_run(qwen3_vl_dir):
    encoder = VisionEncoder.from_pretrained(qwen3_vl_dir)
    grids = [(1, 8, 8), (1, 16, 4), (1, 4, 4)]
    meta = tracked_peak(encoder, grids)
    patches = sum(t * h * w for t, h, w in grids)
    with torch.inference_mode(), MemoryTracker() as tracker:
        pixel_values = torch.randn(patches, encoder.config.patch_dim)
        encoder.tower(pixel_values.to(encoder.dtype), grids)
        del pixel_values
    assert meta == tracker.peak > 0
    # more images in the batch need more memory
    assert tracked_peak(encoder, grids * 2) > meta


def test_plan_reservation_measured_and_overridden(qwen3_vl_dir):
    encoder = VisionEncoder.from_pretrained(qwen3_vl_dir)
    plan = plan_reservation(encoder, max_image_pixels=40_000_000, batch_size=3)
    grid = worst_case_grid(encoder.preprocess, 40_000_000)
    assert plan.worst_case_grid == grid == (1, 16, 16) and plan.batch_size == 3
    assert plan.peak_bytes == tracked_peak(encoder, [grid] * 3)
    assert plan.reserved_bytes == reservation_bytes(plan.peak_bytes) >= plan.peak_bytes * 1.1
    assert plan.device == "cpu"
    fixed = plan_reservation(encoder, 40_000_000, 3, reserved_mem_gb=1.5)
    assert fixed.peak_bytes == -1 and fixed.reserved_bytes == int(1.5 * GIB)
    assert fixed.worst_case_grid == grid and fixed.batch_size == 3
    none = plan_reservation(encoder, 40_000_000, 3, reserved_mem_gb=0)
    assert none.reserved_bytes == 0
