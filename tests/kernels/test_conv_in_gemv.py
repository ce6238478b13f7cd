"""The GDN layer at one decode row with its causal conv run as the in_proj GEMV stores q, k and v
(appliance/models/layers/gdn.py `_gemv_conv`, appliance_kernels.fp8_gemv.GemvConv): the
teacher-forced logits of tiny Qwen3.5 models, one token per step, equal those of the same steps
with the conv kernel, every one-row linear on the GEMV in both (the Triton interpreter here, CUDA
on the GPU). Covers the unquantised GEMV (no tail), online fp8 per channel and block fp8 with
the layer's bf16 b / a as the in_proj's tail (the conv's default routes, FUSE_CONV None; the tiny
compressed-tensors checkpoint keeps the GDN projections unquantised)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from fp8_cases import runner  # noqa: E402
from test_qwen3_5_parity import engine_logits  # noqa: E402
from tolerances import assert_same_decode  # noqa: E402

import appliance_kernels.fp8  # noqa: E402
import appliance_kernels.fp8_block  # noqa: E402
from appliance.models.layers import gdn, quant_methods  # noqa: E402
from appliance.testing.fp8_checkpoint import write_fp8_checkpoint  # noqa: E402
from appliance.testing.tiny import build_qwen3_5  # noqa: E402

IDS = [5, 17, 29, 41, 53, 65]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv_in_gemv")
    dense = build_qwen3_5(root / "dense", seed=3)
    out = {"dense": dense}
    write_fp8_checkpoint(dense, root / "block-q", root / "block-d", layout="fp8", block=(32, 32))
    out["block"] = root / "block-q"
    return out


def _one_row_gemvs_with_convs(monkeypatch) -> list[int]:
    """Every one-row linear on the GEMV kernels (as on CUDA); returns the conv widths the GEMVs
    were handed, call by call."""
    for module in (quant_methods, appliance_kernels.fp8_block):
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    one_row = lambda x, w: x.numel() == x.shape[-1]  # noqa: E731 - the graphs' batches stay
    monkeypatch.setattr(appliance_kernels.fp8, "one_row_gemv", one_row)
    monkeypatch.setattr(quant_methods, "one_row_gemv", one_row)
    convs = []
    for name in ("fp8_gemv", "fp8_gemv_block"):
        real = getattr(quant_methods, name)

        def counted(*args, _real=real, **kwargs):
            conv = args[-1] if args and isinstance(args[-1], tuple) else kwargs.get("conv")
            if conv is not None:
                convs.append(conv.weight.shape[1])
            return _real(*args, **kwargs)

        monkeypatch.setattr(quant_methods, name, counted)
    return convs


@pytest.mark.parametrize(
    "name,quantization,options",
    [
        ("dense", "", {"dtype": "bfloat16"}),  # a float32 16-bit model stays on cuBLAS
        ("dense", "fp8", {}),
        ("block", "", {}),
    ],
)
def test_the_conv_in_the_gemv_gives_the_conv_kernels_logits(
    checkpoints, monkeypatch, name, quantization, options
):
    convs = _one_row_gemvs_with_convs(monkeypatch)
    # fp8 (per channel, block) takes the conv by default (measured faster); 16-bit is forced
    assert gdn.FUSE_CONV is None
    if name == "dense" and quantization != "fp8":
        monkeypatch.setattr(gdn, "FUSE_CONV", True)
    fused = runner(checkpoints[name], quantization, **options)
    got = engine_logits(fused, [IDS], chunk=1)[0]
    assert convs and set(convs) == {4}  # the convs did run inside the GEMVs
    monkeypatch.setattr(gdn, "FUSE_CONV", False)
    convs.clear()
    want = engine_logits(runner(checkpoints[name], quantization, **options), [IDS], chunk=1)[0]
    assert not convs
    # the conv's output is rounded once here, twice there
    assert_same_decode(got, want, fused.dtype)
