"""GPU end-to-end check of the engine with the Triton kernels: tiny dense and MoE Qwen3.5
checkpoints run on CUDA (fp32 and bf16) against the CPU reference path; greedy tokens with MTP
(k = 1..3, both modes) equal to greedy without MTP on the GPU. Prints one line per check; exit 1
on a failure.

  python ops/gpu/check_model.py
"""

from __future__ import annotations

import sys
import tempfile

import torch

from appliance.offline.llm import LLM
from appliance.sampling_params import SamplingParams
from appliance.testing.tiny import build_qwen3_5

OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_slots=4096, max_model_len=512)
LENS = [3, 11, 20, 37, 64, 70, 90, 130]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENS]


def greedy(llm: LLM, seqs, n=48):
    return [
        o.token_ids
        for o in llm.generate(seqs, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    ]


def main() -> int:
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, moe, types in (
            ("dense", False, ["linear", "full", "linear", "full"]),
            ("moe", True, ["linear", "linear", "full", "linear"]),
        ):
            ckpt = build_qwen3_5(f"{tmp}/{name}", moe=moe, layer_types=types, seed=0)
            cpu = LLM(str(ckpt), device="cpu", **OPTS)
            seqs = prompts(cpu.runner.text_config.vocab_size)
            ref = greedy(cpu, seqs)
            gpu = LLM(str(ckpt), device="cuda", dtype="float32", **OPTS)
            got = greedy(gpu, seqs)
            same = sum(a == b for a, b in zip(got, ref))
            print(f"{name}: fp32 cuda greedy == cpu greedy for {same}/{len(seqs)} prompts")
            failures += same < len(seqs) - 1  # one near-tie flip allowed
            bf16 = LLM(str(ckpt), device="cuda", dtype="bfloat16", **OPTS)
            base = greedy(bf16, seqs)
            agree = sum(x == y for a, b in zip(base, ref) for x, y in zip(a[:8], b[:8]))
            print(f"{name}: bf16 first-8-token agreement with fp32 cpu {agree}/{8 * len(seqs)}")
            for mode in ("eagle", "vanilla"):
                for k in (1, 2, 3):
                    llm = LLM(
                        str(ckpt),
                        device="cuda",
                        dtype="bfloat16",
                        mtp_step=k,
                        mtp_mode=mode,
                        **OPTS,
                    )
                    ok = greedy(llm, seqs) == base
                    stats = llm.scheduler.stats()
                    print(
                        f"{name}: bf16 cuda MTP {mode} k={k} lossless={ok} "
                        f"accept_len={stats.mtp_mean_accept_len:.2f}"
                    )
                    failures += not ok
    print("FAILED" if failures else "ALL OK", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
