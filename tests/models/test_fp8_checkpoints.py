"""fp8 checkpoints end to end on CPU: tiny dense, MoE and Qwen3-VL models written by
appliance.testing.fp8_checkpoint in Qwen's block layout ("fp8") and llm-compressor's per-channel
layout ("compressed-tensors"), and online `--quantization fp8`, against the same models with the
dequantised weights.

Tolerances: with activation quantisation taken out the fp8 model equals its dequantised twin to
float noise (1e-4); with it (the real path: per-token / per-token-group e4m3 activations) the
logits (std ~1) stay within mean |d| <= 0.15 and the argmax agrees wherever the twin's top-2 gap
exceeds 0.5 (measured: mean 0.03-0.11, max 0.24-3.4, the largest where quantised GDN projections
or routing flips amplify it; argmax flips only seen at gaps <= 0.38)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from fp8_cases import (
    IDS,
    dequantized_params,
    engine_logits,
    logits,
    runner,
    tp_rank_main,
    without_activation_quant,
)
from safetensors.torch import load_file, save_file

from appliance.models.layers.quant import ONLINE_IGNORE
from appliance.models.loader import CheckpointMismatch
from appliance.testing.fp8_checkpoint import (
    COMPRESSED_IGNORE,
    add_kv_cache_scales,
    attention_prefixes,
    write_fp8_checkpoint,
)
from appliance.testing.tiny import build_qwen3_5
from appliance.testing.tiny_vl import build_tiny_qwen3_vl
from appliance_kernels.fp8 import FP8_DTYPE
from visual.encoder import VisionEncoder
from visual.weights import VisionCheckpointError

PER = "per_expert"
STATIC = {"activations": "static"}
BLOCK = (16, 16)  # tiny models: every fused segment and TP shard falls on 16-row blocks
# hidden 128 etc.: Qwen's real 128 x 128 blocks, every fused segment a multiple of 128 rows
SIZES_128 = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
    linear_num_key_heads=1,
    linear_key_head_dim=128,
    linear_num_value_heads=2,
    linear_value_head_dim=128,
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_src")
    return {
        "dense": build_qwen3_5(root / "dense", seed=3),
        "moe": build_qwen3_5(root / "moe", moe=True, seed=4, shared_expert_intermediate_size=64),
        "dense128": build_qwen3_5(root / "dense128", seed=5, num_hidden_layers=2, **SIZES_128),
        "vl": build_tiny_qwen3_vl(root / "vl", tokenizer="none", seed=6),
        "vl_moe": build_tiny_qwen3_vl(root / "vl_moe", moe=True, tokenizer="none", seed=7),
    }


# name -> (source, layout, block, writer options)
CASES = {
    "dense-fp8": ("dense", "fp8", BLOCK, {}),
    "dense-ct": ("dense", "compressed-tensors", None, {}),
    "moe-fp8-fused": ("moe", "fp8", BLOCK, {}),
    "moe-fp8-per-expert": ("moe", "fp8", BLOCK, {"expert_layout": "per_expert"}),
    "moe-ct-per-expert": ("moe", "compressed-tensors", None, {"expert_layout": "per_expert"}),
    "moe-ct-fused": ("moe", "compressed-tensors", None, {}),
    "dense128-fp8": ("dense128", "fp8", (128, 128), {}),
    "vl-fp8": ("vl", "fp8", BLOCK, {}),
    "vl-moe-ct": ("vl_moe", "compressed-tensors", None, {"transposed_experts": True}),
    "vl-moe-fp8": (
        "vl_moe",
        "fp8",
        BLOCK,
        {"transposed_experts": True, "expert_layout": "per_expert"},
    ),
    # static activation scales: AutoFP8 / vLLM-exported per-tensor fp8, llm-compressor's FP8
    "dense-autofp8": ("dense", "fp8", None, {"scales": "tensor", "activations": "static"}),
    "moe-autofp8-per-expert": (
        "moe",
        "fp8",
        None,
        {"scales": "tensor", **STATIC, "expert_layout": PER},
    ),
    "moe-ct-static-fused": ("moe", "compressed-tensors", None, {"scales": "tensor", **STATIC}),
    "vl-ct-static": ("vl", "compressed-tensors", None, {"scales": "tensor", **STATIC}),
    "dense-fp8-block-static": ("dense", "fp8", BLOCK, STATIC),
    # llm-compressor FP8_BLOCK
    "moe-ct-block-per-expert": (
        "moe",
        "compressed-tensors",
        BLOCK,
        {"scales": "block", "expert_layout": PER},
    ),
    "vl-ct-block": ("vl", "compressed-tensors", BLOCK, {"scales": "block"}),
    # NVIDIA ModelOpt: FP8 (per tensor, static) in config.json or hf_quant_config.json, and
    # FP8_PER_CHANNEL_PER_TOKEN
    "dense-modelopt": ("dense", "modelopt", None, {}),
    "moe-modelopt-file": ("moe", "modelopt", None, {"modelopt_file": True, "expert_layout": PER}),
    "vl-moe-modelopt-channel": (
        "vl_moe",
        "modelopt",
        None,
        {"scales": "channel", "transposed_experts": True, "expert_layout": PER},
    ),
}


@pytest.fixture(scope="module")
def written(sources, tmp_path_factory):
    """name -> (fp8 checkpoint, dequantised twin)."""
    root = tmp_path_factory.mktemp("fp8_ckpt")
    out = {}
    for name, (src, layout, block, options) in CASES.items():
        q, d = root / f"{name}-q", root / f"{name}-d"
        write_fp8_checkpoint(
            sources[src], q, d, layout=layout, block=block or (128, 128), **options
        )
        out[name] = (q, d)
    return out


def _expect_close_real_path(got: torch.Tensor, want: torch.Tensor) -> None:
    assert want.std() > 0.5
    assert (got - want).abs().mean() <= 0.15
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert clear.sum() >= 3
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_checkpoint_equals_its_dequantised_twin(name, written, monkeypatch):
    q, d = written[name]
    real = logits(q)
    want = logits(d)
    _expect_close_real_path(real, want)
    without_activation_quant(monkeypatch)
    torch.testing.assert_close(logits(q), want, atol=1e-4, rtol=0)


def test_fp8_parameters_are_stored_in_fp8_where_the_checkpoint_says(written):
    model = runner(written["moe-fp8-fused"][0]).model
    params = dict(model.named_parameters())
    layer0 = "model.layers.0"  # linear attention: in_proj_b / in_proj_a stay in full precision
    assert params[f"{layer0}.linear_attn.in_proj.weight"].dtype == FP8_DTYPE
    assert params[f"{layer0}.linear_attn.in_proj.weight_scale"].shape == (12, 4)  # 192/16, 64/16
    assert params[f"{layer0}.linear_attn.in_proj_ba.weight"].dtype == torch.float32
    assert params[f"{layer0}.mlp.w_gate_up"].dtype == FP8_DTYPE
    assert params[f"{layer0}.mlp.w_gate_up_scale"].shape == (8, 4, 4)
    assert params[f"{layer0}.mlp.gate.weight"].dtype == torch.float32  # router
    assert params[f"{layer0}.mlp.shared_expert_gate.weight"].dtype == torch.float32
    ct = dict(runner(written["moe-ct-fused"][0]).model.named_parameters())
    assert ct[f"{layer0}.linear_attn.in_proj.weight"].dtype == torch.float32  # re:.*linear_attn.*
    assert "model.layers.0.linear_attn.in_proj_ba.weight" not in ct  # one GEMM again
    # one scale per row of q (4 heads x [q | gate] x 32 = 256), k and v (2 kv heads x 32 = 64)
    assert ct["model.layers.1.self_attn.qkv_proj.weight_scale"].shape == (256 + 2 * 64,)


@pytest.mark.parametrize("name", ["moe-fp8-fused", "moe-ct-per-expert", "dense-fp8"])
def test_mtp_head_loads_fp8_weights(name, written):
    """The draft module (mtp.fc and its decoder layer, per-expert MoE keys) holds exactly the
    dequantised twin's weights."""
    q, d = written[name]
    got = dequantized_params(runner(q, mtp_step=1).draft_modules[0])
    want = dict(runner(d, mtp_step=1).draft_modules[0].named_parameters())
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value.float(), atol=0, rtol=0, msg=key)
    assert runner(q, mtp_step=1).draft_modules[0].fc.weight.dtype == FP8_DTYPE


