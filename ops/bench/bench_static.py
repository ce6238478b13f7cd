"""Static step benchmark: prefill and decode step times of the model runner with MTP off and on
(k = 1, 2, 3) at several batch sizes, CUDA graphs on and off, on `--load-format dummy` weights from
a real config.

Prints, per batch size: plain decode step, verify step (k+1 rows per request), draft pass (extend +
k-step chain), with MTP's fused device step on and off (host acceptance), the ratios verify/plain
and draft/plain and the ITL implied at the published accept lengths, plus the HBM floor of a plain
decode step measured in the same run: (the weight bytes it reads — the input embedding table only
as the batch's rows — + KV bytes read + GDN state bytes read and written) / the device-to-device
copy bandwidth measured here, so the plain step is read against physics.
  python ops/bench/bench_static.py --config ops/bench/configs/qwen3_5_27b.json --batch 1 16 64
`--kv-cache-dtype fp8_e4m3` runs the same steps over fp8 KV pools (the floor counts their bytes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch

from appliance.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from appliance.engine.mtp_graphs import MtpGraphs
from appliance.engine.pools import kv_bytes_per_slot, state_bytes_per_slot
from appliance.engine.runner import ModelRunner
from appliance.messages import NewRequest, SamplingOptions, ScheduledChunk, StepPlan
from appliance.models import qwen3_5
from appliance.models.layers import gdn as gdn_layer
from appliance.models.layers.embedding import LMHead, VocabEmbedding
from appliance.models.layers.moe import SparseMoE
from appliance_kernels import (
    fp8_gemv,
    gemv_norm,
    gemv_rows,
    gemv_swiglu,
    moe_gemv,
    triton_utils,
)
from appliance_kernels import (
    gdn as gdn_kernels,
)

GREEDY = SamplingOptions(temperature=0.0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Bench:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step = 0
        self.next_kv = 0

    def kv(self, n: int) -> list[int]:
        out = list(range(self.next_kv, self.next_kv + n))
        self.next_kv += n
        return out

    def run(self, plan_chunks, new=(), released=()) -> float:
        plan = StepPlan(self.step, list(new), plan_chunks, list(released))
        self.step += 1
        sync()
        start = time.perf_counter()
        self.runner.execute(plan)
        sync()
        return time.perf_counter() - start

    def prefill(self, batch: int, prompt_len: int, num_draft: int) -> tuple[float, list[int]]:
        vocab = self.runner.text_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        new, chunks = [], []
        for slot in range(batch):
            ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            new.append(NewRequest(slot, ids, GREEDY, num_draft=num_draft))
            chunks.append(ScheduledChunk(slot, 0, prompt_len, self.kv(prompt_len), True))
        return self.run(chunks, new), [prompt_len] * batch  # each now knows prompt_len + 1 tokens

    def decode(self, starts: list[int], num_draft: int) -> float:
        chunks = [
            ScheduledChunk(slot, start, num_draft + 1, self.kv(num_draft + 1), True, num_draft)
            for slot, start in enumerate(starts)
        ]
        elapsed = self.run(chunks)
        for slot in range(len(starts)):  # advance by what the worker actually committed
            starts[slot] = self.runner.num_tokens[slot] - 1
        return elapsed

    def decode_pipelined(self, starts: list[int], steps: int) -> float:
        """Mean time of `steps` plain decode steps submitted as the worker loop does: step N+1 is
        launched before step N's result is collected (positions are known: one token a step)."""
        sync()
        start = time.perf_counter()
        for i in range(steps):
            chunks = [
                ScheduledChunk(slot, pos + i, 1, self.kv(1), True)
                for slot, pos in enumerate(starts)
            ]
            self.runner.submit(StepPlan(self.step, [], chunks, []))
            self.step += 1
            while self.runner.num_pending > 1:
                self.runner.collect()
        while self.runner.num_pending:
            self.runner.collect()
        sync()
        for slot in range(len(starts)):
            starts[slot] += steps
        return (time.perf_counter() - start) / steps


