"""Qwen-VL image preprocessing: smart resize, rescale + normalise, patchify — bit-exact with HF.

Called by the visual server (pixel values for the ViT) and by the API server (`image_grid` to know
how many `<|image_pad|>` tokens an image expands to, before any pixels are processed; `pixel_range`
to check a request's own resize range, vLLM's mm_processor_kwargs, against the ViT reservation).
Reproduces transformers' `Qwen2VLImageProcessorPil` (PIL BICUBIC resize on uint8, float64 rescale
cast to float32, float32 normalise, temporal broadcast, merge-window row order). Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from visual.image_io import ImageError, to_rgb

MAX_ASPECT_RATIO = 200  # the HF processor refuses longer strips


@dataclass(frozen=True)
class PreprocessConfig:
    patch_size: int = 16  # ViT patch side in pixels
    temporal_patch_size: int = 2  # frames per patch; a still image is repeated this many times
    merge_size: int = 2  # side of the window merged into one LLM token
    min_pixels: int = 65536  # smallest resized pixel count (HF size.shortest_edge)
    max_pixels: int = 16777216  # largest resized pixel count (HF size.longest_edge)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # per-channel mean after rescale
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)  # per-channel std after rescale
    rescale_factor: float = 1 / 255  # uint8 -> [0, 1]

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1")
        if self.max_pixels < self.min_pixels:
            raise ValueError("max_pixels: expected an integer >= min_pixels")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean/image_std: expected 3 values each")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (patch * merge)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per pixel_values row: C * T * P * P (1536 for Qwen3-VL / Qwen3.5)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, raw: dict) -> PreprocessConfig:
        """From a `preprocessor_config.json` dict (size.shortest/longest_edge or min/max_pixels)."""
        size = raw.get("size") or {}
        kwargs = {}
        for key in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            if raw.get(key) is not None:
                kwargs[key] = raw[key]
        min_pixels = raw.get("min_pixels", size.get("shortest_edge"))
        max_pixels = raw.get("max_pixels", size.get("longest_edge"))
        if min_pixels is not None:
            kwargs["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            kwargs["max_pixels"] = int(max_pixels)
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                value = raw[key]
                kwargs[key] = tuple(
                    float(v) for v in (value if isinstance(value, list) else [value] * 3)
                )
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> PreprocessConfig:
        """Read `preprocessor_config.json`, or `processor_config.json`'s `image_processor` part."""
        model_dir = Path(model_dir)
        path = model_dir / "preprocessor_config.json"
        if path.is_file():
            return cls.from_dict(json.loads(path.read_text()))
        path = model_dir / "processor_config.json"
        if path.is_file():
            return cls.from_dict(json.loads(path.read_text()).get("image_processor", {}))
        raise FileNotFoundError(
            f"no preprocessor_config.json or processor_config.json in {model_dir}"
        )


@dataclass(frozen=True)
class PreprocessedImage:
    pixel_values: np.ndarray  # [grid_h * grid_w * t, patch_dim] float32, merge-window row order
    grid_thw: tuple[int, int, int]  # (t, grid_h, grid_w) in patches
    num_tokens: int  # LLM positions (<|image_pad|> tokens): t * grid_h * grid_w / merge^2