@pytest.fixture(scope="module")
def online_twin(sources, tmp_path_factory):
    """The per-channel dequantised weights online fp8 computes, kept out where it keeps them."""
    root = tmp_path_factory.mktemp("online")
    out = {}
    for name in ("dense", "moe"):
        write_fp8_checkpoint(
            sources[name],
            root / f"{name}-q",
            root / f"{name}-d",
            layout="compressed-tensors",
            ignore=list(ONLINE_IGNORE),
        )
        out[name] = root / f"{name}-d"
    return out


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_online_fp8_equals_per_channel_dequantised_model(name, sources, online_twin, monkeypatch):
    model = runner(sources[name], quantization="fp8").model
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert model.model.layers[0].linear_attn.in_proj_ba.weight.dtype == torch.float32
    want = logits(online_twin[name])
    _expect_close_real_path(logits(sources[name], quantization="fp8"), want)
    without_activation_quant(monkeypatch)
    torch.testing.assert_close(logits(sources[name], "fp8"), want, atol=1e-4, rtol=0)


# ------------------------------------------------------------------ bad input


def _with_config(src, dst, edit) -> None:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))


def _ct_weights(**fields):
    """A config edit setting compressed-tensors weight-scheme fields."""

    def edit(config: dict) -> None:
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(fields)

    return edit


