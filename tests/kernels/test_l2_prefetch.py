"""The one-row GEMVs' L2 prefetch of their weight (appliance_kernels/l2_prefetch.py): which
programs prefetch what, only under PDL; on the GPU, the same outputs with and without it and the
instructions present in what was compiled."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gpu, randn

from appliance_kernels import l2_prefetch, triton_utils
from appliance_kernels.fp8 import per_token_quant_ref
from appliance_kernels.fp8_block import quantize_block_ref
from appliance_kernels.fp8_gemv import fp8_gemv, fp8_gemv_block

PDL = {"PDL": True, "launch_pdl": True}


def test_parse_names_what_it_accepts():
    assert l2_prefetch.parse("off") == ("off", 0.0)
    assert l2_prefetch.parse("line:8") == ("line", 8.0)
    assert l2_prefetch.parse("bulk:0.5") == ("bulk", 0.5)
    for bad in ("on", "line", "bulk:", "tma:4"):
        with pytest.raises(ValueError, match="off, line:MiB or bulk:MiB"):
            l2_prefetch.parse(bad)


def test_prefetch_args_bound_the_programs_by_the_bytes():
    w = torch.empty(16384, 5120, dtype=torch.float8_e4m3fn)  # 27B GDN in_proj, 40 KiB a program
    args, consts = l2_prefetch.prefetch_args(w, 8, 2048, PDL, "bulk:8")
    assert args == (205, 5120, 5120) and consts == {"PF": 2, "PF_LINES": 64}  # ceil(8 MiB / 40 KiB)
    args, consts = l2_prefetch.prefetch_args(w, 8, 2048, PDL, "line:1000")
    assert args[0] == 2048 and consts["PF"] == 1  # never more programs than the launch has
    w16 = torch.empty(5120, 17408, dtype=torch.bfloat16)  # 34 KiB rows: 272 lines -> 512
    assert l2_prefetch.prefetch_args(w16, 8, 640, PDL, "line:4")[1]["PF_LINES"] == 512


def test_prefetch_only_under_pdl_and_bulk_only_on_16_byte_chunks():
    w = torch.empty(64, 5120, dtype=torch.bfloat16)
    assert l2_prefetch.prefetch_args(w, 8, 8, {}, "bulk:8") == ((0, 0, 0), {"PF": 0, "PF_LINES": 1})
    assert l2_prefetch.prefetch_args(w, 8, 8, PDL, "off")[1]["PF"] == 0
    odd = torch.empty(64, 300, dtype=torch.bfloat16)  # 600-byte rows: 37.5-byte chunks
    assert l2_prefetch.prefetch_args(odd, 8, 8, PDL, "bulk:8")[1]["PF"] == 1
    strided = torch.empty(64, 640, dtype=torch.float8_e4m3fn)[:, :512]
    assert l2_prefetch.prefetch_args(strided, 8, 8, PDL, "line:1")[0] == (8, 512, 640)


@gpu
@pytest.mark.parametrize("spec", ["line:4", "bulk:4", "bulk:1000"])
@pytest.mark.parametrize("kind", ["channel", "block", "bf16"])
def test_outputs_do_not_change_with_the_prefetch(monkeypatch, kind, spec):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL (and the bulk prefetch) need SM90")
    monkeypatch.setattr(triton_utils, "USE_PDL", True)
    n, k = 5120, 6144
    w = randn(n, k, seed=1, scale=0.05)
    x = randn(1, k, dtype=torch.bfloat16, seed=2)
    if kind == "channel":
        w_q, s = per_token_quant_ref(w)
        run = lambda: fp8_gemv(x, w_q, s.reshape(-1))  # noqa: E731
    elif kind == "block":
        w_q, s = quantize_block_ref(w, (128, 128))
        run = lambda: fp8_gemv_block(x, w_q, s, (128, 128))  # noqa: E731
    else:
        w16 = w.to(torch.bfloat16)
        run = lambda: fp8_gemv(x, w16, None)  # noqa: E731
    monkeypatch.setattr(l2_prefetch, "GEMV_PREFETCH", "off")
    expected = run()
    monkeypatch.setattr(l2_prefetch, "GEMV_PREFETCH", spec)
    for _ in range(3):
        assert torch.equal(run(), expected)
    torch.cuda.synchronize()
