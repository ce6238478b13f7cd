"""Session fixtures shared by every test: tiny Qwen3.5 checkpoints in the Hub layout (built once).

Also puts the repository root on sys.path so `import appliance` works without installing it.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from appliance.testing.tiny import build_qwen3_5  # noqa: E402

# Two layer patterns between them: dense ends on full attention, MoE ends on linear attention.
DENSE_LAYER_TYPES = ["linear", "full", "linear", "full"]
MOE_LAYER_TYPES = ["linear", "linear", "full", "linear"]


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory) -> pathlib.Path:
    """Qwen3_5ForConditionalGeneration layout, BPE vocab 2000, MTP head, seed 0."""
    return build_qwen3_5(
        tmp_path_factory.mktemp("tiny_dense"), layer_types=DENSE_LAYER_TYPES, seed=0
    )


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> pathlib.Path:
    """Qwen3_5MoeForConditionalGeneration layout (fused experts), 8 experts top-2, seed 1."""
    return build_qwen3_5(
        tmp_path_factory.mktemp("tiny_moe"), moe=True, layer_types=MOE_LAYER_TYPES, seed=1
    )


@pytest.fixture(scope="session")
def tiny_dense_qwen_vocab(tmp_path_factory) -> pathlib.Path:
    """Dense tiny model with the real Qwen3.5 tokenizer (vocab 248320, ~130 MB of fp32 weights)."""
    return build_qwen3_5(
        tmp_path_factory.mktemp("tiny_dense_qwen_vocab"),
        layer_types=DENSE_LAYER_TYPES,
        seed=2,
        tokenizer="qwen3.5",
    )


@pytest.fixture(scope="session")
def tiny_trained(tmp_path_factory) -> pathlib.Path:
    """Dense tiny model (and its MTP head) trained for a few seconds on a permutation language, so
    the draft head agrees with the main model (MTP acceptance tests)."""
    from appliance.testing.synthetic import train_permutation_language

    return build_qwen3_5(
        tmp_path_factory.mktemp("tiny_trained"),
        layer_types=DENSE_LAYER_TYPES,
        seed=5,
        train=train_permutation_language,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; run on the GPU machine with -m gpu")
