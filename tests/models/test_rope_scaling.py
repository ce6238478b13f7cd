"""RoPE scaling from config.json (linear, YaRN) against transformers, the context it serves, and a
clear refusal of the types not applied."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from appliance.models.config import load_text_config
from appliance.offline.llm import LLM
from appliance.testing.oracle import hf_logits
from tests.models.test_qwen3_5_parity import engine_logits, prompts

SCALINGS = {
    # a pretrained context of 64 puts most of the tiny model's rotary channels in YaRN's
    # interpolated band at these prompt lengths, and its attention factor is 1 + 0.1 ln 4
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "linear": {"rope_type": "linear", "factor": 3.0},
}


def _with_rope(src, dst, key="rope_parameters", top=None, **fields):
    """A copy of `src` whose text config's `key` gains `fields` (`rope_scaling`: a dict of its
    own beside rope_parameters, as Qwen's long-context recipe adds it); `top`: top-level keys."""
    shutil.copytree(src, dst)
    path = dst / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config", config)
    text.setdefault(key, {}).update(fields)
    text.update(top or {})
    path.write_text(json.dumps(config))
    return dst


CASES = {
    **{name: ("rope_parameters", fields) for name, fields in SCALINGS.items()},
    # a rope_scaling beside rope_parameters, in the legacy "type" spelling, with a top-level
    # original_max_position_embeddings (which wins, as in transformers)
    "yarn_rope_scaling": ("rope_scaling", {"type": "yarn", "factor": 8.0}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scaled_rope_matches_transformers(tiny_dense, tmp_path, name):
    key, fields = CASES[name]
    top = {"original_max_position_embeddings": 48} if key == "rope_scaling" else None
    ckpt = _with_rope(tiny_dense, tmp_path / name, key, top, **fields)
    scaling = load_text_config(ckpt).rope_scaling
    assert scaling.rope_type == fields.get("rope_type", fields.get("type"))
    reference = ckpt
    if top:
        assert scaling.original_max_position_embeddings == 48
        # transformers 5 takes a rope_scaling *instead of* rope_parameters (dropping the model's
        # rope_theta and M-RoPE sections); we read it over them, as the recipe means: the
        # reference is the same scaling written inside rope_parameters
        merged = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48}
        reference = _with_rope(tiny_dense, tmp_path / "reference", **merged)
    llm = LLM(str(ckpt), max_num_seqs=4, num_kv_slots=1024, max_model_len=256)
    plain = LLM(str(tiny_dense), max_num_seqs=4, num_kv_slots=1024, max_model_len=256)
    seqs = prompts(llm.runner.text_config.vocab_size, lens=[40, 131], seed=3)
    for seq, got, unscaled in zip(
        seqs, engine_logits(llm.runner, seqs, 64), engine_logits(plain.runner, seqs, 64)
    ):
        ref = hf_logits(reference, seq)
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
        # the scaling changed the model: plain RoPE is far outside that tolerance
        assert (unscaled - ref).abs().max() > 0.05


def test_zero_betas_mean_the_defaults(tiny_dense, tmp_path):
    fields = {**SCALINGS["yarn"], "beta_fast": 0, "beta_slow": 0}
    scaling = load_text_config(_with_rope(tiny_dense, tmp_path / "b", **fields)).rope_scaling
    assert (scaling.beta_fast, scaling.beta_slow) == (32.0, 1.0)  # as transformers' `or`


def test_context_follows_the_scaling(tiny_dense, tmp_path):
    yarn = load_text_config(_with_rope(tiny_dense, tmp_path / "y", **SCALINGS["yarn"]))
    assert yarn.max_context == 256  # vLLM: original_max_position_embeddings * factor
    assert yarn.context_problem(256) is None and "256" in yarn.context_problem(257)
    plain = load_text_config(tiny_dense)
    assert plain.max_context == plain.max_position_embeddings and plain.rope_scaling is None
    # the offline LLM refuses a context past it, as the CLI does
    with pytest.raises(ValueError, match="max_model_len: 300 is more than the model's context"):
        LLM(str(tmp_path / "y"), max_model_len=300)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported"),
        ({"rope_type": "yarn", "factor": 0.5}, "factor must be a number >= 1"),
    ],
)
def test_unsupported_scaling_is_one_clear_line(tiny_dense, tmp_path, fields, message):
    ckpt = _with_rope(tiny_dense, tmp_path / "bad", **fields)
    with pytest.raises(ValueError, match=message):
        load_text_config(ckpt)
    cli = [sys.executable, "-m", "appliance.cli", "serve", str(ckpt), "--port", "1"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["dense", "qwen3_vl"])
def test_yarn_decode_graphs_replay_the_eager_tokens(family, tmp_path):
    """YaRN's attention factor scales cos / sin inside the captured decode step too."""
    from appliance.testing.tiny import build_qwen3_5
    from appliance.testing.tiny_vl import build_tiny_qwen3_vl
    from tests.appliance.engine.test_graphs import GREEDY, SEEDED, _generate, _gpu_runner

    if family == "qwen3_vl":
        src = build_tiny_qwen3_vl(tmp_path / family, tokenizer="none", seed=3)
    else:
        src = build_qwen3_5(tmp_path / family, seed=3)
    model_dir = _with_rope(src, tmp_path / f"{family}-yarn", **SCALINGS["yarn"])
    prompts_ = [list(range(7 * i + 3, 7 * i + 40)) for i in range(5)]
    options = [GREEDY, SEEDED] * 2 + [GREEDY]
    eager = _generate(_gpu_runner(model_dir, graphs=False), prompts_, options, steps=12)
    runner = _gpu_runner(model_dir, graphs=True)
    assert runner.model.rotary.attention_factor > 1 and runner.graphs is not None
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda chunks: replays.append(len(chunks)) or run(chunks)
    assert _generate(runner, prompts_, options, steps=12) == eager
    assert replays == [5] * 12
    plain = _generate(_gpu_runner(src, graphs=True), prompts_, options, steps=12)
    assert plain != eager  # the scaling reached the GPU model
