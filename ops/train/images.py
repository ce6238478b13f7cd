"""Generated pictures for the image families of the default model's instruction set: simple shapes
(colour, shape, count, position) and short text drawn on a background, 128x128 RGB (16 image
tokens under the default model's preprocessor: 8x8 patches of 16 px, 2x2 merge).

Pictures are drawn with PIL from a `random.Random` (no fonts from the system: the bitmap font built
into Pillow), so the same seed gives the same pixels everywhere. `pixel_values` turns a batch of
them into ViT rows exactly as visual/preprocess.py does for an image already at its resized size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

SIDE = 128  # pixels; a multiple of patch * merge (32), inside the preprocessor's pixel range
PATCH, MERGE, TEMPORAL = 16, 2, 2
GRID = (1, SIDE // PATCH, SIDE // PATCH)
NUM_TOKENS = (SIDE // PATCH) ** 2 // MERGE**2
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 180),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
TEXT_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


@dataclass(frozen=True)
class Picture:
    pixels: np.ndarray  # [SIDE, SIDE, 3] uint8
    answer: str


def _font() -> ImageFont.ImageFont:
    loader = getattr(ImageFont, "load_default_imagefont", None)  # Pillow >= 10.1
    return loader() if loader is not None else ImageFont.load_default()


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], rgb):
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=rgb)


def _canvas() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (SIDE, SIDE), (255, 255, 255))
    return image, ImageDraw.Draw(image)


def one_shape(rng: random.Random) -> tuple[np.ndarray, str, str]:
    """One shape anywhere: (pixels, colour, shape)."""
    image, draw = _canvas()
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    size = rng.randint(36, 64)
    x, y = rng.randint(4, SIDE - size - 4), rng.randint(4, SIDE - size - 4)
    _draw_shape(draw, shape, (x, y, x + size, y + size), COLOURS[colour])
    return np.asarray(image), colour, shape


def shape_in_quadrant(rng: random.Random) -> Picture:
    image, draw = _canvas()
    quadrant = rng.randrange(4)
    size = rng.randint(24, 40)
    half = SIDE // 2
    x = (quadrant % 2) * half + rng.randint(4, half - size - 4)
    y = (quadrant // 2) * half + rng.randint(4, half - size - 4)
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    _draw_shape(draw, shape, (x, y, x + size, y + size), COLOURS[colour])
    return Picture(np.asarray(image), POSITIONS[quadrant])


def several_shapes(rng: random.Random) -> Picture:
    """1 to 4 shapes, one per cell of a 2x2 grid (so they never overlap)."""
    image, draw = _canvas()
    count = rng.randint(1, 4)
    half = SIDE // 2
    for cell in rng.sample(range(4), count):
        size = rng.randint(20, 34)
        x = (cell % 2) * half + rng.randint(4, half - size - 4)
        y = (cell // 2) * half + rng.randint(4, half - size - 4)
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        _draw_shape(draw, shape, (x, y, x + size, y + size), COLOURS[colour])
    return Picture(np.asarray(image), str(count))


def text_picture(text: str, rng: random.Random) -> Picture:
    """`text` (3 characters of TEXT_CHARS) in the bitmap font, scaled 4x, on a light background:
    one character per merged image token column (a 6x11 glyph in each 8-pixel cell of the small
    canvas), starting in column 0 or 1 and on one of three rows. Unaligned text (a glyph across
    two tokens, jittered by pixels) was not learned at all by the first two H200 builds."""
    background = tuple(rng.randint(200, 255) for _ in range(3))
    small = Image.new("RGB", (SIDE // 4, SIDE // 4), background)
    draw, font = ImageDraw.Draw(small), _font()
    column, top = rng.randint(0, 1), rng.choice((0, 8, 16))
    for i, ch in enumerate(text):
        draw.text((8 * (column + i) + 1, top + 1), ch, fill=(0, 0, 0), font=font)
    image = small.resize((SIDE, SIDE), Image.Resampling.NEAREST)
    return Picture(np.asarray(image), text)


def pixel_values(pixels: torch.Tensor) -> torch.Tensor:
    """[N, SIDE, SIDE, 3] uint8 -> [N * 64, 1536] float32 ViT rows in merge-window order, as
    visual/preprocess.py computes them (float64 rescale cast to float32, mean/std 0.5)."""
    n = pixels.shape[0]
    x = (pixels.permute(0, 3, 1, 2).double() * (1 / 255)).float()  # [N, 3, S, S]
    x = (x - 0.5) / 0.5
    g = SIDE // PATCH
    x = x.reshape(n, 3, g // MERGE, MERGE, PATCH, g // MERGE, MERGE, PATCH)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [N, gh/m, gw/m, m, m, C, P, P]
    x = x[:, :, :, :, :, :, None].expand(*x.shape[:6], TEMPORAL, PATCH, PATCH)
    return x.reshape(n * g * g, 3 * TEMPORAL * PATCH * PATCH)
