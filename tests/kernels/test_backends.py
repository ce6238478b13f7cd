"""Backend selection: every requested value either selects its backend or falls back with exactly
one warning naming the reason; unset requests mean "auto"; availability is faked with Platform
values."""

from __future__ import annotations

import logging

import pytest

from appliance_kernels import backends
from appliance_kernels.backends import Platform, resolve_backends

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
    caplog.set_level(logging.WARNING, logger="appliance_kernels.backends")
    table = resolve_backends(platform=platform, **{kind: value})
    assert table[kind] == expected
    mine = [w for w in warnings_of(caplog) if w.startswith(kind)]
    if reason is None:
        assert mine == []
    else:
        assert len(mine) == 1 and reason in mine[0] and repr(expected) in mine[0]


def test_requests_default_to_auto_and_no_flag_is_read(monkeypatch):
    """appliance_kernels/ reads no environment: the caller passes the flag values (appliance:
    envs)."""
    monkeypatch.setenv("APPLIANCE_GDN_PREFILL_BACKEND", "fla")
    monkeypatch.setenv("APPLIANCE_FP8_GEMM", "sgl")
    expected = {"attention": "triton", "gdn_prefill": "triton", "fp8_gemm": "cutlass"}
    assert resolve_backends(platform=H200_ALL) == expected
    assert resolve_backends("auto", "auto", "auto", platform=H200_ALL) == expected


def test_requested_values_are_case_insensitive():
    table = resolve_backends(attention="FlashInfer", fp8_gemm="SGL", platform=H200_ALL)
    assert table["attention"] == "flashinfer" and table["fp8_gemm"] == "sgl"


@pytest.mark.parametrize("kind", ["attention", "gdn_prefill", "fp8_gemm"])
def test_unknown_value_is_rejected(kind):
    accepted = ", ".join(backends.CHOICES[kind])
    with pytest.raises(ValueError, match=f"{kind} backend 'xformers': expected one of {accepted}"):
        resolve_backends(platform=H200_ALL, **{kind: "xformers"})


def test_configure_logs_table_and_dispatchers_read_it(caplog):
    caplog.set_level(logging.INFO, logger="appliance_kernels.backends")
    try:
        table = backends.configure(
            attention="torch", gdn_prefill="triton", fp8_gemm="torch", platform=H200_BARE
        )
        assert table == {"attention": "torch", "gdn_prefill": "triton", "fp8_gemm": "torch"}
        assert [backends.selected(kind) for kind in table] == ["torch", "triton", "torch"]
        assert any(
            "attention=torch gdn_prefill=triton fp8_gemm=torch" in r.getMessage()
            for r in caplog.records
        )
        table["attention"] = "flashinfer"  # the returned table is a copy
        assert backends.selected("attention") == "torch"
        backends.configure(fp8_gemm="sgl", platform=H200_ALL)  # a later call replaces the table
        assert backends.selected("fp8_gemm") == "sgl" and backends.selected("attention") == "triton"
    finally:
        backends.reset()


def test_selected_without_configure_resolves_auto_once(monkeypatch, caplog):
    """A process that never configured (a benchmark, a test) gets the "auto" table, resolved on the
    first `selected` call and kept."""
    caplog.set_level(logging.INFO, logger="appliance_kernels.backends")
    detected = []
    monkeypatch.setattr(backends, "detect_platform", lambda: detected.append(1) or H200_BARE)
    backends.reset()
    try:
        assert backends.selected("fp8_gemm") == backends.MIXED_FP8
        assert backends.selected("attention") == "triton"
        assert backends.selected("gdn_prefill") == "triton"
        assert len(detected) == 1
        assert sum("kernel backends:" in r.getMessage() for r in caplog.records) == 1
    finally:
        backends.reset()


def test_appliance_backends_command_passes_the_env_flags(monkeypatch, capsys):
    """The caller's side of the contract: `appliance backends` reads APPLIANCE_GDN_PREFILL_BACKEND
    and APPLIANCE_FP8_GEMM through appliance.envs and hands the values to `resolve_backends`."""
    from appliance import cli

    monkeypatch.setattr("appliance.logging.setup_logging", lambda *args, **kwargs: None)
    monkeypatch.setattr(backends, "detect_platform", lambda: H200_ALL)
    monkeypatch.setenv("APPLIANCE_GDN_PREFILL_BACKEND", "fla")
    monkeypatch.setenv("APPLIANCE_FP8_GEMM", "sgl")
    assert cli.main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"platform: {H200_ALL}"
    assert lines[1:] == [
        "attention    triton",
        "gdn_prefill  fla",
        "fp8_gemm     sgl",
        "fp8_block    triton",  # block-scaled weights: sglang-kernel's GEMM is per channel only
    ]
