"""The CUDA-graph prefill step (appliance/engine/prefill_graphs.py), run eagerly on CPU: one
request's chunk padded to its bucket with a second request on the padding slot gives the eager
path's tokens (first chunk, a later chunk on top of earlier state, the last chunk's sample), and
the padding never touches the KV or state of a live request. (Capture and replay themselves are
checked on the GPU.)"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from appliance.config import EngineConfig, GraphConfig, ModelConfig, SchedulerConfig
from appliance.engine.pools import Pools
from appliance.engine.prefill_graphs import (
    PrefillGraphs,
    prefill_buckets,
    prefill_graph_reserve_bytes,
)
from appliance.engine.requests import RequestTable
from appliance.engine.runner import ModelRunner
from appliance.messages import NewRequest, SamplingOptions, ScheduledChunk, StepPlan

GREEDY = SamplingOptions(temperature=0.0)
SEEDED = SamplingOptions(temperature=1.0, top_k=20, seed=5)


def test_buckets_and_reserve():
    assert prefill_buckets(0) == [] and prefill_buckets(31) == []
    assert prefill_buckets(64) == [32, 64]
    assert prefill_buckets(512) == [32, 64, 128, 256, 512]
    assert prefill_graph_reserve_bytes(0, 64, 1000) == 0 < prefill_graph_reserve_bytes(32, 64, 1000)
    assert GraphConfig().cuda_graph_max_prefill_tokens == 512
    with pytest.raises(ValueError, match="cuda_graph_max_prefill_tokens"):
        GraphConfig(cuda_graph_max_prefill_tokens=-1)


def _runner(model_dir, graphs: bool) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model_dir=str(model_dir), max_model_len=128),
        scheduler=SchedulerConfig(max_num_seqs=4, num_kv_slots=1024),
    )
    runner = ModelRunner(config)
    if graphs:  # what the runner does on CUDA: padded pools, then the graph step (uncaptured)
        sizes = dataclasses.replace(runner.pools.sizes, padding=True)
        runner.pools = Pools([runner.model], sizes, runner.dtype, runner.device, runner.kv_dtype)
        runner.requests = RequestTable(sizes.num_req_rows, sizes.max_model_len, 0, runner.device)
        runner.prefill_graphs = PrefillGraphs(
            runner.model, runner.requests, sizes, 64, runner.text_config.vocab_size, runner.device
        )
    return runner


def _generate(runner: ModelRunner, prompt: list[int], option, cut: int, steps: int) -> list[int]:
    """Prefill `prompt` on slot 1 (slot 0 stays idle) in two chunks, cut at `cut` (one step
    each), then decode `steps` tokens."""
    kv = iter(range(1024))
    first = ScheduledChunk(1, 0, cut, [next(kv) for _ in range(cut)], False)
    rest = len(prompt) - cut
    second = ScheduledChunk(1, cut, rest, [next(kv) for _ in range(rest)], True)
    runner.execute(StepPlan(0, [NewRequest(1, prompt, option)], [first], []))
    out = runner.execute(StepPlan(1, [], [second], [])).sampled[0].token_ids
    for step in range(steps):
        chunk = ScheduledChunk(1, len(prompt) + len(out) - 1, 1, [next(kv)], True)
        out += runner.execute(StepPlan(2 + step, [], [chunk], [])).sampled[0].token_ids
    return out


@pytest.mark.parametrize("fixture", ["tiny_dense", "tiny_moe"])
@pytest.mark.parametrize("option", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_graph_step_matches_eager_and_padding_stays_apart(fixture, option, request):
    model_dir = request.getfixturevalue(fixture)
    prompt = [(37 * i + 11) % 1500 + 100 for i in range(45)]
    eager = _generate(_runner(model_dir, graphs=False), prompt, option, 17, 4)

    runner = _runner(model_dir, graphs=True)
    replays = []
    run = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda chunk: replays.append(chunk.num_tokens) or run(chunk)
    gdn = runner.pools.gdn_layers[0]
    idle_state = gdn.ssm_states[0].clone()
    k_cache = runner.pools.kv[0][0]
    unused_kv = k_cache[100:1024].clone()
    graphed = _generate(runner, prompt, option, 17, 4)

    assert graphed == eager
    assert replays == [17, 28]  # both chunks (buckets 32), not the one-token decodes
    assert torch.equal(gdn.ssm_states[0], idle_state)
    assert torch.equal(k_cache[100:1024], unused_kv)
    assert k_cache[runner.pools.sizes.pad_kv_slot].float().abs().sum() > 0  # padding wrote it


def test_steps_the_prefill_graphs_leave_eager(tiny_dense):
    runner = _runner(tiny_dense, graphs=True)
    graphs = runner.prefill_graphs
    assert graphs.bucket(17) == 32 and graphs.bucket(32) == 64  # always one padding row
    assert graphs.can_run(ScheduledChunk(1, 0, 63, list(range(63)), True))
    assert not graphs.can_run(ScheduledChunk(1, 0, 64, list(range(64)), True))  # no padding row
    assert not graphs.can_run(ScheduledChunk(1, 4, 1, [9], True))  # a decode
    assert not graphs.can_run(ScheduledChunk(1, 4, 3, [9, 10, 11], True, num_draft=2))  # verify
    runner.execute(StepPlan(0, [NewRequest(1, list(range(100, 120)), GREEDY)], [], []))
    chunk = ScheduledChunk(1, 0, 20, list(range(20)), True)
    assert runner._prefill_graph_step([chunk])
    assert not runner._prefill_graph_step([chunk, ScheduledChunk(2, 0, 4, [30, 31, 32, 33], True)])
    logprobs = msgspec.structs.replace(GREEDY, prompt_logprobs=1)
    runner.execute(StepPlan(1, [NewRequest(2, list(range(100, 120)), logprobs)], [], []))
    assert not runner._prefill_graph_step([ScheduledChunk(2, 0, 20, list(range(40, 60)), True)])


def _gpu_runner(model_dir, graphs: bool) -> ModelRunner:
    from appliance.config import ParallelConfig

    config = EngineConfig(  # fp32: bf16 rounding of other GEMM shapes would flip near-ties
        model=ModelConfig(model_dir=str(model_dir), max_model_len=256, dtype="float32"),
        scheduler=SchedulerConfig(max_num_seqs=4, num_kv_slots=4096),
        parallel=ParallelConfig(device="cuda"),
        graphs=GraphConfig(disable_cuda_graph=not graphs, cuda_graph_max_bs=4),
    )
    return ModelRunner(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fixture", ["tiny_dense", "tiny_moe"])
def test_captured_prefill_graphs_give_the_eager_tokens(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompt = [(37 * i + 11) % 1500 + 100 for i in range(200)]
    eager = _generate(_gpu_runner(model_dir, graphs=False), prompt, SEEDED, 150, 4)
    runner = _gpu_runner(model_dir, graphs=True)
    assert runner.prefill_graphs is not None and sorted(runner.prefill_graphs.graphs) == [
        32,
        64,
        128,
        256,
    ]
    replays = []
    run = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda chunk: replays.append(chunk.num_tokens) or run(chunk)
    assert _generate(runner, prompt, SEEDED, 150, 4) == eager
    assert replays == [150, 50]  # buckets 256 and 64, then decode graphs
