"""The GDN layer's gated output norm applied by the decode recurrence as it stores each row
(appliance_kernels.gdn.NORM_IN_RECURRENCE, GatedNorm built by appliance/models/layers/gdn.py):
the teacher-forced logits of a tiny bf16 Qwen3.5 model, one token per step with the recurrence
kernel (the Triton interpreter here, CUDA on the GPU), equal those of the norm's own kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from fp8_cases import runner  # noqa: E402
from test_qwen3_5_parity import engine_logits  # noqa: E402

import appliance_kernels.gdn as gdn_kernels  # noqa: E402
from appliance.testing.tiny import build_qwen3_5  # noqa: E402

IDS = [5, 17, 29, 41, 53, 65]


def test_the_norm_inside_the_recurrence_gives_the_norm_kernels_logits(tmp_path, monkeypatch):
    ckpt = build_qwen3_5(tmp_path / "dense", seed=5)
    monkeypatch.setattr(gdn_kernels, "use_triton", lambda t: True)  # the recurrence kernel
    launches = []
    real = gdn_kernels._recurrent_launch

    def counted(*args):
        launches.append(args[-1] is not None)  # the norm handed to the kernel
        return real(*args)

    monkeypatch.setattr(gdn_kernels, "_recurrent_launch", counted)
    monkeypatch.setattr(gdn_kernels, "NORM_IN_RECURRENCE", True)
    model = runner(ckpt, dtype="bfloat16")
    launches.clear()  # on CUDA the runner's graph captures ran the layers already
    got = engine_logits(model, [IDS], chunk=1)[0]
    assert launches and all(launches)
    monkeypatch.setattr(gdn_kernels, "NORM_IN_RECURRENCE", False)
    model = runner(ckpt, dtype="bfloat16")
    launches.clear()
    want = engine_logits(model, [IDS], chunk=1)[0]
    assert launches and not any(launches)
    assert want.float().std() > 0.5
    # the same roundings in both routes; only the order of the norm's fp32 sum may differ
    assert (got.float() - want.float()).abs().mean() < 0.01
    top2 = want.float().topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
