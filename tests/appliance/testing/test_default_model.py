"""The embedded default model: built once under APPLIANCE_HOME, reused, loadable by transformers."""

from __future__ import annotations

import json

from appliance.assets.default_model import default_model_dir, ensure_default_model
from appliance.testing import tokenizers
from appliance.testing.oracle import hf_logits
from visual.preprocess import PreprocessConfig


def test_default_model_builds_once(tmp_path, monkeypatch):
    tokenizer_cache = tokenizers._cache_root()  # reuse the trained BPE instead of training again
    tokenizer_cache.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizers").symlink_to(tokenizer_cache, target_is_directory=True)
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path))
    monkeypatch.setenv("APPLIANCE_DEFAULT_MODEL", "random")  # not the shipped trained one
    path = ensure_default_model()
    assert path == default_model_dir() and path.parent == tmp_path
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    # its own image preprocessing, sized for its tiny ViT (no fallback, no gigabyte reservation)
    pre = PreprocessConfig.from_pretrained(path)
    assert pre.max_pixels == 128 * 128 and pre.patch_size == config["vision_config"]["patch_size"]
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, "tokenizers"]  # no temp dirs
    logits = hf_logits(path, [1991, 10, 20, 30])
    assert logits.shape == (4, 2000)
