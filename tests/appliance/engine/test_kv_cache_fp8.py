"""fp8 KV cache (`--kv-cache-dtype fp8_e4m3`) on CPU through the real engine: pools in e4m3 for
the main model and the MTP layer, the memory plan's slots, logits and greedy tokens against the
full-precision (fp32) cache, and per-layer k / v scales from checkpoints in the namings they use.

Tolerances (tiny dense model, logits std ~1, 133 teacher-forced positions, measured): fp8 KV with
scales 1.0 moves the logits by mean |d| 0.006, max 0.55; the asserts allow mean 0.03 and the
argmax must agree wherever the fp32 cache's top-2 gap exceeds 0.3. Greedy continuations must
agree up to the first step whose fp32 top-2 gap is under 0.3."""

from __future__ import annotations

import shutil

import pytest
import torch

from appliance.engine.pools import kv_bytes_per_slot, plan_kv_slots
from appliance.engine.runner import ModelRunner
from appliance.models.layers.attention import Attention
from appliance.models.loader import CheckpointMismatch
from appliance.offline.llm import LLM, build_engine_config
from appliance.sampling_params import SamplingParams
from appliance.testing.fp8_checkpoint import add_kv_cache_scales, attention_prefixes
from appliance_kernels.fp8 import FP8_DTYPE
from tests.models.test_qwen3_5_parity import engine_logits

FP8 = "fp8_e4m3"
SMALL = dict(max_num_seqs=2, num_kv_slots=512, max_model_len=256)
IDS = list(range(3, 400, 3))
CLEAR_GAP = 0.3


def runner(ckpt, kv_cache_dtype: str = "auto", **options) -> ModelRunner:
    opts = dict(SMALL, **options)
    config = build_engine_config(str(ckpt), 1, dict(opts, kv_cache_dtype=kv_cache_dtype))
    return ModelRunner(config)


def attention_layers(r: ModelRunner) -> list[tuple[str, Attention]]:
    """(checkpoint-style name, layer) of every full-attention layer, MTP draft last."""
    found = [(n, m) for n, m in r.model.named_modules() if isinstance(m, Attention)]
    for module in r.draft_modules:
        found += [(f"mtp.{n}", m) for n, m in module.named_modules() if isinstance(m, Attention)]
    return found


@pytest.fixture(scope="module")
def full_precision(tiny_dense):
    r = runner(tiny_dense)
    return r, engine_logits(r, [IDS], chunk=16)[0]


def test_pools_of_main_and_mtp_layers_are_fp8(tiny_dense):
    r = runner(tiny_dense, FP8, mtp_step=1)
    assert len(r.pools.kv) == 3  # two full-attention layers and the MTP layer
    for k_cache, v_cache in r.pools.kv:
        assert k_cache.dtype == FP8_DTYPE and v_cache.dtype == FP8_DTYPE
    assert r.pools.stacked["ssm_states"].dtype == torch.float32  # GDN state is untouched
    for _, layer in attention_layers(r):
        assert layer.kv_scales_source == "1.0 (default)"
        assert layer.kv_scales.k_host == 1.0 and float(layer.k_scale) == 1.0


