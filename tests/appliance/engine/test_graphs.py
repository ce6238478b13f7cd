"""The CUDA-graph decode step (appliance/engine/graphs.py), run eagerly on CPU: its inputs derived
from one [3, bs] tensor give the eager path's tokens, and its padding rows never touch the KV or
state of a live request. (Capture and replay themselves are checked on the GPU.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from appliance.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from appliance.engine.graphs import (
    DecodeGraphs,
    graph_batch_sizes,
    graph_max_bs,
    graph_reserve_bytes,
    is_plain_decode,
)
from appliance.engine.pools import Pools
from appliance.engine.requests import RequestTable
from appliance.engine.runner import ModelRunner
from appliance.messages import NewRequest, SamplingOptions, ScheduledChunk, StepPlan

GREEDY = SamplingOptions(temperature=0.0)
SEEDED = SamplingOptions(temperature=1.0, top_k=20, seed=5)


def test_buckets():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_when_graphs_are_captured():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on = GraphConfig()
    assert graph_max_bs(on, 64, cuda, "triton") == 64
    assert graph_max_bs(on, 1024, cuda, "triton") == 256  # the largest bucket
    assert graph_max_bs(GraphConfig(cuda_graph_max_bs=16), 64, cuda, "triton") == 16
    assert graph_max_bs(GraphConfig(cuda_graph_max_bs=128), 64, cuda, "triton") == 64
    assert graph_max_bs(GraphConfig(disable_cuda_graph=True), 64, cuda, "triton") == 0
    assert graph_max_bs(on, 64, cpu, "torch") == 0
    assert graph_max_bs(on, 64, cuda, "flashinfer") == 0  # plans on the host every step
    assert graph_reserve_bytes(0, 1000) == 0 < graph_reserve_bytes(1, 1000)


def test_plain_decode_rule():
    decode = ScheduledChunk(0, 5, 1, [9], True)
    assert is_plain_decode([decode, ScheduledChunk(1, 7, 1, [10], True)])
    assert not is_plain_decode([])
    assert not is_plain_decode([decode, ScheduledChunk(1, 0, 4, [1, 2, 3, 4], True)])  # prefill
    assert not is_plain_decode([ScheduledChunk(1, 7, 3, [1, 2, 3], True, num_draft=2)])  # verify
    assert not is_plain_decode([ScheduledChunk(1, 7, 1, [10], False)])  # no sample


def _runner(model_dir, graphs: bool, kv_cache_dtype: str = "auto") -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model_dir=str(model_dir), max_model_len=128),
        scheduler=SchedulerConfig(max_num_seqs=8, num_kv_slots=1024),
        cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
    )
    runner = ModelRunner(config)
    if graphs:  # what the runner does on CUDA: padded pools, then the graph step (uncaptured)
        sizes = dataclasses.replace(runner.pools.sizes, padding=True)
        runner.pools = Pools([runner.model], sizes, runner.dtype, runner.device, runner.kv_dtype)
        runner.requests = RequestTable(sizes.num_req_rows, sizes.max_model_len, 0, runner.device)
        cfg = runner.text_config
        runner.graphs = DecodeGraphs(
            runner.model,
            runner.requests,
            sizes,
            4,
            cfg.hidden_size,
            cfg.vocab_size,
            runner.dtype,
            runner.device,
        )
    return runner


def _generate(runner: ModelRunner, prompts, options, steps: int) -> list[list[int]]:
    """Prefill the prompts on slots 1.. (slot 0 stays idle), then decode all of them together."""
    slots = list(range(1, len(prompts) + 1))
    kv = iter(range(1024))
    new = [NewRequest(s, p, o) for s, p, o in zip(slots, prompts, options)]
    chunks = [
        ScheduledChunk(s, 0, len(p), [next(kv) for _ in p], True) for s, p in zip(slots, prompts)
    ]
    out = {s: [] for s in slots}
    result = runner.execute(StepPlan(0, new, chunks, []))
    for step in range(1, steps + 1):
        for sampled in result.sampled:
            out[sampled.req_slot] += sampled.token_ids
        lens = {s: len(p) + len(out[s]) for s, p in zip(slots, prompts)}
        chunks = [ScheduledChunk(s, lens[s] - 1, 1, [next(kv)], True) for s in slots]
        result = runner.execute(StepPlan(step, [], chunks, []))
    return [out[s] for s in slots]


@pytest.mark.parametrize(
    "fixture,kv", [("tiny_dense", "auto"), ("tiny_moe", "auto"), ("tiny_dense", "fp8_e4m3")]
)
def test_graph_step_matches_eager_and_padding_stays_apart(fixture, kv, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = [[11, 300, 42, 7, 99], list(range(100, 117)), [5, 6, 7]]  # 3 rows -> bucket 4
    options = [GREEDY, SEEDED, GREEDY]
    eager = _generate(_runner(model_dir, graphs=False, kv_cache_dtype=kv), prompts, options, 6)

    runner = _runner(model_dir, graphs=True, kv_cache_dtype=kv)
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda chunks: replays.append(len(chunks)) or run(chunks)
    # the idle slot 0's state and the router's KV slots past the ones used must not change
    gdn = runner.pools.gdn_layers[0]
    idle_state = gdn.ssm_states[0].clone()
    k_cache = runner.pools.kv[0][0]
    unused_kv = k_cache[500:1024].clone()
    graphed = _generate(runner, prompts, options, steps=6)

    assert graphed == eager
    assert replays == [3] * 6  # every decode step took the graph path, padded to 4
    assert torch.equal(gdn.ssm_states[0], idle_state)
    assert torch.equal(k_cache[500:1024], unused_kv)
    pad_kv = runner.pools.sizes.pad_kv_slot
    assert k_cache[pad_kv].float().abs().sum() > 0  # the padding row wrote its own slot


def _gpu_runner(
    model_dir, graphs: bool, kv_cache_dtype: str = "auto", quantization: str = ""
) -> ModelRunner:
    model = ModelConfig(
        model_dir=str(model_dir), max_model_len=256, dtype="bfloat16", quantization=quantization
    )
    config = EngineConfig(
        model=model,
        scheduler=SchedulerConfig(max_num_seqs=16, num_kv_slots=4096),
        parallel=ParallelConfig(device="cuda"),
        cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
        graphs=GraphConfig(disable_cuda_graph=not graphs, cuda_graph_max_bs=8),
    )
    return ModelRunner(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_with_fp8_kv_read_the_scales_at_replay(tmp_path):
    """fp8 KV through captured decode graphs: the eager tokens; and scales set after capture
    (as a checkpoint's are set before, through the same tensors) are what replays use."""
    from appliance.models.layers.attention import Attention
    from appliance.testing.tiny import build_qwen3_5

    model_dir = build_qwen3_5(tmp_path / "dense", seed=3)
    prompts = [list(range(7 * i + 3, 7 * i + 12)) for i in range(5)]  # padded to bucket 8
    options = [GREEDY, SEEDED] * 2 + [GREEDY]
    for scales in ((1.0, 1.0), (0.02, 0.03)):
        results = []
        for graphs in (False, True):
            runner = _gpu_runner(model_dir, graphs, "fp8_e4m3")
            assert runner.pools.kv[0][0].dtype == torch.float8_e4m3fn
            for m in runner.model.modules():
                if isinstance(m, Attention):
                    m.set_kv_scales(*scales, "test")
            results.append(_generate(runner, prompts, options, steps=12))
        assert results[1] == results[0], scales
        stored = runner.pools.kv[0][0][:200].float().abs().max()
        assert (stored > 50) == (scales[0] < 1), stored  # k / 0.02 spreads over the e4m3 range


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["dense", "moe", "qwen3_vl"])
@pytest.mark.parametrize("num_prompts", [5, 8, 11])  # padded to 8; exactly 8; above max: eager
def test_captured_graphs_replay_the_eager_tokens(family, num_prompts, tmp_path):
    from appliance.testing.tiny import build_qwen3_5
    from appliance.testing.tiny_vl import build_tiny_qwen3_vl

    if family == "qwen3_vl":
        model_dir = build_tiny_qwen3_vl(tmp_path / family, tokenizer="none", seed=3)
    else:
        model_dir = build_qwen3_5(tmp_path / family, moe=family == "moe", seed=3)
    gen = torch.Generator().manual_seed(num_prompts)
    prompts = [
        torch.randint(0, 200, (n,), generator=gen).tolist() for n in range(3, 3 + num_prompts)
    ]
    options = [GREEDY if i % 2 else SEEDED for i in range(num_prompts)]
    eager = _generate(_gpu_runner(model_dir, graphs=False), prompts, options, steps=12)
    runner = _gpu_runner(model_dir, graphs=True)
    assert runner.graphs is not None and runner.graphs.batch_sizes == [1, 2, 4, 8]
    assert len(runner.graphs.graphs) == 4  # captured
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda chunks: replays.append(len(chunks)) or run(chunks)
    assert _generate(runner, prompts, options, steps=12) == eager
    assert replays == ([] if num_prompts > 8 else [num_prompts] * 12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("quantization", ["", "fp8"])
def test_captured_graphs_with_the_split_gated_norm(quantization, tmp_path, monkeypatch):
    """One request (the one-row GEMVs, PDL on for bf16): with gdn.SPLIT_GATED_NORM the captured
    decode graphs replay the eager tokens, and the norm did finish inside out_proj's GEMV."""
    from appliance.models.layers import gdn
    from appliance.testing.tiny import build_qwen3_5
    from appliance_kernels import fp8_gemv

    model_dir = build_qwen3_5(tmp_path / "dense", seed=3)
    monkeypatch.setattr(gdn, "SPLIT_GATED_NORM", True)
    taken = []
    real = fp8_gemv.head_norm_args

    def spy(pending, *args):
        taken.append(pending is not None)
        return real(pending, *args)

    monkeypatch.setattr(fp8_gemv, "head_norm_args", spy)
    prompts, options = [list(range(3, 14))], [GREEDY]
    results = []
    for graphs in (False, True):
        runner = _gpu_runner(model_dir, graphs, quantization=quantization)
        results.append(_generate(runner, prompts, options, steps=12))
    assert results[0] == results[1]
    assert any(taken), "no GEMV took the head norm"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("quantization", ["", "fp8"])
@pytest.mark.parametrize("graphs", [False, True])
def test_the_state_read_before_the_wait_changes_nothing(
    quantization, graphs, tmp_path, monkeypatch
):
    """One request, the conv inside the in_proj GEMV: with gdn.PRELOAD_STATE and
    fp8_gemv.CONV_RELEASE (the recurrence launched as the GEMV starts and reading its state before
    its PDL wait), eager or in captured graphs, the tokens and the final SSM states are bit for bit
    those of the recurrence that waits before it reads."""
    from appliance.models.layers import gdn
    from appliance.testing.tiny import build_qwen3_5
    from appliance_kernels import fp8_gemv
    from appliance_kernels import gdn as gdn_kernels

    model_dir = build_qwen3_5(tmp_path / "dense", seed=3)
    monkeypatch.setattr(gdn, "FUSE_CONV", True)
    prompts, options = [list(range(3, 14))], [GREEDY]
    tokens, states = {}, {}
    for preload in (False, True):
        monkeypatch.setattr(gdn_kernels, "PRELOAD_STATE", preload)
        monkeypatch.setattr(fp8_gemv, "CONV_RELEASE", preload)
        runner = _gpu_runner(model_dir, graphs, quantization=quantization)
        tokens[preload] = _generate(runner, prompts, options, steps=24)
        states[preload] = [g.ssm_states[1].cpu() for g in runner.pools.gdn_layers]
    assert tokens[True] == tokens[False]
    for layer, (got, want) in enumerate(zip(states[True], states[False])):
        assert torch.equal(got, want), layer
