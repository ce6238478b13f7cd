"""The workers' torch.profiler (vLLM's LLM.start_profile / stop_profile, the engine behind POST
/start_profile and /stop_profile): the traces hold one range per step profiled; the router stops it
itself after `num_steps` device steps; every rank of a TP group writes its own; switches it cannot
apply (a second start, a stop while off, a folder it cannot write, an unknown activity) are
refused without leaving it half on. On CUDA the trace holds the captured decode graphs' kernels.
The HTTP routes through a live TP=2 appliance: tests/e2e/test_lifecycle.py."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

from appliance import LLM, SamplingParams

OPTS = dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_slots=2048, max_model_len=256)
PROMPTS = [[5, 17, 300, 4], list(range(40, 60))]
FIVE = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def trace(path: str) -> list[dict]:
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def step_ranges(events: list[dict]) -> set[str]:
    return {e["name"] for e in events if str(e.get("name", "")).startswith("step ")}


def test_a_profile_holds_the_steps_between_start_and_stop(tiny_dense, tmp_path):
    llm = LLM(str(tiny_dense), **OPTS)
    want = [o.token_ids for o in llm.generate(PROMPTS, FIVE)]
    before = llm.scheduler.stats().num_steps
    assert llm.start_profile("run", output_dir=str(tmp_path)) == str(tmp_path)
    with pytest.raises(RuntimeError, match="already running"):  # refused by the router
        llm.start_profile(output_dir=str(tmp_path))
    assert [o.token_ids for o in llm.generate(PROMPTS, FIVE)] == want  # profiling changes nothing
    steps = llm.scheduler.stats().num_steps - before
    files = llm.stop_profile()
    assert len(files) == 1 and os.path.basename(files[0]).startswith("run-")
    assert files[0].endswith("-TP-0.trace.json.gz") and os.path.dirname(files[0]) == str(tmp_path)
    events = trace(files[0])
    # the generate's steps, and the empty plan that carried the start (the engine was idle)
    assert len(step_ranges(events)) == steps
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the ops inside them
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(files[0])]  # no leftovers
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()


def test_num_steps_stops_it_after_that_many_device_steps(tiny_dense, tmp_path):
    llm = LLM(str(tiny_dense), **OPTS)
    llm.start_profile(output_dir=str(tmp_path), num_steps=3, activities=["CPU", "MEM"])
    llm.generate(PROMPTS, FIVE)  # a prefill and four decodes: stopped after the third
    (name,) = os.listdir(tmp_path)
    events = trace(str(tmp_path / name))
    assert len(step_ranges(events)) == 4  # the empty plan that started it, three device steps
    assert any(e.get("name") == "[memory]" for e in events)  # MEM: allocations recorded
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    llm.start_profile(output_dir=str(tmp_path))  # off again: it starts
    assert llm.stop_profile()


def test_refused_switches_leave_it_off(tiny_dense, tmp_path):
    llm = LLM(str(tiny_dense), **OPTS)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(RuntimeError, match="cannot write traces"):
        llm.start_profile(output_dir=str(tmp_path / "a-file" / "traces"))
    for bad in (dict(activities=["RPD"]), dict(activities=[]), dict(num_steps=0)):
        with pytest.raises(ValueError, match="start_profile"):
            llm.start_profile(output_dir=str(tmp_path), **bad)
    with pytest.raises(ValueError, match="profile id"):
        llm.start_profile("../up", output_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    assert llm.start_profile(output_dir=str(tmp_path)) and llm.stop_profile()


def test_every_tensor_parallel_rank_writes_its_trace(tiny_dense, tmp_path):
    with LLM(str(tiny_dense), tp=2, device="cpu", **OPTS) as llm:  # gloo (one GPU: no NCCL pair)
        llm.start_profile("tp", output_dir=str(tmp_path), num_steps=2)
        llm.generate(PROMPTS, FIVE)  # stopped by the router after two device steps
        llm.start_profile("tp2", output_dir=str(tmp_path))
        llm.generate(PROMPTS[:1], FIVE)
        files = llm.stop_profile()
    assert [os.path.basename(f)[-19:] for f in files] == [
        "-TP-0.trace.json.gz",
        "-TP-1.trace.json.gz",
    ]
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 4 and sum(n.startswith("tp-") for n in names) == 2, names
    for name in names:
        assert step_ranges(trace(str(tmp_path / name))), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_trace_holds_the_graphed_kernels(tiny_dense, tmp_path):
    llm = LLM(str(tiny_dense), **dict(OPTS, device="cuda", cuda_graph_max_bs=4))
    assert llm.runner.graphs is not None
    llm.generate(PROMPTS, FIVE)  # warm
    llm.start_profile(output_dir=str(tmp_path))
    llm.generate(PROMPTS, FIVE)
    (path,) = llm.stop_profile()
    events = trace(path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels and any(e.get("name") == "cudaGraphLaunch" for e in events)
    assert len(step_ranges(events)) >= 5
