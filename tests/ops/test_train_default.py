"""The default model's training pipeline at tiny scale on CPU: generate -> train a few steps ->
bf16 shards -> the appliance's loader and engine -> held-out scoring; and the pieces the shipped
build relies on: the training model equals transformers' Qwen3.5 (main and MTP logits) on the
written checkpoint, prompts render as transformers renders them, pictures preprocess as the
visual server does, the held-out split is disjoint from training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from appliance.assets import default_model
from ops.train import chat, checkpoint, data, images
from ops.train import train_default as td
from ops.train.model import Batch, Qwen3_5Trainable
from ops.train.sequences import collate, encode

SCRIPTS = Path(__file__).resolve().parents[2] / "ops" / "train"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The device command (ops/train/gpu_build.sh) at tiny scale, installed into a folder."""
    root = tmp_path_factory.mktemp("default")
    out, folder = root / "out", root / "model"
    out.mkdir()
    argv = ["--preset", "tiny", "--steps", "2", "--data-scale", "0.003", "--batch-size", "4"]
    argv += ["--heldout", "1", "--max-new", "3", "--shard-mib", "0.4", "--device", "cpu"]
    argv += ["--eval-batch", "6"]  # short prompts batched apart from the long tool prompts
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    subprocess.run(["bash", str(SCRIPTS / "gpu_build.sh"), *argv], env=env, check=True)
    assert len(list(out.iterdir())) <= 8  # what the device tool returns
    subprocess.run(
        ["bash", str(SCRIPTS / "install_default.sh"), str(out), str(folder)], env=env, check=True
    )
    return folder


