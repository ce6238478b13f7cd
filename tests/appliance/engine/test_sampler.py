"""Worker sampler: exact penalty arithmetic, logprobs, seeds and batch invariance; and the
user-facing SamplingParams validation / to_options mapping it is fed from."""

from __future__ import annotations

import math

import pytest
import torch

from appliance.config import ModelConfig
from appliance.engine.logprobs_mode import LOGPROB_FLOOR
from appliance.engine.sampler import Sampler, apply_penalties, gather_logprobs
from appliance.messages import SamplingOptions
from appliance.sampling_params import SamplingParams

V = 6
BASE = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]])


def hist(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def test_repetition_penalty_hf_semantics_over_prompt_and_output() -> None:
    row = SamplingOptions(repetition_penalty=2.0)
    out = apply_penalties(BASE, [row], [hist(0, 1, 1, 3)], prompt_lens=[2])
    expected = [1.0, -2.0, 0.5, -1.0, 1.0, 0.0]  # seen 0 (+: /2), 1 and 3 (-: *2)
    assert out[0].tolist() == expected
    assert BASE[0, 0] == 2.0  # input untouched


def test_presence_and_frequency_count_output_tokens_only() -> None:
    row = SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [4, 2], output [2, 2, 5]: token 4 is prompt-only, 2 twice in the output, 5 once
    out = apply_penalties(BASE, [row], [hist(4, 2, 2, 2, 5)], prompt_lens=[2])
    expected = BASE[0].clone()
    expected[2] -= 0.5 + 2 * 0.25
    expected[5] -= 0.5 + 1 * 0.25
    assert torch.allclose(out[0], expected, atol=0, rtol=0)
    negative = SamplingOptions(presence_penalty=-1.0, frequency_penalty=-0.5)
    out = apply_penalties(BASE, [negative], [hist(4, 2, 2, 2, 5)], prompt_lens=[2])
    assert out[0, 2].item() == 0.5 + 1.0 + 1.0 and out[0, 4].item() == 1.0


def test_all_penalties_together_and_rows_without_them_untouched() -> None:
    rows = [
        SamplingOptions(),
        SamplingOptions(repetition_penalty=1.5, presence_penalty=0.1, frequency_penalty=0.2),
    ]
    logits = BASE.repeat(2, 1)
    out = apply_penalties(logits, rows, [hist(0), hist(1, 0, 0)], prompt_lens=[1, 1])
    assert out[0].tolist() == BASE[0].tolist()
    expected = BASE[0].clone()
    expected[0] = 2.0 / 1.5 - 0.1 - 2 * 0.2
    expected[1] = -1.0 * 1.5  # prompt token: repetition only
    assert torch.allclose(out[1], expected)


@pytest.mark.parametrize(
    "mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
)
def test_logprobs_report_what_the_mode_says(mode: str) -> None:
    """vLLM's --logprobs-mode: raw_* the model's logits (no penalty, no temperature),
    processed_* the ones the token was drawn from (penalised, over the temperature, top-k cut);
    *_logprobs their log-softmax, *_logits the values (-inf reads the floor)."""
    rows = [
        SamplingOptions(temperature=0.7, seed=1, logprobs=3, repetition_penalty=2.0, top_k=4),
        SamplingOptions(temperature=0.0, logprobs=0),
        SamplingOptions(temperature=0.0),
    ]
    logits = BASE.repeat(3, 1)
    history = [hist(0, 4), hist(0), hist(0)]
    out = Sampler(mode).sample(logits, rows, history, offsets=[5, 5, 5], prompt_lens=[1, 1, 1])
    penalised = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.5, 0.0])
    processed = penalised / 0.7
    processed[processed < processed.topk(4).values[-1]] = float("-inf")  # top_k 4
    values = {
        "raw_logprobs": torch.log_softmax(BASE[0], -1),
        "raw_logits": BASE[0],
        "processed_logprobs": torch.log_softmax(processed, -1),
        "processed_logits": processed.clamp(min=LOGPROB_FLOOR),
    }[mode]
    tok = out.token_ids[0].item()
    assert processed[tok] > float("-inf")  # drawn from the processed logits
    assert out.logprobs[0] == pytest.approx(values[tok].item(), abs=1e-5)
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(
        sorted(values.tolist())[::-1][:3], abs=1e-5
    )
    greedy = BASE[0] if mode.endswith("logits") else torch.log_softmax(BASE[0], -1)
    assert out.token_ids[1] == 0 and out.logprobs[1] == pytest.approx(greedy[0].item(), abs=1e-6)
    assert out.top_logprobs[1] == []
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    with pytest.raises(ValueError, match="logprobs_mode"):
        ModelConfig(logprobs_mode="sampled")