def test_memory_plan_gives_twice_the_slots(tiny_dense, monkeypatch):
    """kv bytes per slot halve against bf16, and the runner's plan (mem_get_info faked, no
    activation profile on CPU) turns the same free memory into twice the slots."""
    model = runner(tiny_dense).model
    assert kv_bytes_per_slot(model, torch.bfloat16) == 2 * kv_bytes_per_slot(model, FP8_DTYPE)
    per = kv_bytes_per_slot(model, torch.bfloat16)
    bf16 = plan_kv_slots(30 * 2**30 * 0.85, 2**30, per, 16)
    fp8 = plan_kv_slots(30 * 2**30 * 0.85, 2**30, per // 2, 16)
    assert fp8 + 16 in (2 * (bf16 + 16), 2 * (bf16 + 16) + 1)

    free = 3 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    slots = {}
    for kv in ("auto", FP8):
        r = runner(tiny_dense, kv, dtype="bfloat16", mtp_step=1)
        monkeypatch.setattr(r, "_profile_activation_bytes", lambda: 0)
        slots[kv] = r._slots_from_memory()[0] + 2  # + the MTP scratch slots (2 seqs x 1 step)
    assert slots[FP8] in (2 * slots["auto"], 2 * slots["auto"] + 1)


def test_logits_close_to_full_precision(tiny_dense, full_precision):
    _, want = full_precision
    got = engine_logits(runner(tiny_dense, FP8), [IDS], chunk=16)[0]
    assert want.std() > 0.5
    diff = (got - want).abs()
    assert diff.mean() <= 0.03, diff.mean()
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_GAP
    assert clear.sum() >= 40
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_greedy_tokens_agree_where_the_gap_is_clear(tiny_trained):
    """On the trained tiny model (confident next tokens; the random one's top-2 gaps are mostly
    under 0.3), fp8 KV greedy == fp32 KV greedy up to the first near tie of the fp32 model."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [IDS[:17], IDS[40:90]]
    outs = {
        kv: [
            o.token_ids
            for o in LLM(str(tiny_trained), kv_cache_dtype=kv, **SMALL).generate(prompts, params)
        ]
        for kv in ("auto", FP8)
    }
    ref_runner = runner(tiny_trained)
    compared = 0
    for prompt, ref, fp8 in zip(prompts, outs["auto"], outs[FP8]):
        teacher = engine_logits(ref_runner, [prompt + ref], chunk=64)[0][len(prompt) - 1 : -1]
        assert teacher.argmax(-1).tolist() == ref  # the teacher pass is the greedy run's logits
        top2 = teacher.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        for step, (a, b) in enumerate(zip(fp8, ref)):
            if gaps[step] <= CLEAR_GAP:
                break  # a near tie may flip; after it the continuations may differ
            assert a == b, f"step {step}: fp8 KV {a} != {b} (gap {gaps[step]:.3f})"
            compared += 1
    assert compared >= 16


def test_greedy_with_mtp_equals_greedy_without_on_fp8_kv(tiny_trained):
    """Draft and verify rows write and read the same fp8 pools (the draft layer's included)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [IDS[:9], IDS[20:45]]
    plain = LLM(str(tiny_trained), kv_cache_dtype=FP8, **SMALL).generate(prompts, params)
    mtp = LLM(str(tiny_trained), kv_cache_dtype=FP8, mtp_step=2, **SMALL).generate(prompts, params)
    assert [o.token_ids for o in mtp] == [o.token_ids for o in plain]


@pytest.mark.parametrize("naming", ["k_scale", "kv_scale", "output_scale", "attn.k_scale"])
def test_scales_from_the_checkpoint(naming, tiny_dense, full_precision, tmp_path):
    """Per-layer scales under each naming reach their layer (MTP layer included); the pool holds
    k / k_scale (so x = stored * scale to e4m3 precision); logits stay close."""
    ckpt = shutil.copytree(tiny_dense, tmp_path / "ckpt")
    prefixes = attention_prefixes(ckpt)
    assert prefixes[-1].startswith("mtp.")
    written = {p: (0.004 * (i + 2), 0.003 * (i + 3)) for i, p in enumerate(prefixes)}
    expected = add_kv_cache_scales(ckpt, written, naming)
    r = runner(ckpt, FP8, mtp_step=1)
    layers = attention_layers(r)
    assert len(layers) == len(expected)
    for (name, layer), (prefix, (k, v)) in zip(layers, sorted(expected.items())):
        assert name == prefix.replace("model.language_model.", "model.") + ".self_attn"
        assert layer.kv_scales_host == pytest.approx((k, v))
        assert float(layer.k_scale) == pytest.approx(k) and float(layer.v_scale) == pytest.approx(v)
        assert layer.kv_scales_source.startswith("checkpoint")

    ref_runner, want = full_precision
    got = engine_logits(r, [IDS], chunk=16)[0]
    assert (got - want).abs().mean() <= 0.03
    n = len(IDS)
    for (k_ref, v_ref), (k_q, v_q), (_, layer) in zip(ref_runner.pools.kv, r.pools.kv, layers):
        k_scale, v_scale = layer.kv_scales_host
        assert k_q[:n].float().abs().max() > 100  # the scale spread values over the e4m3 range
        for stored, scale, real in ((k_q, k_scale, k_ref), (v_q, v_scale, v_ref)):
            err = (stored[:n].float() * scale - real[:n]).norm() / real[:n].norm()
            assert err < 0.05, err


def test_scale_updates_keep_the_device_tensors(tiny_dense):
    """CUDA graphs captured before the scales change read them through fixed addresses."""
    layer = attention_layers(runner(tiny_dense, FP8))[0][1]
    k_ptr, v_ptr = layer.k_scale.data_ptr(), layer.v_scale.data_ptr()
    layer.set_kv_scales(0.25, 0.5, "test")
    assert (layer.k_scale.data_ptr(), layer.v_scale.data_ptr()) == (k_ptr, v_ptr)
    scales = layer.kv_scales
    assert scales.k is layer.k_scale and (scales.k_host, scales.v_host) == (0.25, 0.5)
    assert float(scales.v) == 0.5


def test_bad_scale_in_the_checkpoint_is_named(tiny_dense, tmp_path):
    ckpt = shutil.copytree(tiny_dense, tmp_path / "ckpt")
    prefix = attention_prefixes(ckpt)[0]
    add_kv_cache_scales(ckpt, {prefix: (-1.0, 0.5)})
    with pytest.raises(CheckpointMismatch, match=rf"{prefix}\.self_attn\.k_scale.*> 0"):
        runner(ckpt, FP8)