def timed_draft(runner: ModelRunner) -> list[float]:
    """Wraps the drafter so each step's draft pass is timed separately."""
    times: list[float] = []
    original = runner.drafter.run

    def run(hidden, rows):
        sync()
        start = time.perf_counter()
        original(hidden, rows)
        sync()
        times.append(time.perf_counter() - start)

    runner.drafter.run = run
    return times


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second of a large device-to-device copy (read + write), median of 10."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / sorted(times[3:])[len(times[3:]) // 2]


def active_weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads: everything but the routed experts and
    the input embedding table, plus the experts the batch is expected to touch (E * (1 - (1 -
    k/E)^batch) per MoE layer, uniform routing as with dummy weights) and the batch's embedding
    rows. A table tied to the LM head is read whole (as the head)."""
    total = float(weight_bytes(model))
    heads = {m.weight.data_ptr() for m in model.modules() if isinstance(m, LMHead)}
    for m in model.modules():
        if isinstance(m, VocabEmbedding) and m.weight.data_ptr() not in heads:
            rows, row_bytes = m.weight.shape[0], m.weight.shape[1] * m.weight.element_size()
            total -= (rows - min(batch, rows)) * row_bytes
        if isinstance(m, SparseMoE):
            experts = sum(p.numel() * p.element_size() for p in (m.w_gate_up, m.w_down))
            touched = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)
            total -= experts * (1 - touched / m.num_experts)
    return total


def step_bytes(runner: ModelRunner, batch: int, context: int) -> float:
    """Bytes a plain decode step must move: the weights it reads once (only the routed experts of a
    MoE model), each request's KV (its context) once, each request's GDN state read and written."""
    kv = sum(kv_bytes_per_slot(m, runner.kv_dtype) for m in [runner.model])
    state = state_bytes_per_slot(runner.model, runner.dtype, 0)
    return active_weight_bytes(runner.model, batch) + batch * (context * kv + 2 * state)


def fused_step(runner: ModelRunner, k: int, batch: int, graphs: bool) -> MtpGraphs:
    """The fused MTP step for k drafts (the runner's pools hold up to its mtp_step), captured
    for this batch size when graphs are on."""
    fused = MtpGraphs(
        runner.model,
        runner.draft_modules,
        runner.pools,
        runner.requests,
        runner.pools.sizes,
        batch,
        runner.text_config.hidden_size,
        runner.dtype,
        runner.device,
        k=k,
        batch_sizes=[batch],
        draft_vocab=runner.drafter.draft_vocab,
        vocab_size=runner.text_config.vocab_size,  # the grammar-mask pass, as served
    )
    if graphs:
        fused.capture()
    fused.timing = True
    return fused


def measure(
    runner: ModelRunner,
    draft_times: list[float],
    batch: int,
    prompt_len: int,
    k: int,
    steps: int,
    fused: MtpGraphs | None = None,
) -> dict:
    bench = Bench(runner)
    if runner.drafter is not None:
        runner.drafter.k = max(k, 1)
    runner.mtp_graphs = fused
    prefill_s, starts = bench.prefill(batch, prompt_len, num_draft=k)
    draft_times.clear()
    samples = []
    for _ in range(steps):
        samples.append(bench.decode(starts, k))
        if fused is not None:  # the draft program's device time, from events around it
            draft_times.append(fused.last_times_ms()[1] / 1e3)
    overlap_ms = float("nan")
    if k == 0:  # steps in flight need device-resident sampling (plain decode)
        overlap_ms = bench.decode_pipelined(starts, steps) * 1e3
    samples = sorted(samples)[: max(1, steps - 2)]  # drop the slowest (allocator warm-up)
    draft = sorted(draft_times)[: max(1, len(draft_times) - 2)] if k else [0.0]
    released = list(range(batch))
    bench.run([], released=released)
    step_ms = sum(samples) / len(samples) * 1e3
    draft_ms = sum(draft) / len(draft) * 1e3
    # step = verify forward + sampling + acceptance (+ the draft pass when k > 0)
    return {
        "batch": batch,
        "k": k,
        "prefill_ms": prefill_s * 1e3,
        "step_ms": step_ms,
        "verify_ms": step_ms - draft_ms,
        "draft_ms": draft_ms,
        "overlap_ms": overlap_ms,
    }


def build_runner(
    config: str,
    max_batch: int,
    prompt_len: int,
    steps: int,
    mtp: list[int],
    graphs: bool,
    device: str = "auto",
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    max_model_len: int = 4096,
    mtp_fused: bool = True,
) -> ModelRunner:
    """A runner on dummy weights from a real config.json, with pools sized for the benchmark;
    `quantization`: none, fp8 (online, per channel) or block (the official -FP8 repos' layout);
    `mtp_fused`: False leaves the runner without its own fused MTP step (a caller that builds
    them per case)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = json.loads(Path(config).read_text())
        if quantization == "block":
            cfg["quantization_config"] = BLOCK_FP8
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        need = max_batch * (prompt_len + (2 * steps + 2) * 4)
        engine = EngineConfig(
            model=ModelConfig(
                model_dir=tmp,
                load_format="dummy",
                max_model_len=max_model_len,
                quantization="fp8" if quantization == "fp8" else "",
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_batch,
                mtp_step=max(mtp),
                max_num_batched_tokens=max_batch * prompt_len,
                num_kv_slots=need * 2,
            ),
            parallel=ParallelConfig(device=device),
            cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
            graphs=GraphConfig(
                disable_cuda_graph=not graphs, disable_mtp_fused_graph=not mtp_fused
            ),
        )
        return ModelRunner(engine)


# the quantization_config of Qwen's -FP8 repos: 128 x 128 weight blocks, dynamic activations
BLOCK_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": [
        "lm_head",
        "re:.*\\.mlp\\.gate$",
        "re:.*linear_attn\\.in_proj_[ab]$",
    ],
}

