"""M-RoPE position ids for prompts that contain images (models.md §4.4), and the decode rope delta.

Called by the worker (`appliance/engine/mm_inputs.py`) for every chunk of a multimodal request; the
rules match transformers' `get_rope_index` for Qwen3-VL and Qwen3.5 (checked in tests/models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSpan:
    offset: int  # index in the token sequence of the image's first <|image_pad|>
    grid_thw: tuple[int, int, int]  # ViT patch grid (t, h, w) before the spatial merge

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * (h // merge_size) * (w // merge_size)


class MRopeLayout:
    """Where a request's images sit and how they bend its positions.

    Text token j gets position j + shift(j) on all three rows (T, H, W), where shift(j) sums, over
    the images that end before j, max(h, w)/merge - tokens: the text after an image resumes at
    s + max(h, w)/merge, s being the image's first position. Image token (row r, column c) gets
    (s, s + r, s + c). Positions past the prompt follow the same rule, so decode positions are
    index + `rope_delta` on every row."""

    def __init__(self, images: Sequence[ImageSpan], merge_size: int) -> None:
        if merge_size < 1:
            raise ValueError(f"merge_size: expected an integer >= 1, got {merge_size}")
        self.merge_size = merge_size
        self.images = tuple(images)
        self.starts: list[int] = []  # first position of each image
        self.ends: list[int] = []  # index one past each image's last token
        shift, prev_end = 0, 0
        for span in self.images:
            t, h, w = span.grid_thw
            if t != 1:
                # Still images always have t == 1; transformers splits video into t == 1 spans.
                raise ValueError(f"image at offset {span.offset}: grid t={t}, expected 1")
            if h % merge_size or w % merge_size or h <= 0 or w <= 0:
                raise ValueError(
                    f"image at offset {span.offset}: grid {span.grid_thw} is not a "
                    f"positive multiple of merge size {merge_size}"
                )
            if span.offset < prev_end:
                raise ValueError(
                    f"image at offset {span.offset} overlaps the previous image "
                    f"(ends at {prev_end}); images must be sorted and disjoint"
                )
            n = span.num_tokens(merge_size)
            self.starts.append(span.offset + shift)
            shift += max(h, w) // merge_size - n
            prev_end = span.offset + n
            self.ends.append(prev_end)
        self.rope_delta = shift  # position - index for every token after the last image

    def positions(self, start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Positions of token indices [start, end): int64 [3, end - start] (rows T, H, W)."""
        index = torch.arange(start, end, dtype=torch.int64)
        shift = torch.zeros_like(index)
        for span, image_end in zip(self.images, self.ends):
            h, w = span.grid_thw[1:]
            shift += (index >= image_end).to(torch.int64) * (
                max(h, w) // self.merge_size - (image_end - span.offset)
            )
        pos = (index + shift).expand(3, -1).clone()  # [3, L]
        for span, first, image_end in zip(self.images, self.starts, self.ends):
            lo, hi = max(start, span.offset), min(end, image_end)
            if lo >= hi:
                continue
            grid_w = span.grid_thw[2] // self.merge_size
            # index of each covered token inside the image, row-major over the merged grid
            k = torch.arange(lo - span.offset, hi - span.offset, dtype=torch.int64)
            pos[0, lo - start : hi - start] = first
            pos[1, lo - start : hi - start] = first + k // grid_w
            pos[2, lo - start : hi - start] = first + k % grid_w
        return pos.to(device)


def mrope_positions(
    num_tokens: int, images: Sequence[ImageSpan], merge_size: int
) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] of a whole prompt and its rope delta (HF `get_rope_index` for one
    unpadded sequence: delta = max position + 1 - num_tokens)."""
    layout = MRopeLayout(images, merge_size)
    if layout.ends and layout.ends[-1] > num_tokens:
        raise ValueError(f"the last image ends at {layout.ends[-1]}, past {num_tokens} tokens")
    return layout.positions(0, num_tokens), layout.rope_delta


def image_spans(
    token_ids: Sequence[int],
    image_token_id: int,
    grids_thw: Sequence[Sequence[int]],
    merge_size: int,
) -> list[ImageSpan]:
    """Pair each run of `image_token_id` in an expanded prompt with its image's grid; a run must
    hold exactly t*h*w/merge² tokens (adjacent images are told apart by those counts)."""
    spans, i, n = [], 0, len(token_ids)
    grids = [tuple(int(v) for v in g) for g in grids_thw]
    while i < n:
        if token_ids[i] != image_token_id:
            i += 1
            continue
        if len(spans) == len(grids):
            raise ValueError(f"more image token runs than the {len(grids)} image grids given")
        span = ImageSpan(i, grids[len(spans)])
        count = span.num_tokens(merge_size)
        run = token_ids[i : i + count]
        if len(run) != count or any(t != image_token_id for t in run):
            raise ValueError(
                f"image {len(spans)} at offset {i}: expected {count} image tokens "
                f"for grid {span.grid_thw}"
            )
        spans.append(span)
        i += count
    if len(spans) != len(grids):
        raise ValueError(f"{len(grids)} image grids given but {len(spans)} image token runs found")
    return spans