@pytest.mark.parametrize(
    "name,edit,words",
    [
        ("dense-fp8", lambda c: c["quantization_config"].update(quant_method="awq"), ["'awq'"]),
        (
            "dense-fp8",
            lambda c: c["quantization_config"].update(weight_block_size=[100, 100]),
            ["[100, 100]", "128"],
        ),
        (
            "dense-fp8",
            lambda c: c["quantization_config"].update(activation_scheme="per-token"),
            ["'per-token'", "dynamic or static"],
        ),
        (  # GDN b / a (one row per head) left off the 16-bit list of a block checkpoint
            "dense-fp8",
            lambda c: c["quantization_config"].update(modules_to_not_convert=None),
            ["in_proj_b, in_proj_a not a whole number of blocks", "modules_to_not_convert"],
        ),
        (
            "dense-ct",
            lambda c: c["quantization_config"]["config_groups"]["group_0"][
                "input_activations"
            ].update(dynamic=False),
            ["'strategy': 'token'", "static per tensor"],
        ),
        ("dense-ct", _ct_weights(strategy="group"), ["'group'", "channel"]),
        (
            "dense-ct",
            lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
                input_activations=None
            ),
            ["input_activations", "dynamic"],
        ),
        (
            "dense-fp8",
            lambda c: c["quantization_config"].update(weight_block_size=[64, 64]),
            ["block [64, 64]", "block_n"],
        ),
        ("dense-fp8", lambda c: c["quantization_config"].update(fmt="e5m2"), ["'e5m2'", "e4m3"]),
        (
            "dense-ct",
            lambda c: c["quantization_config"].update(format="pack-quantized"),
            ["'pack-quantized'", "float-quantized"],
        ),
        ("dense-ct", _ct_weights(type="int"), ["type='int'", "'float'"]),
        (
            "dense-modelopt",
            lambda c: c["quantization_config"].update(quant_algo="NVFP4"),
            ["'NVFP4'", "FP8_PER_CHANNEL_PER_TOKEN"],
        ),
        ("dense-ct", _ct_weights(num_bits=4), ["num_bits=4", "8"]),
        (
            "dense-ct",
            lambda c: c["quantization_config"]["config_groups"].update(
                group_1=c["quantization_config"]["config_groups"]["group_0"]
            ),
            ["2 config_groups", "one"],
        ),
    ],
)
def test_unsupported_layouts_name_what_is_wrong(name, edit, words, written, tmp_path):
    bad = tmp_path / "bad"
    _with_config(written[name][0], bad, edit)
    with pytest.raises(ValueError) as err:
        runner(bad)
    for word in words:
        assert word in str(err.value)
    assert any(m in str(err.value) for m in ("fp8", "compressed-tensors", "modelopt"))


