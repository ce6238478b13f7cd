"""visual.encoder vs the transformers vision towers (fp32 CPU) and the loader's errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from visual.encoder import VisionEncoder, read_vision_config
from visual.preprocess import preprocess_images
from visual.weights import VisionCheckpointError

FAMILIES = {
    "qwen3_vl": ("qwen3_vl_dir", transformers.Qwen3VLForConditionalGeneration, 1),
    "qwen3_vl_moe": ("qwen3_vl_moe_dir", transformers.Qwen3VLMoeForConditionalGeneration, 2),
    "qwen3_5": ("qwen3_5_vl_dir", transformers.Qwen3_5ForConditionalGeneration, 0),
}


def hf_visual(model_cls, model_dir, pixel_values, grid_thw):
    model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.model.visual(
            torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grid_thw)
        )
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tower_matches_hf_with_two_images(family, request, make_image):
    fixture, model_cls, num_deepstack = FAMILIES[family]
    model_dir = request.getfixturevalue(fixture)
    encoder = VisionEncoder.from_pretrained(model_dir)
    images = [make_image(64, 64, seed=11), make_image(150, 40, seed=12)]  # grids 4x4 and 2x10
    pixel_values, grid_thw = preprocess_images(images, encoder.preprocess)
    assert grid_thw.tolist() == [[1, 4, 4], [1, 2, 10]]

    embeds, deepstack = encoder.encode(pixel_values, grid_thw)
    ref_embeds, ref_deepstack = hf_visual(model_cls, model_dir, pixel_values, grid_thw)

    assert embeds.shape == (4 + 5, 64) == ref_embeds.shape
    assert ref_embeds.std() > 0.3  # randomised weights, not a near-constant output
    torch.testing.assert_close(embeds, ref_embeds, atol=1e-4, rtol=0)
    assert len(deepstack) == len(ref_deepstack) == num_deepstack
    for ours, ref in zip(deepstack, ref_deepstack, strict=True):
        assert ours.shape == embeds.shape
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    if num_deepstack == 2:  # two mergers over different blocks give different features
        assert (deepstack[0] - deepstack[1]).abs().max() > 0.1


def test_images_do_not_attend_to_each_other(qwen3_vl_dir, make_image):
    encoder = VisionEncoder.from_pretrained(qwen3_vl_dir)
    images = [make_image(64, 64, seed=1), make_image(96, 64, seed=2), make_image(32, 128, seed=3)]
    together, together_ds = encoder.encode_images(images)
    alone = [encoder.encode_images([image]) for image in images]
    _, grid_thw = preprocess_images(images, encoder.preprocess)
    parts = encoder.split_per_image(together, grid_thw)
    assert [p.shape[0] for p in parts] == [4, 6, 4]
    for part, (single, _) in zip(parts, alone, strict=True):
        torch.testing.assert_close(part, single, atol=1e-5, rtol=0)
    ds_parts = encoder.split_per_image(together_ds[0], grid_thw)
    torch.testing.assert_close(ds_parts[1], alone[1][1][0], atol=1e-5, rtol=0)


def test_bf16_encode_runs_close_to_fp32(qwen3_5_vl_dir, make_image):
    images = [make_image(64, 96, seed=5)]
    fp32, _ = VisionEncoder.from_pretrained(qwen3_5_vl_dir).encode_images(images)
    bf16, _ = VisionEncoder.from_pretrained(qwen3_5_vl_dir, dtype=torch.bfloat16).encode_images(
        images
    )
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - fp32).abs().max() < 0.1 * fp32.abs().max()


def test_pixel_values_must_match_grid(qwen3_vl_dir):
    encoder = VisionEncoder.from_pretrained(qwen3_vl_dir)
    with pytest.raises(ValueError, match="covers 16 patches but pixel_values has 12"):
        encoder.encode(np.zeros((12, 1536), np.float32), np.array([[1, 4, 4]]))
    with pytest.raises(ValueError, match="multiples of 2"):
        encoder.encode(np.zeros((15, 1536), np.float32), np.array([[1, 3, 5]]))
    with pytest.raises(ValueError, match="expected \\[patches, 1536\\]"):
        encoder.encode(np.zeros((16, 768), np.float32), np.array([[1, 4, 4]]))


def test_sharded_checkpoint_loads_the_same(qwen3_vl_moe_dir, tmp_path, make_image):
    # re-save the same weights as several shards with an index, like large Hub checkpoints
    tensors = load_file(qwen3_vl_moe_dir / "model.safetensors")
    names = sorted(tensors)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-00003.safetensors"
        save_file(
            {name: tensors[name] for name in shard}, tmp_path / file, metadata={"format": "pt"}
        )
        weight_map.update({name: file for name in shard})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(qwen3_vl_moe_dir / name, tmp_path / name)
    images = [make_image(64, 32, seed=4)]
    single, _ = VisionEncoder.from_pretrained(qwen3_vl_moe_dir).encode_images(images)
    sharded, _ = VisionEncoder.from_pretrained(tmp_path).encode_images(images)
    assert torch.equal(single, sharded)


def _copy_with(model_dir, tmp_path, edit) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")


def test_missing_and_unexpected_keys_are_named(qwen3_5_vl_dir, tmp_path):
    def edit(tensors):
        del tensors["model.visual.blocks.1.attn.qkv.bias"]
        tensors["model.visual.blocks.7.attn.qkv.bias"] = torch.zeros(96)

    _copy_with(qwen3_5_vl_dir, tmp_path, edit)
    with pytest.raises(VisionCheckpointError) as caught:
        VisionEncoder.from_pretrained(tmp_path)
    message = str(caught.value)
    assert "missing keys: blocks.1.attn.qkv.bias" in message
    assert "unexpected keys: blocks.7.attn.qkv.bias" in message


def test_wrong_shape_is_named(qwen3_vl_dir, tmp_path):
    def edit(tensors):
        tensors["model.visual.merger.linear_fc2.weight"] = torch.zeros(32, 128)

    _copy_with(qwen3_vl_dir, tmp_path, edit)
    with pytest.raises(
        VisionCheckpointError, match=r"merger.linear_fc2.weight has shape \(32, 128\)"
    ):
        VisionEncoder.from_pretrained(tmp_path)


def test_checkpoint_without_vision_tower(qwen3_vl_dir, tmp_path):
    _copy_with(qwen3_vl_dir, tmp_path, lambda t: [t.pop(k) for k in list(t) if ".visual." in k])
    with pytest.raises(VisionCheckpointError, match="no vision tower tensors"):
        VisionEncoder.from_pretrained(tmp_path)
    config = json.loads((qwen3_vl_dir / "config.json").read_text())
    config["model_type"] = "qwen3_next"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(VisionCheckpointError, match="'qwen3_next' has no supported vision tower"):
        read_vision_config(tmp_path)


def test_multi_frame_grid_matches_hf(qwen3_vl_dir):
    # t > 1 (video-style input): each frame is its own attention segment, as in transformers
    rng = np.random.default_rng(0)
    pixel_values = rng.standard_normal((2 * 4 * 6 + 16, 1536)).astype(np.float32)
    grid_thw = np.array([[2, 4, 6], [1, 4, 4]])
    embeds, deepstack = VisionEncoder.from_pretrained(qwen3_vl_dir).encode(pixel_values, grid_thw)
    ref_embeds, ref_deepstack = hf_visual(
        transformers.Qwen3VLForConditionalGeneration, qwen3_vl_dir, pixel_values, grid_thw
    )
    torch.testing.assert_close(embeds, ref_embeds, atol=1e-4, rtol=0)
    torch.testing.assert_close(deepstack[0], ref_deepstack[0], atol=1e-4, rtol=0)
