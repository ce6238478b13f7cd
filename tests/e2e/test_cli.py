"""`appliance` CLI: every config field is a flag with the dataclass default, help lists everything,
bad values are rejected naming the field."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from appliance import envs
from appliance.cli import _config_sections, build_parser, main
from appliance.config import ServeConfig
from tests.appliance.hub_cache import add_snapshot
from tests.e2e.live import ROOT, free_port, start_appliance


def _build(argv: list[str]) -> ServeConfig:
    from appliance.cli import _build_config

    parser, dests = build_parser()
    return _build_config(parser.parse_args(argv), dests)


def test_help_lists_every_field_and_env_var():
    out = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for _, cls in _config_sections():
        for f in dataclasses.fields(cls):
            if f.name != "model_dir" and not dataclasses.is_dataclass(f.default):
                assert "--" + f.name.replace("_", "-") in out.stdout, f.name
    for name in envs.registry():
        assert name in out.stdout
    assert "MODEL" in out.stdout and "--revision REV" in out.stdout and "serve" in out.stdout


def test_defaults_come_from_the_dataclasses():
    assert _build(["serve"]) == ServeConfig()


def test_flags_override_fields():
    config = _build(
        [
            "serve",
            "/models/x",
            "--tp",
            "2",
            "--port",
            "9001",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "8",
            "--no-access-log",
            "--mem-fraction",
            "0.5",
            "--transport",
            "tcp",
        ]
    )
    assert config.engine.model.model_dir == "/models/x"
    assert config.engine.parallel.tp == 2 and config.server.port == 9001
    assert config.engine.model.max_model_len == 4096
    assert config.engine.scheduler.max_num_seqs == 8
    assert config.server.access_log is False and config.engine.cache.mem_fraction == 0.5
    assert config.launch.transport == "tcp"


def test_vllm_spellings_alias_or_point_to_ours(capsys):
    config = _build(["serve", "/m", "--tensor-parallel-size", "2", "--enforce-eager"])
    assert config.engine.parallel.tp == 2 and config.engine.graphs.disable_cuda_graph is True
    for flag in ("--gpu-memory-utilization", "--mem-fraction-static"):
        config = _build(["serve", "/m", flag, "0.9"])
        assert config.engine.cache.gpu_memory_utilization == 0.9
    assert _build(["serve", "/m"]).engine.cache.gpu_memory_utilization == 0  # mem_fraction's rule
    for argv, expected in (
        (
            ["--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization 1.5: expected a number in (0, 1]",
        ),
        (["--max-model", "5"], "unrecognized arguments: --max-model"),  # no abbreviations
    ):
        with pytest.raises(SystemExit) as info:
            main(["serve", "/m", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err


def test_kv_cache_dtype_fp8_is_read_as_e4m3():
    """vLLM's spelling: --kv-cache-dtype fp8 is fp8_e4m3 (the config, its log and the pools)."""
    for value in ("fp8", "fp8_e4m3"):
        config = _build(["serve", "/models/x", "--kv-cache-dtype", value])
        assert config.engine.cache.kv_cache_dtype == "fp8_e4m3"


def test_bad_values_name_the_flag_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tmp_path), "--transport", "carrier-pigeon"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "appliance serve: error: --transport carrier-pigeon: expected ipc or tcp\n"
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--kv-cache-dtype", "fp8_e5m2"])
    err = capsys.readouterr().err
    expected = "--kv-cache-dtype fp8_e5m2: expected auto, fp8 or fp8_e4m3"
    assert err == f"appliance serve: error: {expected}\n"
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--tp", "two"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "argument --tp/--tensor-parallel-size/--tp-size: invalid int value: 'two'" in err
    with pytest.raises(SystemExit):  # a key list without a key would switch authentication off
        main(["serve", str(tmp_path), "--api-key", " , "])
    err = capsys.readouterr().err
    expected = "--api-key  , : expected at least one key (comma-separated)"
    assert err == f"appliance serve: error: {expected}\n"
    with pytest.raises(SystemExit):  # no room for a prompt token and a generated one
        main(["serve", str(tmp_path), "--max-model-len", "1"])
    err = capsys.readouterr().err
    expected = "--max-model-len 1: expected 0 (the checkpoint's) or an integer >= 2"
    assert err == f"appliance serve: error: {expected}\n"
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such folder" in err
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path)])
    assert "not a checkpoint folder (no config.json)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--snapshot-slots", "-1", "expected an integer >= 0 (0: auto)"),
        ("--snapshot-mem-fraction", "1.5", "expected a number in [0, 1)"),
        ("--snapshot-interval", "-16", "expected an integer >= 0 (0: off)"),
    ],
)
def test_bad_snapshot_flags_are_one_line_before_starting(capsys, tmp_path, flag, value, expected):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tmp_path), flag, value])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"appliance serve: error: {flag} {value}: {expected}\n"