def test_pipeline_writes_a_servable_sharded_checkpoint(trained: Path, monkeypatch) -> None:
    shards = sorted(trained.glob("*.safetensors"))
    assert len(shards) > 1 and all(p.stat().st_size <= 0.4 * 2**20 for p in shards)
    index = json.loads((trained / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert any(k.startswith("mtp.layers.0.self_attn.") for k in index["weight_map"])
    assert any(".linear_attn.in_proj_qkv." in k for k in index["weight_map"])
    assert any(k.startswith("model.visual.blocks.0.") for k in index["weight_map"])
    report = json.loads((trained / "eval.json").read_text())
    expected = {f"{f}/{m}" for f in data.FAMILIES for m in ("think", "no_think")}
    assert set(report["accuracy"]) == expected
    assert report["mtp_accept_length_k2"] >= 1.0
    # the package's default-model switch takes this folder as the shipped model
    assert default_model.shipped_model_dir(trained) == trained
    monkeypatch.setattr(default_model, "SHIPPED_DIR", trained)
    assert default_model.ensure_default_model() == trained
    monkeypatch.setenv("APPLIANCE_DEFAULT_MODEL", "random")
    assert default_model.ensure_default_model() != trained


def test_engine_serves_it_with_mtp(trained: Path) -> None:
    from appliance.offline.llm import LLM
    from appliance.sampling_params import SamplingParams

    example = data.Generator("heldout", 0).add()
    prompt = chat.render(example.messages, enable_thinking=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(trained), mtp_step=2, num_kv_slots=2048, max_model_len=512) as llm:
        out = llm.generate([prompt], params)[0]
    assert len(out.token_ids) == 4


def test_evaluator_through_the_http_api(trained: Path, tmp_path: Path) -> None:
    """ops/train/evaluate.py against a live appliance serving the checkpoint with MTP k=2: image
    parts, tool calls parsed by the server, thinking on and off, the accept length from /metrics.
    (Accuracy is the trained build's business; this tiny run has learned nothing.)"""
    from ops.train import evaluate
    from tests.e2e.live import start_appliance

    app = start_appliance(trained, tmp_path / "serve.log", "--mtp-step", "2")
    try:
        dump = tmp_path / "dump.json"
        argv = ["--base-url", app.url, "--per-family", "1", "--families", "add,text,tool"]
        code = evaluate.main([*argv, "--max-tokens", "6", "--dump", str(dump)])
        assert code == 0
        replies = json.loads(dump.read_text())
        adds = tmp_path / "adds.json"
        adds.write_text(json.dumps([r for r in replies if r["family"] == "add"]))
        again = ["--base-url", app.url, "--per-family", "1", "--families", "add"]
        assert evaluate.main([*again, "--max-tokens", "6", "--compare", str(adds)]) == 0
    finally:
        app.stop()
    assert len(replies) == 6 and {r["family"] for r in replies} == {"add", "text", "tool"}
    assert all(r["tool_calls"] is not None for r in replies if r["family"] == "tool")


def test_training_model_matches_transformers(trained: Path) -> None:
    from appliance.testing.oracle import hf_logits, hf_mtp_logits

    model = Qwen3_5Trainable(td.PRESETS["tiny"])
    checkpoint.load_into(model, trained)
    model.eval()
    ids = torch.randint(0, 1000, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    positions = torch.arange(80).expand(3, 1, 80)
    batch = Batch(torch.tensor([ids]), torch.ones(1, 80), positions)
    with torch.no_grad():
        hidden, _, ctx = model(batch)
        ours = model.lm_head(hidden)[0]
        emb = model.model.language_model.embed_tokens(batch.ids[:, 1:])
        sub = (ctx[0][:, :-1], ctx[1][:, :-1], ctx[2][:, :-1], ctx[3][:, :, :-1, :-1])
        ours_mtp = model.lm_head(model.mtp_hidden(emb, hidden[:, :-1], sub))[0]
    torch.testing.assert_close(ours, hf_logits(trained, ids), atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(ours_mtp, hf_mtp_logits(trained, ids), atol=2e-4, rtol=1e-3)


def test_training_model_matches_transformers_on_image_prompts(trained: Path) -> None:
    """Vision tower, image-embedding merge and M-RoPE positions against transformers' VLM."""
    import transformers
    from tokenizers import Tokenizer

    model = Qwen3_5Trainable(td.PRESETS["tiny"])
    checkpoint.load_into(model, trained)
    model.eval()
    tok = Tokenizer.from_file(str(trained / "tokenizer.json"))
    gen = data.Generator("heldout", 3)
    seqs = [encode(tok, gen.text(), thinking=True), encode(tok, gen.position(), thinking=False)]
    batch, _ = collate(seqs, torch.device("cpu"), 0)
    with torch.no_grad():
        hidden, _, _ = model(batch)
        ours = model.lm_head(hidden)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(trained, dtype=torch.float32)
    image_token = tok.token_to_id("<|image_pad|>")
    for i, seq in enumerate(seqs):
        ids = torch.tensor([seq.ids])
        pixels = images.pixel_values(torch.from_numpy(np.stack(seq.pixels)))
        with torch.no_grad():
            theirs = hf.eval()(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == image_token).int(),
                pixel_values=pixels,
                image_grid_thw=torch.tensor([images.GRID]),
                use_cache=False,
            ).logits[0]
        n = len(seq.ids)
        torch.testing.assert_close(ours[i, :n], theirs, atol=3e-4, rtol=1e-3)


def test_prompts_render_as_transformers_renders_them(trained: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(trained))
    gen = data.Generator("train", 1)
    for family in data.FAMILIES:
        example = gen.example(family)
        for thinking in (True, False):
            kwargs = {"tools": example.tools} if example.tools else {}
            expected = hf.apply_chat_template(
                example.messages,
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=thinking,
                **kwargs,
            )
            assert (
                chat.render(example.messages, example.tools, enable_thinking=thinking) == expected
            )


def test_pictures_preprocess_as_the_visual_server_does() -> None:
    from visual.preprocess import PreprocessConfig, preprocess_image

    config = PreprocessConfig(min_pixels=32 * 32, max_pixels=images.SIDE**2)
    gen = data.Generator("train", 0)
    pics = [gen.text().pixels[0], gen.count_shapes().pixels[0]]
    ours = images.pixel_values(torch.from_numpy(np.stack(pics)))
    theirs = [preprocess_image(Image.fromarray(p), config) for p in pics]
    assert all(t.grid_thw == images.GRID and t.num_tokens == images.NUM_TOKENS for t in theirs)
    expected = torch.from_numpy(np.concatenate([t.pixel_values for t in theirs]))
    assert torch.equal(ours, expected)


def test_heldout_split_is_disjoint_and_image_prompts_expand() -> None:
    train = data.generate("train", 0, {"add": 300, "reverse": 300, "text": 100, "copy": 100})
    held = data.generate("heldout", 0, {"add": 50, "reverse": 50, "text": 30, "copy": 30})

    def keys(examples):
        return {(e.family, json.dumps(e.messages), e.answer) for e in examples}

    assert not keys(train) & keys(held)
    assert all(data.held_out(e.answer) for e in held if e.family == "text")
    reversed_ = [e.messages[0]["content"].split(": ", 1)[1] for e in held if e.family == "reverse"]
    assert reversed_ and all(data.held_out(s) for s in reversed_)
    tok = chat.train_tokenizer([chat.render(e.messages, e.tools) for e in train], 2048)
    seq = encode(tok, next(e for e in held if e.family == "text"), thinking=True)
    pad = tok.token_to_id("<|image_pad|>")
    assert seq.ids.count(pad) == images.NUM_TOKENS
    batch, loss_mask = collate([seq], torch.device("cpu"), 0)
    assert batch.pixel_values.shape == (64, 1536) and batch.image_index.numel() == 16
    assert loss_mask.sum() == len(seq.ids) - seq.prompt_len
    assert tok.decode(seq.ids[seq.prompt_len :], skip_special_tokens=False).endswith("<|im_end|>")


def test_text_answers_tokenize_one_token_per_character() -> None:
    """Reading a picture emits one token per character (one per image-token column): the BPE
    corpus leaves the text family's answers out, so it learns no merges of their characters."""
    args = td.parse_args(["--out", "unused", "--data-scale", "0.05", "--heldout", "20"])
    tok, _, held = td.build_data(args)
    answers = {s.example.answer for s in held if s.family == "text"}
    assert len(answers) == 20
    for answer in answers:
        assert len(tok.encode(answer, add_special_tokens=False).ids) == len(answer), answer


def test_a_diverged_run_stops_without_a_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A non-finite loss (a variant of the shipped recipe went to NaN by step 1000) ends training
    with a message and writes no checkpoint, so gpu_build.sh cannot keep that variant."""
    real = td.losses

    def poisoned(model, batch, loss_mask):
        main, mtp1, mtp2 = real(model, batch, loss_mask)
        return main * float("nan"), mtp1, mtp2

    monkeypatch.setattr(td, "losses", poisoned)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--preset", "tiny", "--steps", "3", "--data-scale", "0.003"]
    argv += ["--batch-size", "4", "--heldout", "1", "--device", "cpu", "--log-every", "1"]
    with pytest.raises(SystemExit, match="non-finite loss at step 0"):
        td.main(argv)
    assert not list(out.glob("*.safetensors"))  # an absent folder globs to nothing too
