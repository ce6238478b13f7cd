"""`appliance` CLI: every config field is a flag with the dataclass default, help lists everything,
bad values are rejected naming the field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from appliance import envs
from appliance.cli import _config_sections, build_parser, main
from appliance.config import ServeConfig
from tests.e2e.live import ROOT


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
    assert "MODEL_DIR" in out.stdout and "serve" in out.stdout


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


def test_bad_values_name_the_field(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tmp_path), "--transport", "carrier-pigeon"])
    assert info.value.code == 2
    assert "transport: expected ipc or tcp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--tp", "two"])
    assert "--tp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path / "missing")])
    assert "not a checkpoint folder" in capsys.readouterr().err
