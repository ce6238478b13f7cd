"""Decoder layers at one decode row with their RMSNorms run inside the next GEMV
(appliance/models/layers/row_norm.py, appliance_kernels.fp8_gemv.GemvNorm): the teacher-forced
logits of tiny models, one token per step, equal those of the same steps with the norm kernels,
every linear on the one-row GEMV in both (the Triton interpreter here, CUDA on the GPU). Covers the
unquantised bf16 GEMV, fp8 per channel (checkpoint and online), block fp8 with the GDN layer's bf16
b / a as the in_proj's tail, the three-linear attention fallback and an MoE layer, which takes the
normed row as it is."""

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
from appliance.models.layers import quant_methods, row_norm  # noqa: E402
from appliance.testing.fp8_checkpoint import write_fp8_checkpoint  # noqa: E402
from appliance.testing.tiny import build_qwen3_5  # noqa: E402

IDS = [5, 17, 29, 41, 53, 65]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("norm_in_gemv")
    dense = build_qwen3_5(root / "dense", seed=3)
    moe = build_qwen3_5(root / "moe", moe=True, seed=4, shared_expert_intermediate_size=64)
    out = {"dense": dense, "moe": moe}
    for name, src, layout in (("ct", dense, "compressed-tensors"), ("block", dense, "fp8")):
        write_fp8_checkpoint(
            src, root / f"{name}-q", root / f"{name}-d", layout=layout, block=(32, 32)
        )
        out[name] = root / f"{name}-q"
    write_fp8_checkpoint(moe, root / "moe-q", root / "moe-d", layout="compressed-tensors")
    out["moe-ct"] = root / "moe-q"
    return out


def _one_row_gemvs_everywhere(monkeypatch) -> None:
    """Every one-row linear on the GEMV kernels (as on CUDA), fp32 rows included."""
    for module in (quant_methods, appliance_kernels.fp8_block):
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    one_row = lambda x, w: x.numel() == x.shape[-1]  # noqa: E731 - the graphs' batches stay
    monkeypatch.setattr(appliance_kernels.fp8, "one_row_gemv", one_row)
    monkeypatch.setattr(quant_methods, "one_row_gemv", one_row)
    monkeypatch.setattr(row_norm, "use_triton", lambda t: True)


@pytest.mark.parametrize(
    "name,quantization,options",
    [
        ("dense", "", {"dtype": "bfloat16"}),
        ("ct", "", {}),
        ("dense", "fp8", {}),
        ("block", "", {}),
        ("moe-ct", "", {}),
    ],
)
def test_norms_in_the_gemvs_give_the_norm_kernels_logits(
    checkpoints, monkeypatch, name, quantization, options
):
    _one_row_gemvs_everywhere(monkeypatch)
    fused_rows = []
    real_gemv_norm = row_norm.RowNorm.gemv_norm

    def counted(self):
        fused_rows.append(self.h.shape[0])
        return real_gemv_norm(self)

    monkeypatch.setattr(row_norm.RowNorm, "gemv_norm", counted)
    fused = runner(checkpoints[name], quantization, **options)
    got = engine_logits(fused, [IDS], chunk=1)[0]
    assert fused_rows and set(fused_rows) == {1}  # the norms did run inside the GEMVs
    monkeypatch.setattr(row_norm, "FUSE_NORMS", False)
    want = engine_logits(runner(checkpoints[name], quantization, **options), [IDS], chunk=1)[0]
    assert want.std() > 0.5
    if fused.dtype != torch.float32:  # the normed row is not rounded to bf16 in the GEMV
        assert (got.float() - want.float()).abs().mean() < 0.03
        top2 = want.float().topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 0.1  # greedy tokens equal where the top-2 gap is clear
        assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    else:
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
