"""A tiny model that has learned something: trains the main model and its MTP head for a few seconds
on a deterministic synthetic language (each token is followed by perm[token]), so the draft head
really agrees with the main model. Used by the MTP acceptance tests through
`build_qwen3_5(..., train=train_permutation_language)`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NUM_SYMBOLS = 128  # the language uses token ids [0, NUM_SYMBOLS)


def permutation(seed: int = 0) -> torch.Tensor:
    return torch.randperm(NUM_SYMBOLS, generator=torch.Generator().manual_seed(seed))


def sample_sequences(perm: torch.Tensor, batch: int, length: int, gen: torch.Generator):
    seqs = torch.empty(batch, length, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, NUM_SYMBOLS, (batch,), generator=gen)
    for t in range(1, length):
        seqs[:, t] = perm[seqs[:, t - 1]]
    return seqs


def train_permutation_language(model, head, steps: int = 50, seed: int = 0) -> None:
    """Joint next-token (main) and next-next-token (MTP head) cross-entropy, Adam, fp32."""
    perm = permutation(seed)
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    model.train()
    head.train()
    lm = model.model.language_model
    for _ in range(steps):
        ids = sample_sequences(perm, 8, 16, gen)
        hidden = lm(input_ids=ids).last_hidden_state  # [B, L, H] post final norm
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        drafted = head(lm.embed_tokens(ids[:, 1:-1]), hidden[:, :-2])
        draft_logits = model.lm_head(drafted)
        loss = loss + F.cross_entropy(draft_logits.flatten(0, 1), ids[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    head.eval()
