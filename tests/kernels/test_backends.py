"""Backend selection: every flag value either selects its backend or falls back with exactly one
warning naming the reason; availability is faked with Platform values."""

from __future__ import annotations

import logging

import pytest

from kernels import backends
from kernels.backends import Platform, resolve_backends

ALL = frozenset({"triton", "flashinfer", "fla", "flash_qla", "sgl_kernel", "vllm"})
H200_ALL = Platform(True, (9, 0), ALL)
H200_BARE = Platform(True, (9, 0), frozenset({"triton"}))
A100 = Platform(True, (8, 0), frozenset({"triton", "flash_qla", "sgl_kernel", "vllm"}))
L40 = Platform(True, (8, 9), frozenset({"triton"}))
CPU = Platform(False, (0, 0), frozenset({"triton"}))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    "kind,value,platform,expected,reason",
    [
        ("gdn_prefill", "auto", H200_ALL, "triton", None),
        ("gdn_prefill", "triton", H200_BARE, "triton", None),
        ("gdn_prefill", "fla", H200_ALL, "fla", None),
        ("gdn_prefill", "fla", H200_BARE, "triton", "fla (fla-core) is not importable"),
        ("gdn_prefill", "flashqla", H200_ALL, "flashqla", None),
        ("gdn_prefill", "flashqla", H200_BARE, "triton", "flash_qla is not importable"),
        ("gdn_prefill", "flashqla", A100, "triton", "flashqla needs SM90+, this GPU is SM80"),
        ("gdn_prefill", "torch", H200_ALL, "torch", None),
        ("fp8_gemm", "auto", H200_ALL, "cutlass", None),
        ("fp8_gemm", "auto", H200_BARE, backends.MIXED_FP8, None),
        (
            "fp8_gemm",
            "auto",
            Platform(True, (9, 0), frozenset({"triton", "sgl_kernel"})),
            "sgl",
            None,
        ),
        ("fp8_gemm", "auto", L40, "triton", None),
        ("fp8_gemm", "auto", A100, "torch", None),
        ("fp8_gemm", "cutlass", H200_ALL, "cutlass", None),
        ("fp8_gemm", "cutlass", H200_BARE, backends.MIXED_FP8, "vllm is not importable"),
        ("fp8_gemm", "sgl", H200_ALL, "sgl", None),
        ("fp8_gemm", "sgl", H200_BARE, backends.MIXED_FP8, "sgl_kernel is not importable"),
        ("fp8_gemm", "sgl", A100, "torch", "sgl needs SM90+, this GPU is SM80"),
        ("fp8_gemm", "triton", H200_BARE, "triton", None),
        ("fp8_gemm", "triton", A100, "torch", "triton needs SM89+, this GPU is SM80"),
        ("fp8_gemm", "torch", H200_BARE, "torch", None),
        ("attention", "auto", H200_ALL, "triton", None),
        ("attention", "flashinfer", H200_ALL, "flashinfer", None),
        (
            "attention",
            "flashinfer",
            Platform(True, (7, 5), ALL),
            "triton",
            "flashinfer needs SM80+, this GPU is SM75",
        ),
        ("attention", "flashinfer", H200_BARE, "triton", "flashinfer is not importable"),
        ("attention", "triton", H200_BARE, "triton", None),
        ("attention", "torch", H200_ALL, "torch", None),
        ("attention", "triton", CPU, "torch", "no CUDA device"),
        ("gdn_prefill", "auto", CPU, "torch", None),
        ("fp8_gemm", "cutlass", CPU, "torch", "no CUDA device"),
    ],
)
def test_each_flag_value_selects_or_warns_once(kind, value, platform, expected, reason, caplog):
    caplog.set_level(logging.WARNING, logger="kernels.backends")
    table = resolve_backends(platform=platform, **{kind: value})
    assert table[kind] == expected
    mine = [w for w in warnings_of(caplog) if w.startswith(kind)]
    if reason is None:
        assert mine == []
    else:
        assert len(mine) == 1 and reason in mine[0] and repr(expected) in mine[0]


def test_env_flags_are_read_through_appliance_envs(monkeypatch):
    monkeypatch.setenv("APPLIANCE_GDN_PREFILL_BACKEND", "fla")
    monkeypatch.setenv("APPLIANCE_FP8_GEMM", "sgl")
    assert resolve_backends(platform=H200_ALL) == {
        "attention": "triton",
        "gdn_prefill": "fla",
        "fp8_gemm": "sgl",
    }


def test_unknown_value_is_rejected():
    with pytest.raises(ValueError, match="attention"):
        resolve_backends(attention="xformers", platform=H200_ALL)


def test_configure_logs_table_and_dispatchers_read_it(caplog):
    caplog.set_level(logging.INFO, logger="kernels.backends")
    try:
        table = backends.configure(
            attention="torch", gdn_prefill="triton", fp8_gemm="torch", platform=H200_BARE
        )
        assert backends.selected("attention") == "torch" and table["gdn_prefill"] == "triton"
        assert any(
            "attention=torch gdn_prefill=triton fp8_gemm=torch" in r.getMessage()
            for r in caplog.records
        )
    finally:
        backends.reset()