def test_help_of_a_field_commented_above_it():
    """A field whose comment is too long for its line (the lines above it) still gets help."""
    parser, _ = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    helps = {a.option_strings[0]: a.help for a in serve._actions if a.option_strings}
    assert helps["--snapshot-interval"].startswith("hybrid models: also snapshot the GDN state")
    assert helps["--snapshot-slots"].startswith("prefix-cache GDN state snapshot slots")
    assert helps["--max-num-seqs"] == "running requests at most (request slots) (default: 64)"


def test_unsupported_checkpoint_quantization_is_one_line_before_starting(
    capsys, tmp_path, tiny_dense
):
    ckpt = tmp_path / "awq-model"
    ckpt.mkdir()
    config = json.loads((tiny_dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (ckpt / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_dense / "tokenizer.json", ckpt)
    (ckpt / "model.safetensors").write_bytes(b"")  # never read: the check comes first
    with pytest.raises(SystemExit) as info:
        main(["serve", str(ckpt), "--port", str(free_port())])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("appliance serve: error: awq-model: quant_method 'awq' is not supported")
    assert err.count("\n") == 1 and "compressed-tensors" in err and "weight_block_size" in err


BLOCK_32 = {
    "quant_method": "fp8",
    "weight_block_size": [32, 32],
    "modules_to_not_convert": ["lm_head", r"re:.*\.linear_attn\.in_proj_[ab]$"],
}


def _without_hidden_size(config: dict) -> dict:
    del config.get("text_config", config)["hidden_size"]
    return config


@pytest.mark.parametrize(
    ("edit", "extra", "expected"),
    [
        (lambda c: "{not json", [], "config.json: not a readable JSON config (Expecting"),
        (lambda c: [], [], "config.json: expected a JSON object, got list"),
        (lambda c: {**c, "architectures": ["LlamaForCausalLM"]}, [], "'LlamaForCausalLM' is not"),
        (_without_hidden_size, [], "config.json: no 'hidden_size', which the model needs"),
        (
            lambda c: c,
            ["--max-model-len", "300000"],
            "--max-model-len 300000 is more than the model's context (262144: "
            "max_position_embeddings 262144)",
        ),
        (  # 4 heads, 2 KV heads, 2 / 4 linear heads, MLP 128 wide: before 7 processes start
            lambda c: c,
            ["--tp", "3"],
            "--tp 3: tp 3 does not divide num_attention_heads 4, intermediate_size 128, "
            "linear_num_key_heads 2, linear_num_value_heads 4, num_key_value_heads 2 (nor a "
            "divisor of 3)",
        ),
        (lambda c: c, ["--tp", "8"], "--tp 8: tp 8 does not divide num_attention_heads 4, "),
        (  # 32-row blocks fit the fused segments at TP=1; at TP=2 the GDN keys are 16 rows a rank
            lambda c: {**c, "quantization_config": BLOCK_32},
            ["--tp", "2"],
            "ckpt: fp8 block [32, 32] over tensor-parallel size 2: fused segments of [32, 32, 64, "
            "64] rows (in_proj_qkv) split into [16, 16, 32, 32] rows a rank, which do not start "
            "on block_n = 32 boundaries; use a smaller tensor-parallel size",
        ),
        (
            lambda c: c,
            ["--runner", "nosuch.mod:Runner"],
            "--runner nosuch.mod:Runner: no module 'nosuch.mod' can be imported",
        ),
    ],
)
def test_a_config_the_model_cannot_use_is_one_line_before_starting(
    capsys, tmp_path, tiny_dense, edit, extra, expected
):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dense, ckpt)
    config = edit(json.loads((tiny_dense / "config.json").read_text()))
    text = config if isinstance(config, str) else json.dumps(config)
    (ckpt / "config.json").write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["serve", str(ckpt), "--port", str(free_port()), *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("appliance serve: error: ") and err.count("\n") == 1
    assert expected in err


def test_bad_generation_config_is_one_line_before_starting(capsys, tiny_dense, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tiny_dense), "--port", str(free_port()), "--generation-config", "/no"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err == "appliance serve: error: --generation-config /no: no generation_config.json in it\n"
    )
    (tmp_path / "generation_config.json").write_text('{"top_p": 2}')
    with pytest.raises(SystemExit):
        main(
            [
                "serve",
                str(tiny_dense),
                "--port",
                str(free_port()),
                "--generation-config",
                str(tmp_path),
            ]
        )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "generation_config.json: top_p" in err


def _run_cli(args: list[str], env: dict[str, str], cwd=ROOT) -> tuple[int, str, float]:
    """`python -m appliance.cli ...` as a user runs it: (exit code, stderr, seconds)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("APPLIANCE_", "HF_"))}
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, out.stderr + out.stdout, time.monotonic() - start


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("APPLIANCE_FP8_GEMM", "bogus", "expected one of auto, cutlass, sgl, triton, torch"),
        ("APPLIANCE_GDN_PREFILL_BACKEND", "fast", "expected one of auto, torch, triton, fla,"),
        ("APPLIANCE_LOG_LEVEL", "loud", "expected one of DEBUG, INFO, WARNING, ERROR"),
        ("APPLIANCE_LOG_COLOR", "pink", "expected one of auto, always, never"),
        ("APPLIANCE_LOG_STATS_INTERVAL", "often", "expected a number"),
        ("APPLIANCE_LOG_STATS_INTERVAL", "-5", "expected a number >= 0"),
        ("APPLIANCE_LOG_STATS_INTERVAL", "nan", "expected a number >= 0"),
        ("APPLIANCE_LOG_STATS_INTERVAL", "0.001", "expected 0 (off) or a number >= 0.1"),
        ("APPLIANCE_HEARTBEAT_TIMEOUT", "inf", "expected a number >= 0"),
        ("APPLIANCE_HEARTBEAT_TIMEOUT", "0.5", "expected 0 (off) or a number >= 2"),
        ("APPLIANCE_API_KEY", " , ", "expected at least one key"),
    ],
)
def test_bad_env_flag_is_one_line_before_anything_starts(tmp_path, flag, value, expected):
    code, err, seconds = _run_cli(
        ["serve", "--port", str(free_port())], {flag: value, "APPLIANCE_HOME": str(tmp_path)}
    )
    assert code != 0 and seconds < 2.0, (code, seconds, err)
    assert err == f"appliance serve: error: {flag}={value!r}: {expected}" + err.split(expected)[1]
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing was built: the check came first


def test_backends_command_reports_a_bad_env_flag_in_one_line():
    code, err, seconds = _run_cli(["backends"], {"APPLIANCE_GDN_PREFILL_BACKEND": "fast"})
    assert code == 1 and err.count("\n") == 1 and seconds < 2.0, (seconds, err)
    assert err.startswith("appliance backends: error: APPLIANCE_GDN_PREFILL_BACKEND='fast': ")


def test_busy_port_is_one_line_before_loading(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err, seconds = _run_cli(
            ["serve", "--port", str(port)], {"APPLIANCE_HOME": str(tmp_path)}
        )
    assert code != 0 and seconds < 2.0, (code, seconds, err)
    assert err.startswith(f"appliance serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())  # the default model was not built first


def test_a_host_that_is_not_this_machines_is_one_line_naming_host(tmp_path):
    args = ["serve", "--host", "192.0.2.1", "--port", str(free_port())]  # TEST-NET-1: nobody's
    code, err, _ = _run_cli(args, {"APPLIANCE_HOME": str(tmp_path)})
    assert code != 0 and err.count("\n") == 1, err
    assert "cannot listen on 192.0.2.1:" in err and "not an address of this host" in err


def test_cuda_without_a_gpu_is_one_line_before_loading(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    code, err, _ = _run_cli(
        ["serve", "--device", "cuda", "--port", str(free_port())], {"APPLIANCE_HOME": str(tmp_path)}
    )
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("appliance serve: error: --device cuda --tp 1: 0 CUDA device(s) visible")
    assert not any(tmp_path.iterdir())  # the default model was not built first


def _without_a_tensor(src, dest, fragment: str) -> str:
    """A copy of checkpoint `src` in `dest` with the first tensor whose name has `fragment` left
    out; returns that name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    (path,) = sorted(dest.glob("*.safetensors"))
    state = load_file(path)
    name = next(k for k in state if fragment in k)
    del state[name]
    save_file(state, path, metadata={"format": "pt"})
    return name


class FaultyRunner:
    """A runner whose constructor has a bug (not a fact about the input): keep its traceback."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("a bug in the runner")


def test_a_role_that_cannot_start_says_why_in_one_line(tiny_dense, tmp_path):
    """A checkpoint missing a tensor is found by the worker while it loads: the launcher's last line
    names the worker, the exception and the tensor, with no traceback; a fault in the code (an
    exception that is not about the input) keeps its traceback."""
    model = tmp_path / "model"
    missing = _without_a_tensor(tiny_dense, model, "layers.1.mlp.down_proj")
    args = ["serve", str(model), "--port", str(free_port())]
    code, err, _ = _run_cli(args, {"APPLIANCE_LOG_COLOR": "never"})
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert "worker 0 (pid " in last and "failed during startup: CheckpointMismatch: " in last, err
    assert missing.replace("language_model.", "") in last
    assert "Traceback" not in err, err

    runner = "tests.e2e.test_cli:FaultyRunner"
    code, err, _ = _run_cli([*args[:2], "--port", str(free_port()), "--runner", runner], {})
    assert code == 1 and "Traceback" in err and "RuntimeError: a bug in the runner" in err, err
    assert "worker 0 (pid " in err and "exited with code 1 during startup" in err


def test_unknown_hub_id_is_one_line_naming_what_was_tried(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    code, err, seconds = _run_cli(["serve", "no-org/no-model", "--revision", "v9"], env, tmp_path)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err == (
        "appliance serve: error: model 'no-org/no-model' (revision v9): "
        f"no folder {tmp_path / 'no-org/no-model'}; not in the Hub cache {tmp_path / 'hf/hub'}, "
        "and HF_HUB_OFFLINE=1 forbids downloading it\n"
    )


def test_serve_a_hub_id_from_the_cache_offline(tiny_dense, tmp_path):
    """`appliance serve ORG/NAME` through the real CLI, offline, from a Hub cache laid out here;
    the API names the model by its Hub id and answers a request."""
    snapshot = add_snapshot(tmp_path / "hub", "tiny-org/tiny-dense", tiny_dense)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    app = start_appliance("tiny-org/tiny-dense", tmp_path / "serve.log", env=env)
    try:
        card = httpx.get(f"{app.url}/v1/models", timeout=10).json()["data"][0]
        assert card["id"] == "tiny-org/tiny-dense"
        reply = httpx.post(
            f"{app.url}/v1/completions",
            json={
                "model": "tiny-org/tiny-dense",
                "prompt": "def f(x):",
                "max_tokens": 4,
                "ignore_eos": True,  # unseeded sampling: an early eos must not fail the count
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        code = app.stop()
    assert code == 0, app.log()[-3000:]
    block = {
        line.split("=")[0].strip(): line.split("=", 1)[1].strip()
        for line in app.log().splitlines()
        if line.startswith("  ") and "=" in line
    }
    assert block["engine.model.model_dir"] == repr(str(snapshot))
    assert block["server.served_model_name"] == "'tiny-org/tiny-dense'"


def test_documented_serve_commands_parse():
    """Every `appliance serve ...` the README and docs/operations.md show is accepted by the real
    parser and builds a config (usage brackets `[...]` and trailing comments dropped)."""
    import re
    import shlex

    from appliance.cli import _build_config

    commands = []
    for doc in ("README.md", "docs/operations.md"):
        text = (ROOT / doc).read_text()
        commands += re.findall(r"appliance serve((?: [^`#\n]*)?)", text)
    assert len(commands) >= 8 and any("--reasoning off" in c for c in commands)
    parser, dests = build_parser()
    for tail in commands:
        argv = shlex.split(re.sub(r"\[[^\]]*\]", "", tail.split("  ")[0]))
        if any(arg.endswith("...") or arg.startswith(("ORG/", "${", "/models/${")) for arg in argv):
            continue  # placeholders in prose, not commands
        config = _build_config(parser.parse_args(["serve", *argv]), dests)
        assert isinstance(config, ServeConfig), tail


def test_bare_appliance_shows_its_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: appliance") and "serve" in err and "backends" in err
