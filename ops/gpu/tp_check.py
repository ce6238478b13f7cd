"""TP correctness on several GPUs (NCCL) or CPUs (gloo): a tiny Qwen3.5 checkpoint (dense and MoE)
run at TP=N gives TP=1's logits within fp32 reduction noise and the same greedy tokens.

  torchrun --nproc-per-node 2 ops/gpu/tp_check.py [--backend nccl|gloo] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "models"))
from tp_worker import greedy_run  # noqa: E402

from appliance.config import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from appliance.engine.runner import ModelRunner  # noqa: E402
from appliance.models.layers.parallel import set_tp  # noqa: E402
from appliance.testing.tiny import build_qwen3_5  # noqa: E402


def config(ckpt: str, device: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_dir=ckpt, max_model_len=512, dtype="float32"),
        scheduler=SchedulerConfig(max_num_seqs=4, num_kv_slots=2048),
        parallel=ParallelConfig(device=device),
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--out", default="/tmp/tp-check")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if args.backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failures = 0
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1990, (n,), generator=gen).tolist() for n in (5, 33, 80)]
    for name, moe in (("dense", False), ("moe", True)):
        ckpt = out / f"tiny_{name}"
        if rank == 0:
            build_qwen3_5(ckpt, moe=moe, seed=4)
        dist.barrier()
        tp_logits, tp_tokens = greedy_run(
            ModelRunner(config(str(ckpt), device), rank, world), prompts, 16
        )
        dist.barrier()
        if rank == 0:
            set_tp(0, 1)
            ref_logits, ref_tokens = greedy_run(ModelRunner(config(str(ckpt), device)), prompts, 16)
            err = (tp_logits - ref_logits).abs().max().item()
            same = tp_tokens == ref_tokens
            line = (
                f"{name}: TP{world} ({args.backend}) vs TP1 max|dlogit| {err:.2e}, "
                f"greedy equal {same}"
            )
            print(line, flush=True)
            (out / "tp_check.txt").open("a").write(line + "\n")
            failures += (err > 1e-3) or not same
        dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
