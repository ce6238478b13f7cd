"""ops/bench/bench_kv_fp8.py at a tiny size on CPU (the torch reference): one table row per case
with both timings, their ratio, and the fp8 output within e4m3 error of the full-precision one."""

from __future__ import annotations

import re

import torch

from ops.bench.bench_kv_fp8 import Case, cache_copies, main


def test_cpu_smoke_writes_the_table(tmp_path):
    out = tmp_path / "kv.md"
    args = ["--device", "cpu", "--contexts", "16,40", "--batches", "2", "--heads", "4,2,16"]
    assert main([*args, "--reps", "10", "--out", str(out)]) == 0
    rows = [r for r in out.read_text().splitlines() if r.startswith("| torch |")]
    assert len(rows) == 4  # each layout (scattered, contiguous slots) at each context
    cases = [(layout, c) for layout in ("scattered", "contiguous") for c in (16, 40)]
    for row, (layout, context) in zip(rows, cases, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == [layout, "2", str(context)]
        assert re.fullmatch(r"\*\*\d+\.\d\dx\*\*", cells[8])
        assert 0 < float(cells[9]) < 0.08  # e4m3: ~3% relative error per element


def test_graph_timing_cycles_over_caches_larger_than_l2():
    """The GPU timing reads each cache copy once per cycle from HBM: copies until their fp8 bytes
    pass L2_BYTES (256 MiB), at most 16; one where a single cache is already larger."""
    cuda, heads = torch.device("cuda"), (24, 4, 256)  # a device name: no GPU needed
    assert cache_copies(Case(1, 8192, heads), cuda) == 16  # 16.8 MB of e4m3 each
    assert cache_copies(Case(1, 32768, heads), cuda) == 4  # 67 MB each
    assert cache_copies(Case(16, 8192, heads), cuda) == 1  # 268 MB
    assert cache_copies(Case(1, 512, heads), cuda) == 16  # capped
    assert cache_copies(Case(1, 8192, heads), torch.device("cpu")) == 1