def test_compressed_tensors_targets_name_what_is_quantised(written, tmp_path, monkeypatch):
    # llm-compressor may name the quantised modules in the group's `targets` instead of listing
    # the rest in `ignore`: the modules no target names are 16-bit
    q, d = written["dense-ct"]

    def by_targets(config: dict) -> None:
        qc = config["quantization_config"]
        qc["ignore"] = ["lm_head"]
        qc["config_groups"]["group_0"]["targets"] = [
            r"re:.*(self_attn|mlp)\.[a-z]+_proj$",
            r"re:.*mtp\.fc$",
        ]

    _with_config(q, tmp_path / "targets", by_targets)
    without_activation_quant(monkeypatch)
    torch.testing.assert_close(logits(tmp_path / "targets"), logits(d), atol=1e-4, rtol=0)


def test_unknown_quantization_flag_is_refused(sources):
    with pytest.raises(ValueError, match="'int4'.*fp8"):
        runner(sources["dense"], quantization="int4")


def test_the_startup_line_says_what_was_resolved(written, sources):
    assert "128 x 128 block scales from the checkpoint (fp8)" in (
        runner(written["dense128-fp8"][0]).text_config.quant.describe()
    )
    static = runner(written["dense-autofp8"][0]).text_config.quant.describe()
    assert "per-tensor scales" in static and "static input_scales read past" in static
    assert "quantised at load" in runner(sources["dense"], "fp8").text_config.quant.describe()


def test_modelopt_export_with_hf_quant_config_file(written):
    """Older ModelOpt exports: the scheme only in hf_quant_config.json; its wildcard
    exclude_modules keep the GDN b / a, routers and shared-expert gates unquantised."""
    q = written["moe-modelopt-file"][0]
    assert "quantization_config" not in json.loads((q / "config.json").read_text())
    assert (q / "hf_quant_config.json").is_file()
    params = dict(runner(q).model.named_parameters())
    assert params["model.layers.0.linear_attn.in_proj.weight"].dtype == FP8_DTYPE
    assert params["model.layers.0.linear_attn.in_proj_ba.weight"].dtype == torch.float32
    assert params["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.0.mlp.w_gate_up"].dtype == FP8_DTYPE


def test_quantization_flag_may_name_the_checkpoints_own_method(sources, written):
    """--quantization compressed-tensors (as vLLM commands pass it) loads a compressed-tensors
    checkpoint as without the flag; on another checkpoint it names both sides."""
    q = written["dense-ct"][0]
    torch.testing.assert_close(logits(q, "compressed-tensors"), logits(q), atol=0, rtol=0)
    with pytest.raises(ValueError, match="'compressed-tensors' does not match .*'fp8'"):
        runner(written["dense-fp8"][0], quantization="compressed-tensors")
    with pytest.raises(ValueError, match="no quantization_config .* use fp8"):
        runner(sources["dense"], quantization="compressed-tensors")


def test_missing_scale_names_the_first_tensor(written, tmp_path):
    bad = tmp_path / "bad"
    _with_config(written["moe-fp8-per-expert"][0], bad, lambda c: None)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors.pop("model.language_model.layers.2.mlp.experts.5.up_proj.weight_scale_inv")
    tensors.pop("model.language_model.layers.3.mlp.experts.1.down_proj.weight_scale_inv")
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointMismatch, match=r"layers\.2\.mlp\.experts\.5\.up_proj\.weight "):
        runner(bad)


