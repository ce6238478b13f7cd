"""fp32 HF references for parity tests: teacher-forced logits, greedy tokens, MTP draft logits.

Called by tests/models and tests/engine parity tests on checkpoints from `appliance.testing.tiny`.
The main model is transformers' Qwen3_5[Moe]ForCausalLM loaded from the checkpoint (VLM layout
included, models.md §3); MTP draft logits are computed from the raw `mtp.*` tensors (§5.2).
"""

from __future__ import annotations

import functools
import os
import pathlib

import torch
from safetensors import safe_open

from appliance.testing.tiny import MtpHead, fuse_experts


def _key(ckpt_dir: str | os.PathLike) -> tuple[str, tuple[int, ...]]:
    """Cache key: resolved path plus file mtimes, so a rebuilt checkpoint is reloaded."""
    path = pathlib.Path(ckpt_dir).resolve()
    stamps = tuple(p.stat().st_mtime_ns for p in sorted(path.glob("*.safetensors")))
    return str(path), stamps


def hf_model(ckpt_dir: str | os.PathLike) -> torch.nn.Module:
    """The checkpoint's text model as transformers' *ForCausalLM, fp32, eval (cached)."""
    return _load_main(*_key(ckpt_dir))


@functools.lru_cache(maxsize=8)
def _load_main(path: str, _stamps: tuple[int, ...]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_logits(ckpt_dir: str | os.PathLike, token_ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits of one sequence, no cache: [L, V] fp32; row t predicts token t+1."""
    model = hf_model(ckpt_dir)
    ids = torch.tensor([token_ids], dtype=torch.long)  # [1, L]
    return model(input_ids=ids, use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(
    ckpt_dir: str | os.PathLike, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy continuation of exactly `max_new_tokens` tokens (eos ignored), top-2 gap per step."""
    model = hf_model(ckpt_dir)
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, L]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = []
    for step_logits in out.logits:  # each [1, V]
        top2 = torch.topk(step_logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    if len(tokens) != max_new_tokens:
        raise RuntimeError(f"HF generate returned {len(tokens)} tokens, expected {max_new_tokens}")
    return tokens, gaps


def mtp_head(ckpt_dir: str | os.PathLike) -> MtpHead:
    """The checkpoint's MTP head (fp32, eval), loaded from its `mtp.*` tensors (cached)."""
    return _load_mtp(*_key(ckpt_dir))


@functools.lru_cache(maxsize=8)
def _load_mtp(path: str, _stamps: tuple[int, ...]) -> MtpHead:
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(path).get_text_config()
    moe = getattr(text_config, "num_experts", 0) > 0
    state: dict[str, torch.Tensor] = {}
    for file in sorted(pathlib.Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                if key.startswith("mtp."):
                    state[key[len("mtp.") :]] = handle.get_tensor(key).float()
    if not state:
        raise KeyError(f"{path}: no mtp.* tensors")
    head = MtpHead(text_config, moe)
    head.load_state_dict(fuse_experts(state), strict=True)
    return head.float().eval()


@torch.no_grad()
def hf_mtp_logits(ckpt_dir: str | os.PathLike, token_ids: list[int]) -> torch.Tensor:
    """MTP draft logits for every position: [L-1, V] fp32; row t predicts token t+2.

    Row t combines the main model's post-final-norm hidden state at t with the embedding of token
    t+1 (§5.2), runs the MTP decoder layer causally over positions 0..L-2, then `mtp.norm`, lm_head.
    """
    model = hf_model(ckpt_dir)
    head = mtp_head(ckpt_dir)
    ids = torch.tensor([token_ids], dtype=torch.long)  # [1, L]
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [1, L, H], post-norm
    next_embeds = model.model.embed_tokens(ids[:, 1:])  # [1, L-1, H]
    drafted = head(next_embeds, hidden[:, :-1])  # [1, L-1, H]
    return model.lm_head(drafted)[0].float()
