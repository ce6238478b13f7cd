"""Greedy generation with the training model (batched, left-padded, full recompute per token) and
the held-out scoring: exact match per family and thinking mode, and the MTP k=2 accept length a
speculative decoder would see on those answers (drafts chained through the MTP layer, as the
engine's eagle mode does). Used at the end of ops/train/train_default.py."""

from __future__ import annotations

from collections import defaultdict

import torch
from tokenizers import Tokenizer

from ops.train.model import Qwen3_5Trainable
from ops.train.sequences import Sequence, collate


def _split_answer(text: str, thinking: bool) -> str:
    if thinking:
        if "</think>" not in text:
            return ""
        text = text.split("</think>", 1)[1]
    return text.strip()


@torch.no_grad()
def generate(
    model: Qwen3_5Trainable,
    seqs: list[Sequence],
    pad_id: int,
    stop_id: int,
    max_new: int,
    device: torch.device,
) -> list[list[int]]:
    """Greedy continuations (without the stop token) of prompt-only sequences."""
    out: list[list[int]] = [[] for _ in seqs]
    live = [list(s.ids) for s in seqs]
    done = [False] * len(seqs)
    for _ in range(max_new):
        batch, _ = collate(_grown(seqs, live), device, pad_id, left=True)
        with _autocast(device):
            hidden, _, _ = model(batch)
            logits = model.lm_head(hidden[:, -1])
        nxt = logits.float().argmax(-1).tolist()
        for i, t in enumerate(nxt):
            if done[i]:
                continue
            if t == stop_id:
                done[i] = True
            else:
                out[i].append(t)
                live[i].append(t)
        if all(done):
            break
    return out


def _grown(seqs: list[Sequence], live: list[list[int]]) -> list[Sequence]:
    """The prompt sequences with the tokens generated so far (text positions continue)."""
    grown = []
    for s, ids in zip(seqs, live):
        extra = len(ids) - len(s.ids)
        if extra:
            last = s.positions[:, -1:] if s.positions.shape[1] else torch.zeros(3, 1)
            tail = last + torch.arange(1, extra + 1)[None, :]
            positions = torch.cat([s.positions, tail], dim=1)
        else:
            positions = s.positions
        grown.append(
            Sequence(
                s.family,
                s.thinking,
                ids,
                len(ids),
                positions,
                s.rope_delta,
                s.pixels,
                s.example,
                s.image_pad,
            )
        )
    return grown


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def mtp_accept_lengths(
    model: Qwen3_5Trainable, full: list[Sequence], device: torch.device, pad_id: int, k: int = 2
) -> list[float]:
    """Per sequence (prompt + greedy answer): mean tokens per decode step with k chained drafts.
    Decode step at position p (last committed token x_p, its hidden h_p): the main model's bonus
    is x_{p+1}; draft 1 = MTP(x_{p+1}, h_p), draft j+1 = MTP(draft j, y_j); accepted drafts are
    the leading ones equal to the greedy tokens."""
    batch, _ = collate(full, device, pad_id)
    with _autocast(device):
        hidden, _, ctx = model(batch)
        emb = model.model.language_model.embed_tokens
        # row t: draft 1 = MTP(token t+1, h_t) predicts t+2; draft j+1 = MTP(draft j, y_j)
        drafts = []
        h = hidden
        tokens = torch.cat([batch.ids[:, 1:], batch.ids[:, -1:]], dim=1)
        for _ in range(k):
            y = model.mtp_hidden(emb(tokens), h, ctx)
            tokens = model.lm_head(y).float().argmax(-1)
            drafts.append(tokens)
            h = y
    drafts = [d.tolist() for d in drafts]  # one device copy per step, not one per token
    ids = batch.ids.tolist()
    results = []
    for i, s in enumerate(full):
        steps, tokens, p = 0, 0, s.prompt_len - 1
        end = len(s.ids) - 1
        while p + 1 <= end:
            accepted = 0
            for j in range(k):
                target = p + 2 + j
                if target > end or drafts[j][i][p] != ids[i][target]:
                    break
                accepted += 1
            steps += 1
            advance = 1 + accepted
            tokens += advance
            p += advance
        results.append(tokens / max(steps, 1))
    return results


def score(
    model: Qwen3_5Trainable,
    tok: Tokenizer,
    prompts: list[Sequence],
    device: torch.device,
    batch_size: int = 128,
    max_new: int = 64,
) -> dict:
    """Exact match per (family, thinking) and the mean MTP k=2 accept length."""
    pad_id = tok.token_to_id("<|endoftext|>")
    stop_id = tok.token_to_id("<|im_end|>")
    hits: dict[tuple[str, bool], list[int]] = defaultdict(list)
    accepts: list[float] = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    for start in range(0, len(order), batch_size):
        chunk = [prompts[i] for i in order[start : start + batch_size]]
        outs = generate(model, chunk, pad_id, stop_id, max_new, device)
        full = []
        for s, gen in zip(chunk, outs):
            text = tok.decode(gen, skip_special_tokens=True)
            ok = _split_answer(text, s.thinking) == s.example.answer
            hits[(s.family, s.thinking)].append(int(ok))
            ids = s.ids + gen + [stop_id]
            grown = _grown([s], [ids])[0]
            grown.prompt_len = len(s.ids)
            full.append(grown)
        accepts.extend(mtp_accept_lengths(model, full, device, pad_id))
    table = {
        f"{family}/{'think' if thinking else 'no_think'}": sum(v) / len(v)
        for (family, thinking), v in sorted(hits.items())
    }
    total = [x for v in hits.values() for x in v]
    return {
        "accuracy": table,
        "overall": sum(total) / len(total),
        "mtp_accept_length_k2": sum(accepts) / len(accepts),
    }
