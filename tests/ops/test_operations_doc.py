"""docs/operations.md documents every env flag and every metric family that the code defines."""

from __future__ import annotations

from pathlib import Path

from appliance import envs
from appliance.metrics import MetricsRecorder

DOC = (Path(__file__).resolve().parents[2] / "docs/operations.md").read_text()


def test_every_env_flag_is_documented() -> None:
    missing = [name for name in envs.registry() if f"| `{name}` |" not in DOC]
    assert not missing, f"add to docs/operations.md section 2: {missing}"


def test_every_metric_is_in_the_table() -> None:
    missing = []
    for family in MetricsRecorder("m").registry.collect():
        exposed = family.name + "_total" if family.type == "counter" else family.name
        if f"| `{exposed}` | {family.type} |" not in DOC:
            missing.append(exposed)
    assert not missing, f"add to docs/operations.md section 4: {missing}"


def test_every_cli_flag_is_documented() -> None:
    """Every option of every `appliance` command has a row in section 7 (`| `--flag` |`); the
    `--no-x` twin of a boolean flag is covered by its `--x` row, an alias by a mention."""
    from appliance.cli import build_parser

    parser, _ = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them only here
    missing = []
    for name, command in commands.items():
        for action in command._actions:
            for i, flag in enumerate(action.option_strings):
                if flag in ("-h", "--help") or flag.startswith("--no-"):
                    continue
                # the first spelling has the row; an alias (vLLM's, SGLang's) is named in it
                if (f"| `{flag}` |" if i == 0 else f"`{flag}`") not in DOC:
                    missing.append(f"appliance {name} {flag}")
            if not action.option_strings and f"| `{action.metavar}` (positional) |" not in DOC:
                missing.append(f"appliance {name} {action.metavar}")
    assert not missing, f"add to docs/operations.md section 7: {missing}"
