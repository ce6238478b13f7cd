"""HF oracle helpers: teacher-forced logits, greedy tokens with top-2 gaps, MTP draft logits."""

from __future__ import annotations

import torch

from appliance.testing.oracle import hf_greedy, hf_logits, hf_model, hf_mtp_logits

PROMPT = [(i * 53 + 7) % 1990 for i in range(70)]  # > 64 tokens: crosses a GDN chunk boundary


def test_greedy_matches_teacher_forced_argmax(tiny_dense):
    tokens, gaps = hf_greedy(tiny_dense, PROMPT, 12)
    assert len(tokens) == 12 and len(gaps) == 12
    assert all(g >= 0 for g in gaps)
    logits = hf_logits(tiny_dense, PROMPT + tokens)  # [82, V]
    assert logits.shape == (82, 2000)
    steps = logits[len(PROMPT) - 1 : -1]  # rows predicting each generated token
    assert steps.argmax(-1).tolist() == tokens
    top2 = steps.topk(2, dim=-1).values
    assert torch.allclose(top2[:, 0] - top2[:, 1], torch.tensor(gaps), atol=1e-3)


def test_hf_model_is_cached_fp32_eval(tiny_dense):
    model = hf_model(tiny_dense)
    assert model is hf_model(tiny_dense)
    assert not model.training and next(model.parameters()).dtype == torch.float32


def test_mtp_logits_finite_deterministic_and_equal_transformers_mtp(tiny_dense):
    drafts = hf_mtp_logits(tiny_dense, PROMPT)  # [L-1, V]
    assert drafts.shape == (len(PROMPT) - 1, 2000)
    assert torch.isfinite(drafts).all() and 0.5 < drafts.std().item() < 2.0
    assert torch.equal(drafts, hf_mtp_logits(tiny_dense, PROMPT))
    # causal: a prefix gives the same rows
    assert torch.allclose(hf_mtp_logits(tiny_dense, PROMPT[:30]), drafts[:29], atol=1e-5)
    # independent derivation: transformers' generic MtpModel (needs the two config fields, §5.4)
    from transformers.modeling_layers import MtpModel

    main = hf_model(tiny_dense)
    main.config.num_mtp_layers = 1
    main.config.mtp_layer_types = ["full_attention"]
    mtp = MtpModel.from_pretrained(main).float().eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden = main.model(input_ids=ids).last_hidden_state  # [1, L, H]
        positions = torch.arange(1, len(PROMPT)).view(1, -1)
        out = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=ids[:, 1:])
        reference = mtp._project_to_logits(out)[0]
    assert (reference - drafts).abs().max().item() < 1e-4


def test_moe_mtp_logits(tiny_moe):
    drafts = hf_mtp_logits(tiny_moe, PROMPT[:40])
    assert drafts.shape == (39, 2000) and torch.isfinite(drafts).all()
    assert torch.equal(drafts, hf_mtp_logits(tiny_moe, PROMPT[:40]))
