"""The visual role's startup: when it runs (the launcher's and the API server's one rule), its
reservation as the VisualInfo the launcher reads, and that the launcher and the torch-free API
server can import the role without torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import msgspec

from appliance.config import VisualConfig
from appliance.encoder.startup import plan_reservation, wants_visual_server
from appliance.messages import ProcessReady, VisualInfo, decoder, encode
from visual import reservation
from visual.encoder import VisionEncoder

ROOT = Path(__file__).resolve().parents[3]


def test_the_role_runs_for_vision_checkpoints_with_image_input_on(qwen3_vl_dir, tmp_path):
    assert wants_visual_server(qwen3_vl_dir, VisualConfig())
    assert not wants_visual_server(qwen3_vl_dir, VisualConfig(vision=False))
    raw = json.loads((Path(qwen3_vl_dir) / "config.json").read_text())
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({**raw, "language_model_only": True}))
    assert not wants_visual_server(text_only, VisualConfig())
    assert not wants_visual_server(tmp_path / "empty", VisualConfig())  # no config.json at all


def test_reservation_becomes_the_launchers_visual_info(qwen3_vl_dir):
    encoder = VisionEncoder.from_pretrained(qwen3_vl_dir)
    config = VisualConfig(visual_max_batch_size=3, max_image_pixels=1_000_000)
    info = plan_reservation(encoder, config)
    plan = reservation.plan_reservation(encoder, 1_000_000, 3)
    assert isinstance(info, VisualInfo)
    assert msgspec.structs.asdict(info) == dataclasses.asdict(plan)
    assert info.batch_size == 3 and info.peak_bytes > 0 and info.device == "cpu"
    fixed = plan_reservation(encoder, dataclasses.replace(config, visual_reserved_mem_gb=0.5))
    assert (fixed.peak_bytes, fixed.reserved_bytes) == (-1, 2**29)
    ready = ProcessReady("visual", 0, 1234, visual=info)
    assert decoder(ProcessReady).decode(encode(ready)).visual == info


def test_launcher_and_api_server_import_the_role_without_torch():
    code = (
        "import sys\n"
        "import appliance.encoder.startup, appliance.encoder.process\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