def test_seeded_rows_reproduce_and_are_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 400, generator=gen)
    rows = [
        SamplingOptions(temperature=1.0, seed=11),
        SamplingOptions(temperature=0.8, top_p=0.9, seed=12, frequency_penalty=0.3),
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=1.2, top_k=20, min_p=0.05, seed=14, repetition_penalty=1.3),
        SamplingOptions(temperature=1.0, seed=11),
    ]
    history = [torch.randint(0, 400, (n,), generator=gen) for n in (3, 9, 1, 30, 3)]
    plens = [2, 4, 1, 10, 2]
    offsets = [3, 9, 1, 30, 3]
    sampler = Sampler()
    batch = sampler.sample(logits, rows, history, offsets, plens).token_ids.tolist()
    again = sampler.sample(logits, rows, history, offsets, plens).token_ids.tolist()
    alone = [
        sampler.sample(
            logits[i : i + 1], [rows[i]], [history[i]], [offsets[i]], [plens[i]]
        ).token_ids.item()
        for i in range(5)
    ]
    assert batch == again == alone
    assert batch[2] == logits[2].argmax().item()
    assert batch[0] == batch[4]  # same logits, seed, history and offset


def test_offset_changes_the_draw_but_greedy_ignores_it() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the draw depends only on the noise
    row = [SamplingOptions(seed=3)]
    draws = {Sampler().sample(logits, row, None, [k]).token_ids.item() for k in range(30)}
    assert len(draws) > 25
    greedy = [SamplingOptions(temperature=0.0)]
    assert {Sampler().sample(logits, greedy, None, [k]).token_ids.item() for k in range(5)} == {0}


def test_sampled_row_without_seed_or_missing_inputs_is_an_error() -> None:
    with pytest.raises(ValueError, match="seed"):
        Sampler().sample(BASE, [SamplingOptions(temperature=1.0)], None, [0])
    with pytest.raises(ValueError, match="token_history"):
        Sampler().sample(BASE, [SamplingOptions(seed=1, repetition_penalty=1.2)], None, [0])
    with pytest.raises(ValueError, match="prompt_lens"):
        Sampler().sample(BASE, [SamplingOptions(seed=1, presence_penalty=1)], [hist(1)], [0])
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(BASE, [SamplingOptions(), SamplingOptions()], None, [0, 0])


# ---------------------------------------------------------------- SamplingParams


def test_sampling_params_defaults_and_to_options() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n) == (16, 1.0, 1.0, -1, 1)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    opts = SamplingParams(
        temperature=0.5,
        top_k=0,
        top_p=0.9,
        min_p=0.1,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logprobs=5,
        stop="###",
    ).to_options()
    assert opts == SamplingOptions(
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        min_p=0.1,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logprobs=5,
    )
    assert (
        SamplingParams(stop="x").stop == ["x"] and SamplingParams(top_k=40).to_options().top_k == 40
    )
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.1),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("n", 0),
        ("seed", 2**64),
        ("seed", "1"),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_sampling_params_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        SamplingParams(**{field: value})


def test_top_logprobs_of_masked_tokens_are_finite() -> None:
    # a grammar mask leaves 2 tokens; 4 alternatives asked: the forbidden ones read the floor
    # (JSON has no -inf), the sampled token keeps its true logprob
    logits = torch.full((1, 8), float("-inf"))
    logits[0, 2], logits[0, 5] = 1.0, 1.0
    lp, tops = gather_logprobs(logits, logits, torch.tensor([5]), [SamplingOptions(logprobs=4)])
    assert lp[0] == pytest.approx(math.log(0.5))
    assert [round(v, 4) for _, v in tops[0]] == [-0.6931, -0.6931, LOGPROB_FLOOR, LOGPROB_FLOOR]
