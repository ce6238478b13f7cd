"""A training-only vision probe: predicts an image question's answer tokens from the picture's
merged vision tokens alone (one head per image family, the first `SLOTS` answer tokens).

Why: trained from scratch beside the language model, the ViT got almost no signal. The first
H200 build (2026-12-01, 2763 steps) answered every picture the same way ("red", "bottom right");
its merger output had grown to a norm of ~2600 per token that hardly varied between pictures. The
probe's loss reaches the ViT directly, so its tokens become discriminative early and the language
model only has to learn to read them. The probe is not part of the checkpoint (it is not a
submodule of the model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from ops.train import images
from ops.train.data import IMAGE_FAMILIES
from ops.train.sequences import Sequence

SLOTS = 3  # answer tokens predicted per picture ("top left", "NM6" take 2-3)


class VisionProbe(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, width: int = 512) -> None:
        super().__init__()
        self.vocab = vocab_size
        self.proj = nn.Linear(hidden_size * images.NUM_TOKENS, width)
        self.heads = nn.Linear(width, len(IMAGE_FAMILIES) * SLOTS * vocab_size)
        self._answer_ids: dict[str, list[int]] = {}  # answer text -> its first SLOTS token ids

    def forward(self, vision: torch.Tensor) -> torch.Tensor:
        """vision [images * NUM_TOKENS, H] -> logits [images, families, SLOTS, vocab]."""
        flat = vision.reshape(-1, self.proj.in_features).float()
        out = self.heads(F.gelu(self.proj(F.layer_norm(flat, flat.shape[-1:]))))
        return out.view(flat.shape[0], len(IMAGE_FAMILIES), SLOTS, self.vocab)

    def loss(self, vision: torch.Tensor, seqs: list[Sequence], tok: Tokenizer) -> torch.Tensor:
        """Cross-entropy of each picture's answer tokens under its family's head; `seqs` in the
        batch's order (one picture per image sequence, as collate stacks them)."""
        with_images = [s for s in seqs if s.pixels]
        if any(len(s.pixels) != 1 for s in with_images):
            raise ValueError("the vision probe takes one picture per sequence")
        family = torch.tensor([IMAGE_FAMILIES.index(s.family) for s in with_images])
        targets = torch.full((len(with_images), SLOTS), -100, dtype=torch.long)
        for i, s in enumerate(with_images):
            answer = s.example.answer
            if answer not in self._answer_ids:  # tokenized once, not at every step
                self._answer_ids[answer] = tok.encode(answer, add_special_tokens=False).ids[:SLOTS]
            ids = self._answer_ids[answer]
            targets[i, : len(ids)] = torch.tensor(ids)
        logits = self(vision)  # [N, F, S, V]
        picked = logits[torch.arange(len(with_images)), family.to(logits.device)]  # [N, S, V]
        return F.cross_entropy(picked.flatten(0, 1), targets.to(logits.device).flatten())
