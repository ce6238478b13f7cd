"""Fixtures for the visual role's tests: a tiny Qwen3-VL checkpoint (one build per session)."""

from __future__ import annotations

import pytest

from appliance.testing.tiny_vl import build_tiny_qwen3_vl


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), tokenizer="none", seed=1)
