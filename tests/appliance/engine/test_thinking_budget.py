"""vLLM's thinking_token_budget: once a row's history holds `budget` tokens after its last <think>
with no </think> after it, </think> is the only token it samples (over every other edit, greedy
or sampled); rows whose reasoning ended, never began, or is under budget are untouched; the
params validate and carry the tokenizer's markers; offline, the model stops reasoning after the
budget, and with MTP (drafts verified against the same edit) it answers what MTP off answers."""

from __future__ import annotations

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.engine.sampler import Sampler, apply_thinking_budget, needs_edits, needs_history
from appliance.messages import SamplingOptions

START, END = 8, 9  # <think>, </think> in these toy rows


def budget(n: int, **knobs) -> SamplingOptions:
    knobs.setdefault("temperature", 0.0)
    return SamplingOptions(thinking_budget=n, think_start=START, think_end=END, **knobs)


def history(*ids: int) -> torch.Tensor:
    return torch.tensor(ids)


def test_the_end_marker_is_forced_once_the_budget_is_spent():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -3.0]]).repeat(6, 1)
    rows = [budget(2)] * 5 + [SamplingOptions(temperature=0.0)]
    histories = [
        history(1, START, 4),  # 1 token after <think>: under budget
        history(1, START, 4, 5),  # 2: forced
        history(1, START, 4, 5, END, 6, 7),  # reasoning ended: free
        history(1, 2, 3),  # no reasoning at all
        history(START, 1, END, 2, START, 3, 4, 5),  # a second <think>: 3 after it, forced
        history(1, START, 4, 5),  # no budget
    ]
    out = Sampler().sample(logits, rows, histories, [h.numel() for h in histories])
    assert out.token_ids.tolist() == [2, END, 2, 2, END, 2]
    zero = apply_thinking_budget(logits[:1], [budget(0)], [history(1, START)])
    assert zero[0].argmax() == END and torch.isinf(zero[0, :END]).all()  # budget 0: at once
    assert apply_thinking_budget(logits, [SamplingOptions()] * 6, None) is logits


def test_forcing_overrides_the_other_edits_and_sampled_rows():
    logits = torch.zeros(8, 10)
    row = budget(1, temperature=1.0, seed=3, logit_bias={END: -100.0}, allowed_token_ids=[1, 2])
    histories = [history(START, 4)] * 8
    out = Sampler().sample(logits, [row] * 8, histories, list(range(2, 10)))
    assert out.token_ids.tolist() == [END] * 8


def test_rows_with_a_budget_read_their_history_and_are_edited_in_the_fused_step():
    assert needs_history(budget(5)) and needs_edits(budget(5), 0)
    assert not needs_history(SamplingOptions()) and not needs_edits(SamplingOptions(), 0)


def test_params_validate_and_need_the_markers():
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)
    assert SamplingParams(thinking_token_budget=-1).to_options().thinking_budget == -1
    with pytest.raises(ValueError, match="thinking_token_budget: the <think>"):
        SamplingParams(thinking_token_budget=4).to_options()
    with pytest.raises(ValueError, match="no <think> and </think>"):
        SamplingParams(thinking_token_budget=4).with_reasoning_tokens(None, 7)
    options = SamplingParams(thinking_token_budget=4).with_reasoning_tokens(6, 7).to_options()
    assert (options.thinking_budget, options.think_start, options.think_end) == (4, 6, 7)
    assert SamplingParams().with_reasoning_tokens(None, None).to_options().thinking_budget == -1


def test_offline_the_reasoning_ends_after_the_budget(tiny_dense):
    llm = LLM(str(tiny_dense), max_num_seqs=4, num_kv_slots=2048, max_model_len=256)
    think = llm.tokenizer.hf.convert_tokens_to_ids("<think>")
    end = llm.tokenizer.hf.convert_tokens_to_ids("</think>")
    prompt = [11, 300, 42, think, 7]  # one reasoning token in the prompt already
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = llm.generate(prompt, free, use_tqdm=False)[0].token_ids
    assert end not in plain[:5]  # this greedy model would reason on
    for n in (0, 1, 4):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        limited = SamplingParams(**{**params.__dict__, "thinking_token_budget": n})
        ids = llm.generate(prompt, limited, use_tqdm=False)[0].token_ids
        forced_at = max(0, n - 1)  # the prompt's token counts
        assert ids[:forced_at] == plain[:forced_at] and ids[forced_at] == end, (n, ids)
