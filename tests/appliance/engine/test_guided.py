"""The worker's grammar matchers (engine/guided.py) on the tiny checkpoint's tokenizer: a verify
chunk's row masks equal the masks of decoding its drafts one by one, rows past a rejected draft are
free, the matcher is left where it was, `after_token` keeps the reasoning free, and the sampler
never picks a forbidden token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from appliance.engine.guided import GuidedDecoding
from appliance.engine.sampler import Sampler
from appliance.messages import Guide, SamplingOptions
from appliance_kernels.token_bitmask import unpack_bitmask

GUIDE = Guide("regex", r"(ab|cd)+[0-9]{2,4}")
VOCAB = 2000
EOS = 1992


@pytest.fixture(scope="module")
def tokenizer(tiny_dense):
    return AutoTokenizer.from_pretrained(str(tiny_dense))


def _guided(tokenizer) -> GuidedDecoding:
    return GuidedDecoding(lambda: tokenizer, VOCAB, [EOS])


def _allowed(mask: torch.Tensor, row: int) -> list[int]:
    return torch.nonzero(unpack_bitmask(mask[row : row + 1], VOCAB)[0]).flatten().tolist()


def _walk(guided: GuidedDecoding, slot: int, steps: int) -> tuple[list[int], list[list[int]]]:
    """Greedy-lowest valid tokens and each step's allowed set, decoding one token per step."""
    tokens, allowed = [], []
    for _ in range(steps):
        ok = _allowed(guided.bitmask([(slot, [])]), 0)
        allowed.append(ok)
        token = ok[len(ok) // 2]
        tokens.append(token)
        guided.advance(slot, [token])
    return tokens, allowed


def test_verify_rows_follow_their_drafts(tokenizer):
    reference = _guided(tokenizer)
    reference.admit(0, GUIDE, [])
    tokens, allowed = _walk(reference, 0, 4)

    guided = _guided(tokenizer)
    guided.admit(3, GUIDE, [])
    mask = guided.bitmask([(3, tokens[:3])])  # drafts all valid: rows 0..3 follow them
    assert [_allowed(mask, j) for j in range(4)] == allowed
    bad = next(t for t in range(VOCAB) if t not in allowed[1])
    mask = guided.bitmask([(3, [tokens[0], bad, tokens[2]])])  # draft 1 rejected
    assert _allowed(mask, 0) == allowed[0] and _allowed(mask, 1) == allowed[1]
    assert _allowed(mask, 2) == list(range(VOCAB))  # never kept: left free
    assert _allowed(guided.bitmask([(3, [])]), 0) == allowed[0]  # the matcher did not move
    guided.advance(3, tokens[:2])
    assert _allowed(guided.bitmask([(3, [])]), 0) == allowed[2]


def test_unguided_rows_are_free_and_none_without_guides(tokenizer):
    guided = _guided(tokenizer)
    assert guided.bitmask([(1, []), (2, [5, 6])]) is None
    guided.admit(2, GUIDE, [])
    mask = guided.bitmask([(1, []), (2, [])])
    assert mask.shape == (2, VOCAB // 32 + (VOCAB % 32 > 0))
    assert _allowed(mask, 0) == list(range(VOCAB))
    assert len(_allowed(mask, 1)) < 20


def test_after_token_leaves_reasoning_free(tokenizer):
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    guided = _guided(tokenizer)
    guided.admit(0, Guide(GUIDE.kind, GUIDE.spec, after_token=think_end), [])
    free = list(range(VOCAB))
    assert _allowed(guided.bitmask([(0, [])]), 0) == free
    mask = guided.bitmask([(0, [7, think_end])])  # drafts: a thought, then </think>
    assert _allowed(mask, 0) == free and _allowed(mask, 1) == free
    assert len(_allowed(mask, 2)) < 20  # the grammar starts after </think>
    guided.advance(0, [7, 8])
    assert _allowed(guided.bitmask([(0, [])]), 0) == free
    guided.advance(0, [think_end])
    assert len(_allowed(guided.bitmask([(0, [])]), 0)) < 20


def test_recomputed_request_replays_its_output(tokenizer):
    reference = _guided(tokenizer)
    reference.admit(0, GUIDE, [])
    tokens, allowed = _walk(reference, 0, 3)
    guided = _guided(tokenizer)
    guided.admit(5, GUIDE, tokens[:2])  # preempted after two tokens, admitted again
    assert _allowed(guided.bitmask([(5, [])]), 0) == allowed[2]


def test_finished_grammar_allows_only_the_stop_token(tokenizer):
    guided = _guided(tokenizer)
    guided.admit(0, Guide("grammar", 'root ::= "ab"'), [])
    token = _allowed(guided.bitmask([(0, [])]), 0)
    ids = tokenizer.encode("ab")
    guided.advance(0, ids)
    assert _allowed(guided.bitmask([(0, [])]), 0) == [EOS]
    guided.advance(0, [EOS])
    assert _allowed(guided.bitmask([(0, [])]), 0) == [EOS]
    assert token  # the first step allowed something


def test_sampler_never_picks_a_forbidden_token(tokenizer):
    guided = _guided(tokenizer)
    for slot in range(4):
        guided.admit(slot, GUIDE, [])
    mask = guided.bitmask([(slot, []) for slot in range(4)])
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = [SamplingOptions(temperature=t, seed=s) for t, s in [(0, None), (1, 1), (2, 2), (1, 3)]]
    out = Sampler().sample(logits, rows, None, [10] * 4, token_bitmask=mask)
    for row, token in enumerate(out.token_ids.tolist()):
        assert token in _allowed(mask, row)


def test_bounded_json_strings_refuse_control_characters(tokenizer):
    """xgrammar 0.2.9 lets raw control characters into length-bounded strings; ours do not."""
    schema = '{"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}}'
    guided = _guided(tokenizer)
    guided.admit(0, Guide("json_schema", schema + "\n"), [])
    guided.advance(0, tokenizer.encode('{"a": "'))  # compact JSON keeps one blank after :
    allowed = _allowed(guided.bitmask([(0, [])]), 0)
    control = tokenizer.convert_tokens_to_ids("Ć")  # the byte-level token of b"\x06"
    assert tokenizer.convert_tokens_to_ids("a") in allowed
    assert control not in allowed


def test_a_compiling_grammar_holds_its_request_not_the_step_loop(tiny_dense):
    """While the worker compiles a guided request's grammar (slowed to 1.5 s here), the router
    plans everything but that request's first sample: other requests keep decoding, no step
    waits for the compile, and the guided output still follows its grammar."""
    import re
    import threading
    import time
    from concurrent.futures import Future

    from appliance.offline.llm import LLM
    from appliance.sampling_params import SamplingParams

    llm = LLM(str(tiny_dense), max_num_seqs=4, max_num_batched_tokens=64, num_kv_slots=2048)
    runner = llm.runner
    compiler = runner.guided._compiler
    submit = compiler.submit

    plain_done = threading.Event()  # the plain request's 40 tokens came (set by timed_collect)

    def slow_submit(guide: Guide) -> Future:
        late: Future = Future()

        def finish() -> None:
            # at least 1.5 s, and past the plain request's end (a loaded machine decodes slower):
            # then only the guided request is left, waiting, and the router sends empty plans
            time.sleep(1.5)
            plain_done.wait(60)
            late.set_result(submit(guide).result())

        threading.Thread(target=finish, daemon=True).start()
        return late

    compiler.submit = slow_submit
    steps: list[tuple[float, int]] = []  # (seconds since the previous result, sampled rows)
    forward_s: list[float] = []  # of the steps that ran chunks
    collect, last = runner.collect, [time.perf_counter()]
    submit_plan, planned = runner.submit, []

    def counted_submit(plan):
        planned.append(bool(plan.chunks))
        submit_plan(plan)

    def timed_collect():
        result = collect()  # (a step that waited for a compile did so in its submit)
        now = time.perf_counter()
        steps.append((now - last[0], len(result.sampled)))
        if sum(n for _, n in steps) >= 40:
            plain_done.set()
        if planned.pop(0):
            forward_s.append(result.forward_s)
        last[0] = now
        return result

    runner.submit = counted_submit

    runner.collect = timed_collect
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    guided = SamplingParams(max_tokens=6, temperature=0, guide=GUIDE)
    t0 = time.perf_counter()
    out = llm.generate([[5, 6, 7, 8], [9, 10, 11]], [plain, guided])
    took = time.perf_counter() - t0
    assert took >= 1.5  # the guided request waited for its grammar
    assert max(s for s, _ in steps) < 1.0, steps  # no step waited for it
    assert sum(n for _, n in steps) >= 40  # the plain request decoded meanwhile
    text = llm.tokenizer.decode(out[1].token_ids)
    assert re.fullmatch(r"(ab|cd)+[0-9]{0,4}", text.removesuffix("<|im_end|>")), text
    stats = llm.scheduler.stats()
    assert (stats.num_running, stats.kv_used) == (0, 0)
    # the empty plans sent while the grammar compiled are no steps in the router's step timings
    assert len(forward_s) < len(steps)
    mean_ms = 1000 * sum(forward_s) / len(forward_s)
    assert llm.engine.stats().step_forward_ms == pytest.approx(mean_ms, rel=1e-6)


def test_guided_sampling_behind_a_step_in_flight_waits_for_its_result(tiny_dense, monkeypatch):
    """With a step in flight the next step's forward is launched at once and its guided rows'
    sampling when the earlier result is collected (the masks need the matchers past it): the
    tokens equal those of steps run one at a time, and every guided output follows its grammar."""
    import re

    import appliance.router.engine as engine_module
    from appliance.engine.pending import PendingStep
    from appliance.offline.llm import LLM
    from appliance.sampling_params import SamplingParams

    launched = []
    original = PendingStep.launch_deferred

    def counting(self):
        launched.append(self.deferred is not None)
        original(self)

    monkeypatch.setattr(PendingStep, "launch_deferred", counting)
    llm = LLM(str(tiny_dense), max_num_seqs=4, max_num_batched_tokens=64, num_kv_slots=2048)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] + [
        SamplingParams(max_tokens=10, temperature=1.0, seed=seed, guide=GUIDE) for seed in (1, 2)
    ]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    overlapped = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(launched) >= 5  # the guided steps' sampling was held back and launched later
    monkeypatch.setattr(engine_module, "MAX_IN_FLIGHT", 1)
    launched.clear()
    alone = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(launched) == 0 and overlapped == alone
    for tokens in overlapped[1:]:
        text = llm.tokenizer.decode(tokens).removesuffix("<|im_end|>")
        assert re.fullmatch(r"(ab|cd)+[0-9]{0,4}", text), text


def test_a_host_path_step_behind_a_guided_step_in_flight_reads_current_matchers(tiny_dense):
    """A guided request's decode runs device-resident (its matcher reads the token when the
    result is collected); if the next step takes the host path (here an MTP request's prefill
    joins it) while that step is in flight, the masks must wait for the matcher: the tokens equal
    those of the same plans run one at a time."""
    from appliance.config import EngineConfig, ModelConfig, SchedulerConfig
    from appliance.engine.runner import ModelRunner
    from appliance.messages import NewRequest, ScheduledChunk, StepPlan

    config = EngineConfig(
        model=ModelConfig(model_dir=str(tiny_dense), max_model_len=128),
        scheduler=SchedulerConfig(max_num_seqs=4, num_kv_slots=1024, mtp_step=1),
    )
    guided = SamplingOptions(temperature=1.0, seed=3, guide=GUIDE)
    prompt, other = [5, 6, 7, 8], [9, 10, 11, 12, 13]
    p = len(prompt)
    plans = [
        StepPlan(
            0, [NewRequest(1, prompt, guided)], [ScheduledChunk(1, 0, p, [0, 1, 2, 3], True)], []
        ),
        StepPlan(1, [], [ScheduledChunk(1, p, 1, [4], True)], []),
        StepPlan(
            2,
            [NewRequest(2, other, SamplingOptions(temperature=0.0), num_draft=1)],
            [
                ScheduledChunk(1, p + 1, 1, [5], True),
                ScheduledChunk(2, 0, 5, [10, 11, 12, 13, 14], True),
            ],
            [],
        ),
        StepPlan(3, [], [ScheduledChunk(1, p + 2, 1, [6], True)], []),
    ]

    def tokens(results) -> list[int]:
        return [t for r in results for s in r.sampled if s.req_slot == 1 for t in s.token_ids]

    alone = ModelRunner(config)
    expected = tokens([alone.execute(plan) for plan in plans])
    runner = ModelRunner(config)
    results = [runner.execute(plans[0])]
    runner.submit(plans[1])  # device-resident, in flight
    runner.submit(plans[2])  # host path (the MTP request) behind it
    results += [runner.collect(), runner.collect(), runner.execute(plans[3])]
    assert tokens(results) == expected
