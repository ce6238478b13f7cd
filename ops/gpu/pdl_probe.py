"""Which PDL-launched kernel + cuBLAS sequences capture into a CUDA graph (issue 14, run AT:
a float32 model's decode graph failed in the cuBLAS SGEMM after a PDL gated norm). Each case
runs in its own process (a failed capture poisons the context): an RMSNorm launched with PDL,
then x @ W^T by cuBLAS, captured and replayed; float32 / bfloat16, 1 or 4 rows, TF32 on / off.
  python ops/gpu/pdl_probe.py
"""

from __future__ import annotations

import itertools
import subprocess
import sys


def case(dtype: str, rows: int, tf32: bool) -> None:
    import torch

    import appliance_kernels.triton_utils as tu

    tu.USE_PDL = True
    from appliance_kernels.norm import rms_norm

    torch.backends.cuda.matmul.allow_tf32 = tf32
    dt = getattr(torch, dtype)
    x = torch.randn(rows, 1024, device="cuda", dtype=dt)
    w = torch.ones(1024, device="cuda", dtype=dt)
    big = torch.randn(4096, 1024, device="cuda", dtype=dt) * 0.02

    def step():
        y, _ = rms_norm(x, w, 1e-6, False)
        return torch.nn.functional.linear(y, big)

    expected = step()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    print("max diff", (out.float() - expected.float()).abs().max().item())


def main() -> None:
    if len(sys.argv) == 4:
        case(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
        return
    for dtype, rows, tf32 in itertools.product(("float32", "bfloat16"), (1, 4), (False, True)):
        if dtype == "bfloat16" and tf32:
            continue
        r = subprocess.run(
            [sys.executable, __file__, dtype, str(rows), "1" if tf32 else "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
        print(
            f"{dtype:9s} rows={rows} tf32={tf32!s:5s}:",
            "ok" if r.returncode == 0 else "FAIL",
            tail[0][:160],
        )


if __name__ == "__main__":
    main()
