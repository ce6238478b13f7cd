"""The image-prompt parity tests of test_qwen3_vl_parity.py for the tiny Qwen3.5 VLM
(`Qwen3_5ForConditionalGeneration`: hybrid GDN text model, partial M-RoPE, no deepstack); a
separate module so that each file stays fast."""

from __future__ import annotations

import pytest

from tests.models.test_qwen3_vl_parity import (  # noqa: F401  (collected here with this `case`)
    make_case,
    test_greedy_matches_hf_generate,
    test_negative_controls,
    test_teacher_forced_logits_match_hf,
    test_token_by_token_matches_hf,
)


@pytest.fixture(scope="module", params=["qwen3_5_vl"])
def case(request, tmp_path_factory):
    yield from make_case(request.param, tmp_path_factory)
