"""Examples -> token sequences (prompt through the chat template, completion, loss mask, images,
M-RoPE positions) and padded `Batch`es for ops/train/model.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from appliance.models.mrope import ImageSpan, mrope_positions
from ops.train import chat, images
from ops.train.data import Example
from ops.train.model import Batch


@dataclass
class Sequence:
    family: str
    thinking: bool
    ids: list[int]  # prompt (+ completion and <|im_end|> for training)
    prompt_len: int
    positions: torch.Tensor  # [3, len(ids)]
    rope_delta: int  # position - index after the last image
    pixels: list[np.ndarray]
    example: Example
    image_pad: int


def encode(
    tok: Tokenizer, example: Example, thinking: bool, with_completion: bool = True
) -> Sequence:
    prompt = chat.render(example.messages, example.tools, enable_thinking=thinking)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    image_pad = tok.token_to_id("<|image_pad|>")
    expanded: list[int] = []
    spans = []
    for t in ids:
        if t == image_pad:
            spans.append(ImageSpan(len(expanded), images.GRID))
            expanded.extend([image_pad] * images.NUM_TOKENS)
        else:
            expanded.append(t)
    if len(spans) != len(example.pixels):
        raise ValueError(
            f"{example.family}: {len(spans)} image slots, {len(example.pixels)} images"
        )
    prompt_len = len(expanded)
    if with_completion:
        completion = tok.encode(example.completion(thinking), add_special_tokens=False).ids
        expanded += completion + [tok.token_to_id("<|im_end|>")]
    positions, delta = mrope_positions(len(expanded), spans, images.MERGE)
    return Sequence(
        example.family,
        thinking,
        expanded,
        prompt_len,
        positions,
        delta,
        example.pixels,
        example,
        image_pad,
    )


def collate(
    seqs: list[Sequence], device: torch.device, pad_id: int, left: bool = False
) -> tuple[Batch, torch.Tensor]:
    """-> (Batch, loss mask [B, L] over target positions: 1 where ids[t] is a completion token).
    `left` pads on the left (generation); training pads on the right."""
    length = max(len(s.ids) for s in seqs)
    n = len(seqs)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    mask = torch.zeros(n, length)
    loss_mask = torch.zeros(n, length)
    positions = torch.zeros(3, n, length, dtype=torch.long)
    image_rows, pixels = [], []
    for i, s in enumerate(seqs):
        off = length - len(s.ids) if left else 0
        sl = slice(off, off + len(s.ids))
        ids[i, sl] = torch.tensor(s.ids)
        mask[i, sl] = 1
        loss_mask[i, off + s.prompt_len : off + len(s.ids)] = 1
        positions[:, i, sl] = s.positions
        if s.pixels:
            pad_rows = [j for j, t in enumerate(s.ids) if t == s.image_pad]
            image_rows.extend(i * length + off + j for j in pad_rows)
            pixels.extend(s.pixels)
    batch = Batch(ids.to(device), mask.to(device), positions.to(device))
    if pixels:
        raw = torch.from_numpy(np.stack(pixels)).to(device)
        batch.pixel_values = images.pixel_values(raw)
        batch.grids = [images.GRID] * len(pixels)
        batch.image_index = torch.tensor(image_rows, dtype=torch.long, device=device)
    return batch, loss_mask.to(device)