def _edit_tensors(src, dst, edit) -> None:
    _with_config(src, dst, lambda c: None)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))


def test_fused_expert_scales_for_gate_and_up(written, tmp_path, monkeypatch):
    # per-tensor fused experts may carry one scale for gate and one for up ([E, 2]); any other
    # count is one clear line naming the tensor
    q, d = written["moe-ct-static-fused"]
    keys = [k for k in load_file(str(q / "model.safetensors")) if k.endswith("gate_up_proj_scale")]
    assert keys

    def pairs(count: int):
        def edit(tensors: dict) -> None:
            for key in keys:
                tensors[key] = tensors[key].reshape(-1, 1).expand(-1, count).contiguous()

        return edit

    _edit_tensors(q, tmp_path / "pairs", pairs(2))
    without_activation_quant(monkeypatch)
    torch.testing.assert_close(logits(tmp_path / "pairs"), logits(d), atol=1e-4, rtol=0)
    _edit_tensors(q, tmp_path / "three", pairs(3))
    with pytest.raises(CheckpointMismatch, match=f"{keys[0]}: fused expert scale of 3 values"):
        runner(tmp_path / "three")


def test_static_activation_scales_are_checked(written, tmp_path):
    """A static checkpoint's input_scales must be finite, >= 0 (0: an expert calibration never
    reached, logged) and belong to quantised layers; a dynamic checkpoint carrying them (a
    mislabelled config) names them as unexpected."""
    src = written["dense-autofp8"][0]
    name = "model.language_model.layers.1.mlp.down_proj.input_scale"
    assert name in load_file(str(src / "model.safetensors"))

    for bad in (-1.0, float("nan"), float("inf")):
        _edit_tensors(
            src, tmp_path / f"bad{bad}", lambda t, v=bad: t.update({name: torch.tensor(v)})
        )
        with pytest.raises(CheckpointMismatch, match=f"{name}: activation scale.*> 0"):
            runner(tmp_path / f"bad{bad}")
    _edit_tensors(src, tmp_path / "zero", lambda t: t.update({name: torch.tensor(0.0)}))
    assert runner(tmp_path / "zero") is not None  # uncalibrated: loads (the scale is not used)

    stray = "model.language_model.layers.0.linear_attn.in_proj_a.input_scale"  # kept in bf16
    _edit_tensors(src, tmp_path / "stray", lambda t: t.update({stray: torch.tensor(0.1)}))
    with pytest.raises(CheckpointMismatch, match=f"unexpected keys: {stray}"):
        runner(tmp_path / "stray")

    dynamic = tmp_path / "dynamic"
    _with_config(
        src, dynamic, lambda c: c["quantization_config"].update(activation_scheme="dynamic")
    )
    with pytest.raises(CheckpointMismatch, match=r"unexpected keys: .*\.input_scale"):
        runner(dynamic)


@pytest.mark.parametrize(
    "layout,options",
    [
        ("fp8", {"block": BLOCK}),
        ("compressed-tensors", {}),
        ("compressed-tensors", {"scales": "tensor", "activations": "static"}),
        ("compressed-tensors", {"scales": "block", "block": BLOCK}),
    ],
)
def test_quantised_vision_tower_loads_dequantised(layout, options, sources, tmp_path):
    """A checkpoint that quantised the vision tower too: its encoder holds exactly the
    dequantised twin's weights (the tower runs in 16-bit), and the text model still loads."""
    q, d = tmp_path / "q", tmp_path / "d"
    ignore = [p for p in COMPRESSED_IGNORE if "visual" not in p]
    write_fp8_checkpoint(
        sources["vl"], q, d, layout=layout, ignore=ignore, quantize_visual=True, **options
    )
    stored = load_file(str(q / "model.safetensors"))
    assert stored["model.visual.blocks.0.attn.qkv.weight"].dtype == FP8_DTYPE
    got = dict(VisionEncoder.from_pretrained(q).tower.named_parameters())
    want = dict(VisionEncoder.from_pretrained(d).tower.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=name)
    _expect_close_real_path(logits(q), logits(d))

    bad = tmp_path / "bad"
    _edit_tensors(
        q, bad, lambda t: t.pop(next(k for k in t if ".visual." in k and "weight_scale" in k))
    )
    with pytest.raises(VisionCheckpointError, match="fp8 tensor .* needs .* a scale"):
        VisionEncoder.from_pretrained(bad)


