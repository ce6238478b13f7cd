"""Is MTP lossless on the GPU, and in which dtype? Tiny dense Qwen3.5, 8 prompts, 48 greedy tokens:
decode graphs vs eager, then MTP k = 1, 2 against eager decoding, in fp32 and bf16; prints the
first position where each MTP output departs from the eager one (-1: identical).

  python ops/gpu/mtp_diag.py
"""

from __future__ import annotations

import tempfile

import torch

from appliance.offline.llm import LLM
from appliance.sampling_params import SamplingParams
from appliance.testing.tiny import build_qwen3_5

OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_slots=4096, max_model_len=512)
LENS = [3, 11, 20, 37, 64, 70, 90, 130]


def greedy(llm: LLM, seqs: list[list[int]], n: int = 48) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(seqs, params)]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        types = ["linear", "full", "linear", "full"]
        ckpt = str(build_qwen3_5(f"{tmp}/dense", moe=False, layer_types=types, seed=0))
        gen = torch.Generator().manual_seed(5)
        seqs = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in LENS]
        for dtype in ("float32", "bfloat16"):
            run = dict(device="cuda", dtype=dtype, **OPTS)
            eager = greedy(LLM(ckpt, disable_cuda_graph=True, **run), seqs)
            graph = greedy(LLM(ckpt, **run), seqs)
            same = sum(a == b for a, b in zip(graph, eager))
            print(f"{dtype}: graphs == eager for {same}/{len(seqs)} prompts")
            for k in (1, 2):
                mtp = greedy(LLM(ckpt, mtp_step=k, **run), seqs)
                same = sum(a == b for a, b in zip(mtp, eager))
                first = [first_difference(a, b) for a, b in zip(mtp, eager)]
                print(f"{dtype}: MTP k={k} == eager for {same}/{len(seqs)}; first diff at {first}")


if __name__ == "__main__":
    main()
