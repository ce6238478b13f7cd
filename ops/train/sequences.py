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


def rendered(examples: list[Example]) -> list[tuple[Example, bool, str]]:
    """(example, thinking, prompt text) for each example with thinking on and off."""
    return [
        (e, th, chat.render(e.messages, e.tools, enable_thinking=th))
        for e in examples
        for th in (True, False)
    ]


def encode_many(
    tok: Tokenizer, items: list[tuple[Example, bool, str]], with_completion: bool = True
) -> list[Sequence]:
    """Batch tokenization (the tokenizer's threads) of `rendered` items."""
    prompts = tok.encode_batch([p for _, _, p in items], add_special_tokens=False)
    completions = [None] * len(items)
    if with_completion:
        texts = [e.completion(th) for e, th, _ in items]
        completions = tok.encode_batch(texts, add_special_tokens=False)
    return [
        _sequence(tok, e, th, p.ids, c.ids if c is not None else None)
        for (e, th, _), p, c in zip(items, prompts, completions)
    ]


def encode(
    tok: Tokenizer, example: Example, thinking: bool, with_completion: bool = True
) -> Sequence:
    return encode_many(tok, rendered([example])[0 if thinking else 1 :][:1], with_completion)[0]


def _sequence(
    tok: Tokenizer, example: Example, thinking: bool, ids: list[int], completion: list[int] | None
) -> Sequence:
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
    if completion is not None:
        expanded += completion + [tok.token_to_id("<|im_end|>")]
    if spans:
        positions, delta = mrope_positions(len(expanded), spans, images.MERGE)
    else:
        positions, delta = torch.arange(len(expanded)).expand(3, -1), 0
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
