"""Tiny Qwen3.5 models at one decode row with their RMSNorms split across the GEMVs
(appliance/models/qwen3_5.py SPLIT_NORMS, appliance_kernels/gemv_norm.py): the teacher-forced
logits, one token per step, equal those of the same steps with the norm kernels, every one-row
linear on the GEMV in both (the Triton interpreter here, CUDA on the GPU). Covers the unquantised
GEMV, online fp8 per channel, block fp8 (the layer's bf16 b / a as the in_proj's tail) and a MoE
model (its MoE neither takes nor makes a split norm: only the attention-side ones split)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from fp8_cases import runner  # noqa: E402
from test_qwen3_5_parity import engine_logits  # noqa: E402

import appliance_kernels.fp8  # noqa: E402
import appliance_kernels.fp8_block  # noqa: E402
import appliance_kernels.gemv_swiglu  # noqa: E402
from appliance.models import qwen3_5  # noqa: E402
from appliance.models.layers import quant_methods  # noqa: E402
from appliance.testing.fp8_checkpoint import write_fp8_checkpoint  # noqa: E402
from appliance.testing.tiny import build_qwen3_5  # noqa: E402

IDS = [5, 17, 29, 41, 53]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("split_norms")
    dense = build_qwen3_5(root / "dense", seed=5)
    out = {"dense": dense, "moe": build_qwen3_5(root / "moe", moe=True, seed=6)}
    write_fp8_checkpoint(dense, root / "block-q", root / "block-d", layout="fp8", block=(32, 32))
    out["block"] = root / "block-q"
    return out


def _one_row_gemvs(monkeypatch) -> list[int]:
    """Every one-row linear on the GEMV kernels (as on CUDA); returns a list that grows by one per
    norm handed to a producing GEMV."""
    for module in (quant_methods, appliance_kernels.fp8_block):
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    one_row = lambda x, w: x.numel() == x.shape[-1]  # noqa: E731
    monkeypatch.setattr(appliance_kernels.fp8, "one_row_gemv", one_row)
    monkeypatch.setattr(quant_methods, "one_row_gemv", one_row)
    splits = []
    real = qwen3_5.split_norm

    def counted(*args):
        add = real(*args)
        if add is not None:
            splits.append(1)
        return add

    monkeypatch.setattr(qwen3_5, "split_norm", counted)
    return splits


@pytest.mark.parametrize(
    "name,quantization,options,swiglu,splits_per_step",
    [
        # every layer's post-attention norm and every input norm but layer 0's: 2 L - 1
        ("dense", "", {"dtype": "bfloat16"}, False, lambda layers: 2 * layers - 1),
        ("dense", "fp8", {}, False, lambda layers: 2 * layers - 1),
        # the MLP's gate_up + activation as one kernel, finishing the norm (gemv_swiglu.py)
        ("dense", "fp8", {"dtype": "bfloat16"}, True, lambda layers: 2 * layers - 1),
        ("block", "", {}, False, lambda layers: 2 * layers - 1),
        # the post-attention norms feed the MoE, the input norms follow its sum: none split
        ("moe", "fp8", {}, False, lambda layers: 0),
    ],
)
def test_split_norms_give_the_norm_kernels_logits(
    checkpoints, monkeypatch, name, quantization, options, swiglu, splits_per_step
):
    splits = _one_row_gemvs(monkeypatch)
    swiglus = []
    if swiglu:
        monkeypatch.setattr(appliance_kernels.gemv_swiglu, "USE_SWIGLU", True)
        monkeypatch.setattr(appliance_kernels.gemv_swiglu, "use_triton", lambda t: True)
        real_swiglu = quant_methods.gemv_swiglu

        def counted_swiglu(*args):
            swiglus.append(args[-1] is not None)  # whether it finished a split norm
            return real_swiglu(*args)

        monkeypatch.setattr(quant_methods, "gemv_swiglu", counted_swiglu)
    assert qwen3_5.SPLIT_NORMS
    options = dict(options, disable_cuda_graph=True)  # one forward a step (no captures)
    model = runner(checkpoints[name], quantization, **options)
    got = engine_logits(model, [IDS], chunk=1)[0]
    layers = len(model.model.model.layers)
    assert len(splits) == len(IDS) * splits_per_step(layers)
    if swiglu:  # every MLP's gate_up took the fused kernel, each with its split norm
        assert swiglus == [True] * (len(IDS) * layers)
    monkeypatch.setattr(qwen3_5, "SPLIT_NORMS", False)
    splits.clear()
    want = engine_logits(runner(checkpoints[name], quantization, **options), [IDS], chunk=1)[0]
    assert not splits
    assert want.std() > 0.5
    # the normed row is rounded before its 1 / rms factor here, after it there
    assert (got.float() - want.float()).abs().mean() < 0.03
    top2 = want.float().topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1  # greedy tokens equal where the top-2 gap is clear
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
