"""Image prompts through the engine against transformers (fp32, CPU) for tiny Qwen3-VL dense,
Qwen3-VL MoE (transposed fused experts, as on the Hub) and Qwen3.5 VLM checkpoints: teacher-forced
logits at every position for a batch [1 image, 2 images of different sizes, text only] in one shot,
with chunked prefill that cuts images, and token by token; greedy continuations; and negative
controls showing the comparison sees the image embeddings, M-RoPE positions and deepstack."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import appliance.engine.mm_inputs as mm_inputs
from appliance.models.mrope import MRopeLayout
from appliance.testing.tiny_vl import build_tiny_qwen3_5_vl, build_tiny_qwen3_vl
from tests.models.qwen3_vl_oracle import (
    Driver,
    engine,
    hf_greedy,
    hf_logits,
    make_prompt,
    random_image,
)

FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5_vl"]
NUM_EXTRA = 10  # teacher-forced tokens after each prompt (decode-side positions: index + delta)


def build(family: str, out) -> object:
    if family == "qwen3_vl":
        return build_tiny_qwen3_vl(out, tokenizer="none", seed=11)
    if family == "qwen3_vl_moe":
        # two deepstack layers; experts rewritten to the Hub's [E, H, 2I] / [E, I, H]
        return build_tiny_qwen3_vl(
            out, moe=True, tokenizer="none", seed=12, deepstack_visual_indexes=(0, 1)
        )
    return build_tiny_qwen3_5_vl(out, tokenizer="none", seed=13)


@dataclass
class Case:
    family: str
    ckpt: object
    prompts: list
    extra: list[int]
    driver: Driver
    _ref: dict[int, torch.Tensor] = field(default_factory=dict)

    def ref_logits(self, index: int) -> torch.Tensor:
        """HF teacher-forced logits of prompts[index] + extra (computed once per module)."""
        if index not in self._ref:
            self._ref[index] = hf_logits(self.ckpt, self.prompts[index], self.extra)
        return self._ref[index]


def make_case(family: str, tmp_path_factory):
    # One thread: these tiny models gain nothing from two, and on busy shared cores many small
    # ops waiting on a second OpenMP thread were seen to take ten times longer.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ckpt = build(family, tmp_path_factory.mktemp(family))
    prompts = [
        make_prompt(ckpt, [7, random_image(64, 64, 1), 9], seed=0),  # grid 1x4x4: 4 tokens
        make_prompt(ckpt, [3, random_image(128, 64, 2), 4, random_image(48, 96, 3), 6], seed=1),
        make_prompt(ckpt, [20], seed=2),  # text only, in the same batch
    ]
    gen = torch.Generator().manual_seed(3)
    extra = torch.randint(0, 1900, (NUM_EXTRA,), generator=gen).tolist()
    runner = engine(ckpt)
    yield Case(family, ckpt, prompts, extra, Driver(runner, ckpt))
    torch.set_num_threads(threads)
    assert not runner.mm.requests  # every slot released


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    yield from make_case(request.param, tmp_path_factory)


def cuts_an_image(prompt, chunk: int) -> bool:
    """Some chunk boundary (a multiple of `chunk`) falls strictly inside an image."""
    return any(
        span.offset // chunk != (span.offset + span.num_tokens(2) - 1) // chunk
        for span in prompt.spans
    )


@pytest.mark.parametrize("chunk", [1000, 5])
def test_teacher_forced_logits_match_hf(case, chunk):
    prompts = case.prompts
    if chunk == 5:
        assert all(cuts_an_image(p, chunk) for p in prompts[:2])
    assert [p.grid_thw.tolist() for p in prompts[:2]] == [[[1, 4, 4]], [[1, 4, 8], [1, 6, 4]]]
    seqs = [p.token_ids + case.extra for p in prompts]
    mine = case.driver.logits(prompts, seqs, chunk)
    for index, got in enumerate(mine):
        ref = case.ref_logits(index)
        assert ref.std() > 0.5  # the oracle is not near-uniform
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)


def test_token_by_token_matches_hf(case):
    prompt = case.prompts[1]  # two images, each computed one token per step
    (got,) = case.driver.logits([prompt], [prompt.token_ids + case.extra], chunk=1)
    torch.testing.assert_close(got, case.ref_logits(1), atol=1e-3, rtol=0)


def test_greedy_matches_hf_generate(case):
    outs = case.driver.greedy(case.prompts, 12, chunk=6)
    skipped = 0
    for prompt, out in zip(case.prompts, outs):
        ref, gaps = hf_greedy(case.ckpt, prompt, 12)
        assert len(out) == 12
        for step, (a, b) in enumerate(zip(out, ref)):
            if a != b:
                # only a near-tie of the reference may flip; after it the continuations diverge
                assert gaps[step] < 1e-3, f"step {step}: {a} != {b} (gap {gaps[step]:.4f})"
                skipped += 1
                break
    assert skipped <= 1


def _max_error(case: Case, after_admit=None) -> float:
    prompt = case.prompts[1]
    (got,) = case.driver.logits([prompt], [prompt.token_ids + case.extra], 1000, after_admit)
    return float((got - case.ref_logits(1)).abs().max())


def test_negative_controls(case, monkeypatch):
    """The parity above would fail without the splice, the M-RoPE positions or the deepstack."""
    assert _max_error(case) < 1e-3

    def zero_rows(rows: slice):
        def edit() -> None:
            for req in case.driver.runner.mm.requests.values():
                for tensor in req.embeds:
                    tensor[rows] = 0

        return edit

    assert _max_error(case, zero_rows(slice(0, 1))) > 0.05
    if case.family != "qwen3_5_vl":
        assert case.driver.runner.model.num_deepstack == (1 if case.family == "qwen3_vl" else 2)
        assert _max_error(case, zero_rows(slice(1, None))) > 0.01

    class TextPositions(MRopeLayout):
        def positions(self, start, end, device="cpu"):
            return torch.arange(start, end, device=device).expand(3, -1).clone()

    monkeypatch.setattr(mm_inputs, "MRopeLayout", TextPositions)
    assert _max_error(case) > 0.01