def smart_resize(height: int, width: int, config: PreprocessConfig) -> tuple[int, int]:
    """Resized (height, width): multiples of patch*merge, pixel count in [min_pixels, max_pixels],
    aspect ratio kept as closely as possible. Same arithmetic as HF (round half to even)."""
    factor = config.factor
    if height < 1 or width < 1:
        raise ImageError(f"image has an invalid size {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
            f"{MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((height * width) / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar < factor or w_bar < factor:
        raise ImageError(f"image {width}x{height} is too small to preprocess")
    return h_bar, w_bar


def _rounding_bound(max_image_pixels: int, factor: int) -> float:
    """Largest h_bar * w_bar smart_resize's plain rounding can give an image of at most
    `max_image_pixels` pixels: (h + f/2)(w + f/2), with h + w largest at the steepest aspect."""
    ratio = MAX_ASPECT_RATIO
    side_sum = math.sqrt(max_image_pixels) * (math.sqrt(ratio) + 1 / math.sqrt(ratio))
    return max_image_pixels + factor / 2 * side_sum + factor**2 / 4


def worst_case_pixels(config: PreprocessConfig, max_image_pixels: int) -> int:
    """Upper bound of the resized pixel count (h_bar * w_bar) over every image smart_resize
    accepts (aspect ratio up to MAX_ASPECT_RATIO, at most `max_image_pixels` decoded pixels).

    The three regimes of smart_resize: plain rounding stays <= max_pixels; downscaling floors both
    sides but clamps the short one up to one factor, so a thin strip exceeds max_pixels (worst at
    the steepest aspect); upscaling ceils both sides, at most min_pixels + f*(h'+w') + f^2."""
    f = config.factor
    ratio = MAX_ASPECT_RATIO
    rounding = _rounding_bound(max_image_pixels, f)
    bound = min(config.max_pixels, rounding)
    if rounding > config.max_pixels:  # some admissible image takes the downscaling branch
        short = max(f, math.floor(math.sqrt(config.max_pixels / ratio) / f) * f)
        long = max(f, math.floor(math.sqrt(config.max_pixels * ratio) / f) * f)
        bound = max(bound, short * long)
    low = config.min_pixels
    upscaled = (math.sqrt(low / ratio) + f) * (math.sqrt(low * ratio) + f)
    return int(math.ceil(max(bound, upscaled)))


def pixel_range(
    config: PreprocessConfig, min_pixels: int, max_pixels: int, max_image_pixels: int
) -> PreprocessConfig:
    """`config` (the checkpoint's) resized to a request's own pixel range (0: the checkpoint's
    bound), if the ViT reservation, planned for the checkpoint's range, covers every image it can
    give. ValueError naming the bound ("max_pixels: ...") otherwise. The API server checks a
    request's range with it, the visual server each image's again."""
    if max_pixels > config.max_pixels:
        raise ValueError(
            f"max_pixels: {max_pixels} is above {config.max_pixels}, the checkpoint's largest "
            "(preprocessor_config.json size.longest_edge), which the ViT's memory is reserved for"
        )
    low, high = min_pixels or config.min_pixels, max_pixels or config.max_pixels
    if low > high and not min_pixels:
        raise ValueError(
            f"max_pixels: {high} is below {low}, the checkpoint's smallest (preprocessor_config"
            ".json size.shortest_edge); send a min_pixels too"
        )
    if low > high:
        whose = "" if max_pixels else "the checkpoint's "
        raise ValueError(f"min_pixels: {low} is above {whose}max_pixels {high}")
    wanted = replace(config, min_pixels=low, max_pixels=high)
    reserved = worst_case_pixels(config, max_image_pixels)
    if worst_case_pixels(wanted, max_image_pixels) > reserved:
        limit = _largest_min_pixels(wanted, max_image_pixels, reserved)
        raise ValueError(
            f"min_pixels: {low} would upscale some images past the ViT's memory reservation "
            f"(planned for the checkpoint's range); at most {limit}"
        )
    return wanted


def _largest_min_pixels(config: PreprocessConfig, max_image_pixels: int, reserved: int) -> int:
    """Largest min_pixels whose worst case stays within `reserved` (the worst case grows with
    min_pixels: the upscaling branch), found by bisection."""
    low, high = 1, config.min_pixels  # worst case fits at `low`: the checkpoint's min did
    while low < high:
        middle = (low + high + 1) // 2
        trial = replace(config, min_pixels=middle)
        if worst_case_pixels(trial, max_image_pixels) <= reserved:
            low = middle
        else:
            high = middle - 1
    return low


def image_grid(height: int, width: int, config: PreprocessConfig) -> tuple[int, int, int]:
    """(t, grid_h, grid_w) an image of this size will have; tokens = t*grid_h*grid_w / merge^2."""
    resized_h, resized_w = smart_resize(height, width, config)
    return 1, resized_h // config.patch_size, resized_w // config.patch_size


def num_image_tokens(height: int, width: int, config: PreprocessConfig) -> int:
    """Number of `<|image_pad|>` tokens (LLM positions) for an image of this size."""
    t, grid_h, grid_w = image_grid(height, width, config)
    return t * grid_h * grid_w // (config.merge_size**2)


def _normalise(resized: Image.Image, config: PreprocessConfig) -> np.ndarray:
    """uint8 RGB image -> [3, H, W] float32, in HF's order of operations and dtypes."""
    pixels = np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)  # [3, H, W]
    scaled = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    return (scaled - mean) / std


def _patchify(image: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    """[3, H, W] -> [grid_h * grid_w, 3 * T * P * P]; rows grouped per merge window."""
    channels, height, width = image.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return np.ascontiguousarray(patches).reshape(grid_h * grid_w, channels * t * p * p)


def preprocess_image(image: Image.Image, config: PreprocessConfig) -> PreprocessedImage:
    """One decoded image -> ViT input rows and its grid."""
    if image.mode != "RGB" or image.info.get("transparency") is not None:
        image = to_rgb(image)
    width, height = image.size
    resized_h, resized_w = smart_resize(height, width, config)
    resized = image.resize((resized_w, resized_h), resample=Image.Resampling.BICUBIC)
    pixel_values = _patchify(_normalise(resized, config), config)
    grid_h, grid_w = resized_h // config.patch_size, resized_w // config.patch_size
    return PreprocessedImage(
        pixel_values, (1, grid_h, grid_w), grid_h * grid_w // config.merge_size**2
    )


def preprocess_images(
    images: list[Image.Image], config: PreprocessConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Several images -> (pixel_values [sum N_i, patch_dim] float32,
    grid_thw [num_images, 3] int64), the same pair HF's processor returns for a batch."""
    processed = [preprocess_image(image, config) for image in images]
    pixel_values = np.concatenate([item.pixel_values for item in processed], axis=0)
    grid_thw = np.asarray([item.grid_thw for item in processed], dtype=np.int64)
    return pixel_values, grid_thw