def test_fp8_tensors_without_quantization_config_are_refused(written, tmp_path):
    bad = tmp_path / "bad"
    _with_config(written["dense-ct"][0], bad, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointMismatch, match="dtype mismatch.*quantization_config"):
        runner(bad)


@pytest.mark.parametrize("name", ["dense-fp8", "moe-ct-fused", "moe-fp8-per-expert"])
def test_tp2_shards_scales_with_their_weights(name, written, monkeypatch, tmp_path):
    """Column layers cut scale rows (block rows for tiles), row layers cut block-scale columns and
    keep per-channel scales whole, experts cut both per expert: TP=2 gives TP=1's logits."""
    q = written[name][0]
    without_activation_quant(monkeypatch)
    want = logits(q)
    out = tmp_path / "tp2.pt"
    mp.start_processes(
        tp_rank_main,
        args=(2, f"file://{tmp_path}/dist_init", str(q), str(out)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    torch.testing.assert_close(torch.load(out), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name,naming",
    [("dense-ct", "k_scale"), ("dense-fp8", "kv_scale"), ("dense-modelopt", "proj.k_scale")],
)
def test_kv_cache_scales_load_with_the_fp8_checkpoint(name, naming, written, tmp_path):
    """A quantised checkpoint with KV-cache scales (compressed-tensors kv_cache_scheme, AutoFP8's
    kv_scale) loads; with --kv-cache-dtype fp8_e4m3 every attention layer (MTP included) uses
    them, and the logits stay within the fp8 tolerance of the dequantised twin."""
    q, d = written[name]
    ckpt = shutil.copytree(q, tmp_path / "ckpt")
    prefixes = attention_prefixes(ckpt)
    expected = add_kv_cache_scales(ckpt, {p: (0.02, 0.015) for p in prefixes}, naming)
    if name == "dense-ct":
        scheme = json.loads((ckpt / "config.json").read_text())["quantization_config"]
        assert scheme["kv_cache_scheme"]["type"] == "float"
    r = runner(ckpt, kv_cache_dtype="fp8_e4m3", mtp_step=1)
    layers = [m for mod in (r.model, *r.draft_modules) for m in mod.modules()]
    scales = [m.kv_scales_host for m in layers if hasattr(m, "kv_scales_host")]
    assert scales == [pytest.approx(v) for _, v in sorted(expected.items())]
    assert len(scales) == len(prefixes) == 3
    _expect_close_real_path(engine_logits(r, [IDS], chunk=16)[0], logits(d))


def test_quantization_spellings_vllm_accepts(sources, written, tmp_path):
    """vLLM lower-cases --quantization and reads `compressed_tensors` as `compressed-tensors`, in
    the flag and in a config's quant_method: the same weights load either way."""
    q = written["dense-ct"][0]
    _with_config(
        q,
        tmp_path / "underscore",
        lambda c: c["quantization_config"].update(quant_method="compressed_tensors"),
    )
    want = logits(q)
    torch.testing.assert_close(logits(tmp_path / "underscore"), want, atol=0, rtol=0)
    torch.testing.assert_close(logits(q, "Compressed_Tensors"), want, atol=0, rtol=0)
    torch.testing.assert_close(logits(sources["dense"], "FP8"), logits(sources["dense"], "fp8"))


def test_a_missing_scale_is_named_before_any_tensor_is_read(written, tmp_path, monkeypatch):
    """The safetensors headers say which fp8 tensor lacks a scale: no weight is read (nor the
    model built) before the error, as the serve / LLM preflight runs it too."""
    import appliance.engine.runner as runner_module
    from appliance.models.loader import unscaled_fp8_problem

    bad = tmp_path / "bad"
    _edit_tensors(
        written["dense-fp8"][0],
        bad,
        lambda t: t.pop("model.language_model.layers.1.mlp.down_proj.weight_scale_inv"),
    )
    reads = []
    monkeypatch.setattr(runner_module, "iter_tensors", lambda *a, **k: reads.append(a) or iter(()))
    with pytest.raises(CheckpointMismatch, match=r"layers\.1\.mlp\.down_proj\.weight has no"):
        runner(bad)
    assert reads == []
    assert "layers.1.mlp.down_proj.weight has no scale" in unscaled_fp8_problem(bad)
    assert unscaled_fp8_problem(written["dense-fp8"][0]) is None
    assert unscaled_fp8_problem(written["moe-ct-per-expert"][0]) is None


def test_kv_cache_scales_of_no_attention_layer_are_unexpected_keys(written, tmp_path):
    """A k/v scale naming a layer past the model's, or a linear-attention layer, is refused like
    any stray tensor (silently using 1.0 would run the cache uncalibrated)."""
    q = written["dense-ct"][0]
    linear = next(
        i
        for i, t in enumerate(
            json.loads((q / "config.json").read_text())["text_config"]["layer_types"]
        )
        if t == "linear_attention"
    )
    for layer in (99, linear):
        bad = tmp_path / f"stray{layer}"
        name = f"model.language_model.layers.{layer}.self_attn.k_scale"
        _edit_tensors(q, bad, lambda t, name=name: t.update({name: torch.tensor(0.02)}))
        with pytest.raises(CheckpointMismatch, match=rf"unexpected keys: {re.escape(name)}"):
            runner(bad, kv_cache_dtype="fp8_e4m3")


def test_a_quantised_lm_head_is_named_as_such(written, tmp_path):
    """compressed-tensors without lm_head in its ignore list stores lm_head in fp8: the error says
    the layer is served in 16-bit here (vLLM does not load one either)."""
    bad = tmp_path / "qhead"

    def quantise_head(tensors):
        head = tensors["lm_head.weight"]
        tensors["lm_head.weight"] = head.to(FP8_DTYPE)
        tensors["lm_head.weight_scale"] = torch.ones(head.shape[0], 1)

    _edit_tensors(written["dense-ct"][0], bad, quantise_head)
    with pytest.raises(CheckpointMismatch, match="lm_head.weight: dtype mismatch.*16-bit here"):
        runner(bad)


BLOCK_32_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "modules_to_not_convert": ["lm_head", r"re:.*\.linear_attn\.in_proj_[ab]$"],
}


def test_block_scales_cut_by_the_tp_split_name_the_tp_size(sources, tmp_path):
    """32-row blocks fit every fused segment of the tiny dense model at TP=1; at TP=2 the GDN
    key segments are 16 rows a rank. Found before any worker starts (the model built on the meta
    device), naming the tensor-parallel size and each segment once."""
    from appliance import LLM
    from appliance.models.config import load_text_config
    from appliance.models.registry import quant_layout_problem

    ckpt = tmp_path / "block32"
    _with_config(sources["dense"], ckpt, lambda c: c.update(quantization_config=BLOCK_32_CONFIG))
    text = load_text_config(ckpt, "")
    assert quant_layout_problem(text, 1) is None
    problem = quant_layout_problem(text, 2)
    assert "over tensor-parallel size 2" in problem and "use a smaller tensor-parallel" in problem
    assert problem.count("in_proj_qkv") == 1
    with pytest.raises(ValueError, match="over tensor-parallel size 2"):
        LLM(str(ckpt), tensor_parallel_size=2)