# Qwen3.5-27B's published mean accept lengths at k = 1, 2, 3 (docs/benchmarks.md): the ITL a
# measured MTP step implies on real weights (dummy weights never accept a draft)
PUBLISHED_ACCEPT = {1: 1.90, 2: 2.68, 3: 3.28}


def parse_tile(text: str) -> dict | None:
    """--fp8-gemv-tile's BLOCK_N,BLOCK_K,WARPS,STAGES as fp8_gemv.GEMV_TILE (default: None)."""
    if text == "default":
        return None
    n, k, warps, stages = (int(v) for v in text.split(","))
    return {"block_n": n, "block_k": k, "num_warps": warps, "stages": stages}


def parse_gdn_tile(text: str) -> dict | None:
    """--gdn-tile's BV,WARPS as gdn.RECURRENT_TILE (default: None)."""
    if text == "default":
        return None
    bv, warps = (int(v) for v in text.split(","))
    return {"bv": bv, "warps": warps}


def kernel_switches() -> tuple:
    """The module switches that the captured decode graphs bake in (captured again on a change)."""
    return (
        triton_utils.USE_PDL,
        triton_utils.GEMV_PDL,
        fp8_gemv.USE_GEMV,
        gemv_rows.USE_ROWS,
        gemv_swiglu.USE_SWIGLU,
        moe_gemv.GEMV_MAX_ROWS,
        fp8_gemv.GEMV_TILE,
        tuple(fp8_gemv.WIDE_TILE.values()),
        gdn_layer.FUSE_CONV,
        qwen3_5.SPLIT_NORMS,
        gemv_norm.RELEASE_PRODUCERS,
        gdn_kernels.PRELOAD_STATE,
        fp8_gemv.CONV_RELEASE,
        gdn_layer.SPLIT_GATED_NORM,
        gdn_kernels.RECURRENT_TILE,
    )


