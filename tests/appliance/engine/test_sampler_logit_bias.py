"""logit_bias in the worker's sampler: added to the named ids of every row of its request, before
sampling and logprobs; a request with a bias needs the edits the fused MTP step takes aside."""

from __future__ import annotations

import msgspec
import pytest
import torch

from appliance.engine.sampler import Sampler, apply_logit_bias, needs_edits
from appliance.messages import SamplingOptions, decoder, encode
from appliance.sampling_params import SamplingParams


def test_bias_moves_greedy_choice_and_logprobs() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [5.0, 1.0, 0.0, -1.0]])
    biased = SamplingOptions(temperature=0.0, logprobs=1, logit_bias={3: 100.0, 0: -100.0})
    plain = SamplingOptions(temperature=0.0, logprobs=1)
    out = Sampler("processed_logprobs").sample(logits, [biased, plain], None, [0, 0])
    assert out.token_ids.tolist() == [3, 0]
    # processed: the biased row's logprobs are those of the edited logits; the plain row's are
    # its own
    assert out.top_logprobs[0][0][0] == 3 and out.logprobs[0] > -1e-3
    assert abs(out.logprobs[1] - torch.log_softmax(logits[1], -1)[0].item()) < 1e-6
    raw = Sampler().sample(logits, [biased, plain], None, [0, 0])  # vLLM's default: unbiased
    assert raw.token_ids.tolist() == [3, 0] and raw.top_logprobs[0][0][0] == 0
    assert abs(raw.logprobs[0] - torch.log_softmax(logits[0], -1)[3].item()) < 1e-6


def test_bias_on_sampled_rows_and_every_row_of_a_request() -> None:
    logits = torch.zeros(3, 6)
    rows = [SamplingOptions(temperature=1.0, seed=7 + i, logit_bias={2: 100.0}) for i in range(3)]
    out = Sampler().sample(logits, rows, None, [0, 1, 2])
    assert out.token_ids.tolist() == [2, 2, 2]


def test_apply_logit_bias_adds_and_ignores_ids_past_vocab() -> None:
    logits = torch.zeros(2, 4)
    rows = [SamplingOptions(logit_bias={1: 2.5, 9: 50.0}), SamplingOptions()]
    out = apply_logit_bias(logits, rows)
    assert out.tolist() == [[0.0, 2.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert logits.abs().sum() == 0  # the input is not modified
    assert apply_logit_bias(logits, [SamplingOptions(), SamplingOptions()]) is logits


def test_logit_bias_requests_are_edited_and_zero_biases_are_dropped() -> None:
    assert needs_edits(SamplingParams(logit_bias={5: -3.0}).to_options(), 0)
    options = SamplingParams(logit_bias={5: 0.0}).to_options()
    assert options.logit_bias == {} and not needs_edits(options, 0)
    assert not needs_edits(SamplingParams().to_options(), 0)


def test_logit_bias_validation_and_wire_round_trip() -> None:
    for bad in ({5: 100.5}, {5: float("nan")}, {-1: 1.0}, {"5": 1.0}, {5: True}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    options = SamplingParams(logit_bias={5: -100, 7: 1.5}).to_options()
    assert decoder(SamplingOptions).decode(encode(options)) == options
    assert msgspec.structs.replace(options, seed=3).logit_bias == {5: -100.0, 7: 1.5}
