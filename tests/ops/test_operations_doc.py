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