def switch(
    ap: argparse.ArgumentParser,
    flag: str,
    default: str,
    help: str,
    choices: tuple[str, ...] = ("on", "off"),
) -> None:
    """A kernel switch: each value given is measured in turn, the graphs captured again."""
    ap.add_argument(flag, nargs="+", default=[default], choices=list(choices), help=help)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument(
        "--fused",
        nargs="+",
        default=["on", "off"],
        choices=["on", "off"],
        help="MTP steps: the fused device step (on) or host acceptance (off)",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        nargs="+",
        default=[0],
        help="MTP drafts from the first N ids (0: all); each value is measured",
    )
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "fp8", "block"],
        help="weights: bf16, online fp8 per channel, or block fp8 as in Qwen's -FP8 repos",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    switch(
        ap,
        "--gemv",
        "on",
        "one-row linears: the GEMV of appliance_kernels/fp8_gemv.py (on) or the GEMM routes "
        "(off); the decode graphs are captured again for each",
    )
    switch(
        ap,
        "--rows",
        "on",
        "2-8 row linears of 16-bit weights (an MTP verify, a small batch): the tensor-core "
        "rows GEMV of appliance_kernels/gemv_rows.py (on) or cuBLAS / the FMA rows GEMV (off); "
        "the decode graphs are captured again for each",
    )
    switch(
        ap,
        "--swiglu",
        "off",
        "one-row MLPs: gate_up and SiLU-and-mul as one kernel "
        "(appliance_kernels/gemv_swiglu.py, on) or the GEMV then the activation (off, the default "
        "as served); the decode graphs are captured again for each",
    )
    switch(
        ap,
        "--pdl",
        "on",
        "programmatic dependent launch of the Triton kernels: off (as served with "
        "APPLIANCE_ENABLE_PDL=0); on (the default: the GEMVs wait but do not let the next kernel "
        "launch early); small (not the GEMVs); full (the GEMVs too let the next kernel launch "
        "early); the decode graphs are captured again for each",
        choices=("off", "on", "small", "full"),
    )
    ap.add_argument(
        "--moe-pairs",
        type=int,
        nargs="+",
        default=[moe_gemv.GEMV_MAX_ROWS],
        help="MoE models: the most (token, slot) pairs that the per-pair decode kernels of "
        "appliance_kernels/moe_gemv.py take (more: the grouped GEMMs); the decode graphs are "
        "captured again for each",
    )
    switch(
        ap,
        "--gemv-conv",
        "auto",
        "one row: the GDN conv inside the in_proj GEMV's store (on), its own kernel (off) or "
        "as served (auto: where the in_proj's quantisation measured faster, see "
        "quant_methods.Unquantized.GEMV_CONV); the decode graphs are captured again for each",
        choices=("auto", "on", "off"),
    )
    switch(
        ap,
        "--split-norms",
        "release",
        "one row: each RMSNorm between two projections split across their GEMVs (on, "
        "appliance_kernels/gemv_norm.py; release, as served: the producing GEMV also lets the "
        "next launch early, gemv_norm.RELEASE_PRODUCERS) or its own kernel (off); graphs "
        "captured again for each",
        choices=("on", "off", "release"),
    )
    switch(
        ap,
        "--gdn-preload",
        "on",
        "under PDL the GDN recurrence reads its state before waiting for the in_proj, which "
        "releases it early when the conv is inside it (on, as served: appliance_kernels/gdn.py "
        "PRELOAD_STATE, fp8_gemv.CONV_RELEASE) or waits first (off); graphs captured again",
    )
    switch(
        ap,
        "--gdn-split-norm",
        "off",
        "one row: the GDN gated output norm split between the recurrence and the out_proj GEMV "
        "(on: appliance_kernels/head_norm.py, gdn.SPLIT_GATED_NORM) or its own kernel (off); "
        "graphs captured again",
    )
    ap.add_argument(
        "--gdn-tile",
        nargs="+",
        default=["default"],
        help="the GDN decode recurrence's value columns a program and warps, BV,WARPS, or "
        "default (gdn.RECURRENT_TILE); the decode graphs are captured again for each",
    )
    ap.add_argument(
        "--fp8-gemv-tile",
        nargs="+",
        default=["default"],
        help="the one-row fp8 GEMV's tile (per channel and block), BLOCK_N,BLOCK_K,WARPS,STAGES, "
        "or default; the decode graphs are captured again for each",
    )
    ap.add_argument(
        "--fp8-gemv-wide-tile",
        nargs="+",
        default=["default"],
        help="the per-channel one-row fp8 GEMV's tile at the widest N (gate_up: "
        "fp8_gemv.WIDE_TILE), BLOCK_N,BLOCK_K,WARPS,STAGES or default; graphs captured again",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    default_wide = dict(fp8_gemv.WIDE_TILE)
    runner = build_runner(
        args.config,
        max(args.batch),
        args.prompt_len,
        args.steps,
        args.mtp,
        "on" in args.graphs,
        args.device,
        args.quantization,
        args.kv_cache_dtype,
        mtp_fused=False,  # built per (k, batch) below instead
    )
    bandwidth = copy_bandwidth()
    captured = runner.graphs
    rows = []
    draft_times = timed_draft(runner) if runner.drafter is not None else []
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(
        f"{'graphs':>6} {'fused':>5} {'vocab':>6} {'batch':>5} {'k':>2} {'prefill ms':>10} "
        f"{'verify ms':>9} "
        f"{'draft ms':>9} {'verify/plain':>12} {'draft/plain':>11} {'floor ms':>8} "
        f"{'plain/floor':>11} {'overlap ms':>10} {'overlap/floor':>13} {'ITL@pub ms':>10}"
    )
    switches = itertools.product(
        args.pdl,
        args.gemv,
        args.rows,
        args.swiglu,
        args.moe_pairs,
        args.fp8_gemv_tile,
        args.fp8_gemv_wide_tile,
        args.gemv_conv,
        args.split_norms,
        args.gdn_preload,
        args.gdn_split_norm,
        args.gdn_tile,
        args.graphs,
    )
    for (
        pdl,
        gemv,
        rows_on,
        swiglu,
        pairs,
        tile,
        wide,
        conv,
        norms,
        preload,
        split_norm,
        gdn_tile,
        graphs,
    ) in switches:
        before = kernel_switches()
        triton_utils.USE_PDL = pdl != "off"
        triton_utils.GEMV_PDL = {"small": "off", "full": "full"}.get(pdl, "wait")
        fp8_gemv.USE_GEMV = gemv == "on"
        gemv_rows.USE_ROWS = rows_on == "on"
        gemv_swiglu.USE_SWIGLU = swiglu == "on"
        moe_gemv.GEMV_MAX_ROWS = pairs
        fp8_gemv.GEMV_TILE = parse_tile(tile)
        fp8_gemv.WIDE_TILE = parse_tile(wide) or default_wide
        gdn_layer.FUSE_CONV = {"auto": None, "on": True, "off": False}[conv]
        qwen3_5.SPLIT_NORMS = norms != "off"
        gemv_norm.RELEASE_PRODUCERS = norms == "release"
        gdn_kernels.PRELOAD_STATE = fp8_gemv.CONV_RELEASE = preload == "on"
        gdn_layer.SPLIT_GATED_NORM = split_norm == "on"
        gdn_kernels.RECURRENT_TILE = parse_gdn_tile(gdn_tile)
        if len(args.pdl) > 1 and graphs == args.graphs[0] and gemv == args.gemv[0]:
            print(f"PDL {pdl}")
        if kernel_switches() != before:
            runner.graphs = captured = None
            torch.cuda.empty_cache()
            if "on" in args.graphs:
                captured = runner._decode_graphs()
                print("decode graphs captured again")
        if len(args.gemv) > 1 and graphs == args.graphs[0]:
            print(f"one-row GEMV {gemv}")
        if len(args.rows) > 1 and graphs == args.graphs[0]:
            print(f"rows GEMV {rows_on}")
        if len(args.swiglu) > 1 and graphs == args.graphs[0]:
            print(f"SwiGLU GEMV {swiglu}")
        if len(args.moe_pairs) > 1 and graphs == args.graphs[0]:
            print(f"per-pair MoE up to {pairs} pairs")
        if len(args.fp8_gemv_tile) > 1 and graphs == args.graphs[0]:
            print(f"fp8 GEMV tile {tile}")
        if len(args.fp8_gemv_wide_tile) > 1 and graphs == args.graphs[0]:
            print(f"fp8 GEMV wide tile {wide}")
        if len(args.gemv_conv) > 1 and graphs == args.graphs[0]:
            print(f"GDN conv in the GEMV {conv}")
        if len(args.split_norms) > 1 and graphs == args.graphs[0]:
            print(f"norms split across the GEMVs {norms}")
        if len(args.gdn_preload) > 1 and graphs == args.graphs[0]:
            print(f"GDN state read before the wait {preload}")
        if len(args.gdn_tile) > 1 and graphs == args.graphs[0]:
            print(f"GDN recurrence tile {gdn_tile}")
        if len(args.gdn_split_norm) > 1 and graphs == args.graphs[0]:
            print(f"GDN gated norm split across recurrence and out_proj {split_norm}")
        runner.graphs = captured if graphs == "on" else None
        for batch in args.batch:
            plain = None
            floor_ms = step_bytes(runner, batch, args.prompt_len + args.steps) / bandwidth * 1e3
            for k in args.mtp:
                variants = (
                    [(f, v) for f in args.fused for v in args.draft_vocab] if k else [("-", 0)]
                )
                for fused, vocab in variants:
                    if runner.drafter is not None:
                        runner.drafter.draft_vocab = vocab
                    step = fused_step(runner, k, batch, graphs == "on") if fused == "on" else None
                    r = measure(runner, draft_times, batch, args.prompt_len, k, args.steps, step)
                    del step
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    plain = r["step_ms"] if k == 0 else plain
                    r.update(graphs=graphs, fused=fused, draft_vocab=vocab, floor_ms=floor_ms)
                    r["gemv"] = gemv
                    r["pdl"] = pdl
                    r["rows"] = rows_on
                    r["swiglu"] = swiglu
                    r["moe_pairs"] = pairs
                    r["fp8_gemv_tile"] = tile
                    r["fp8_gemv_wide_tile"] = wide
                    r["gemv_conv"] = conv
                    r["split_norms"] = norms
                    r["gdn_preload"] = preload
                    r["gdn_split_norm"] = split_norm
                    r["gdn_tile"] = gdn_tile
                    r["verify_over_plain"] = r["verify_ms"] / plain if plain else float("nan")
                    r["draft_over_plain"] = r["draft_ms"] / plain if plain else float("nan")
                    r["plain_over_floor"] = plain / floor_ms if plain else float("nan")
                    r["itl_published_ms"] = r["step_ms"] / PUBLISHED_ACCEPT.get(k, 1.0)
                    rows.append(r)
                    print(
                        f"{graphs:>6} {fused:>5} {vocab or 'all':>6} {batch:>5} {k:>2} "
                        f"{r['prefill_ms']:>10.1f} "
                        f"{r['verify_ms']:>9.2f} {r['draft_ms']:>9.2f} "
                        f"{r['verify_over_plain']:>12.2f} {r['draft_over_plain']:>11.2f} "
                        f"{floor_ms:>8.2f} {r['plain_over_floor']:>11.2f} "
                        f"{r['overlap_ms']:>10.2f} {r['overlap_ms'] / floor_ms:>13.2f} "
                        f"{r['itl_published_ms']:>10.2f}",
                        flush=True,
                    )
    by_dtype: dict[str, int] = {}
    for p in runner.model.parameters():
        by_dtype[str(p.dtype)] = by_dtype.get(str(p.dtype), 0) + p.numel() * p.element_size()
    parts = ", ".join(f"{d.replace('torch.', '')} {b / 2**30:.2f}" for d, b in by_dtype.items())
    print(f"weights {weight_bytes(runner.model) / 2**30:.2f} GiB ({parts})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
