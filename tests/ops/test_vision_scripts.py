"""The GPU vision scripts (ops/gpu/check_vision.py, ops/bench/bench_vit.py) in their CPU --smoke
mode: as subprocesses (exit status, RESULT / PASS lines, JSON report, our tower against HF's), in
process with a failure injected (the failed batch / size says so and the run goes on), plus the
burst's image shapes being the worst admissible ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int = 120) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.fixture
def in_process(monkeypatch):
    """Run a script's main() here; its torch.set_num_threads(1) is undone afterwards."""
    monkeypatch.syspath_prepend(str(ROOT))
    threads = torch.get_num_threads()

    def run(main, *argv: str) -> int:
        monkeypatch.setattr(sys, "argv", ["script", *argv])
        return main()

    yield run
    torch.set_num_threads(threads)


def test_check_vision_smoke(tmp_path):
    out = tmp_path / "check.json"
    lines = _run(["ops/gpu/check_vision.py", "--smoke", "--json", str(out)])
    text = "\n".join(lines)
    for needle in ("RESULT reservation:", "RESULT pools (real ModelRunner", "RESULT burst:"):
        assert needle in text, text
    assert "burst batch 3/3" in text and "FAIL" not in text, text
    assert any(line.startswith("PASS:") for line in lines), text
    report = json.loads(out.read_text())
    assert "math" not in report["attention_backend"]  # 4-D SDPA inputs: a fused kernel
    reservation = report["reservation"]
    assert reservation["worst_case_grid"] == [1, 16, 16] and reservation["batch_size"] == 3
    assert 0 < reservation["peak_bytes"] <= reservation["reserved_bytes"]
    pools = report["pools"]
    assert "runner_error" not in report  # the real runner sized the pools, no fallback
    assert pools["kv_slots"] == pools["formula_slots"] > 0
    assert pools["free_after_pools"] >= reservation["reserved_bytes"]
    assert len(report["burst"]) == 3
    assert max(r["peak_bytes"] for r in report["burst"]) <= reservation["reserved_bytes"]
    assert not report["failures"]


def test_bench_vit_smoke(tmp_path):
    out = tmp_path / "bench.json"
    lines = _run(["ops/bench/bench_vit.py", "--smoke", "--json", str(out)])
    text = "\n".join(lines)
    assert "### Preprocessing, ms per image" in text and "### Vision tower, images/s" in text
    assert sum(line.startswith("RESULT preprocess") for line in lines) == 4, text
    assert sum(line.startswith("RESULT vit") for line in lines) == 4, text
    assert "FAIL" not in text, text
    assert any("SDPA backend" in line for line in lines), text
    report = json.loads(out.read_text())
    assert "math" not in report["attention_backend"]
    for row in report["preprocess"]:
        assert row["ours_ms"] > 0 and row["hf_pil_exact"] is True  # bit-exact with HF's PIL path
    assert len(report["vit"]) == 4
    for row in report["vit"]:
        assert row["ours_img_s"] > 0 and row["hf_img_s"] > 0 and row["ratio"] > 0
        assert row["rel_diff"] < 1e-4  # same weights, fp32
        assert row["ours_error"] is None and row["hf_error"] is None


def test_check_vision_goes_on_after_a_failed_batch(in_process, monkeypatch, capsys):
    from ops.gpu import check_vision
    from visual import pipeline

    real, calls = pipeline.encode_jobs, []

    def encode_jobs(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "encode_jobs", encode_jobs)
    code = in_process(check_vision.main, "--smoke", "--pool", "formula")
    text = capsys.readouterr().out
    assert code == 1 and len(calls) == 3, text
    assert "burst batch 2/3: 3 x strip, 672 patches: FAIL OOM" in text, text
    assert "burst batch 3/3: 3 mixed, 352 patches: peak" in text, text
    assert "RESULT pools (runner formula reproduced" in text, text
    assert "RESULT burst: 6 max-size images encoded in 2/3 batches" in text, text
    assert text.splitlines()[-1].startswith("total") and "\nFAIL: batch 2 (3 x strip): OOM" in text


def test_bench_vit_goes_on_after_a_failed_size(in_process, monkeypatch, capsys):
    from ops.bench import bench_vit
    from visual.qwen_vit import QwenVisionTransformer

    real = QwenVisionTransformer.forward

    def forward(self, pixel_values, grids):
        if pixel_values.shape[0] == 2 * 60:  # the 200x113 batch: 2 images of 60 patches
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(self, pixel_values, grids)

    monkeypatch.setattr(QwenVisionTransformer, "forward", forward)
    assert in_process(bench_vit.main, "--smoke") == 0
    lines = capsys.readouterr().out.splitlines()
    vit = [line for line in lines if line.startswith("RESULT vit")]
    assert len(vit) == 4, lines
    assert (
        "ours FAIL OOM: CUDA out of memory. Tried to allocate 1.00 GiB, hf " in vit[2]
        and "ratio n/a, rel diff n/a" in vit[2]
    ), vit
    assert all("FAIL" not in line and "rel diff" in line for line in vit[:2] + vit[3:]), vit


def test_burst_shapes_are_the_worst_admissible():
    sys.path.insert(0, str(ROOT))
    from ops.gpu.check_vision import square_max, steepest_strip
    from visual.preprocess import MAX_ASPECT_RATIO, PreprocessConfig, image_grid

    config = PreprocessConfig()  # real checkpoints: up to 16777216 resized pixels
    assert square_max(config, 40_000_000) == (4096, 4096)
    width, height = steepest_strip(config, 40_000_000)
    assert width / height >= 0.99 * MAX_ASPECT_RATIO and width <= 65500
    t, h, w = image_grid(height, width, config)
    assert 0.99 * 65536 <= t * h * w <= 65536  # as many patches as the square worst case
