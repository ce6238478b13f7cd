"""The offline API: `LLM(model_dir, tp, **options).generate(prompts, SamplingParams)` with string
and token-id prompts, stop strings, length finishes, seeds, n, option validation, recovery from a
failed or interrupted call, and TP=2 workers."""

from __future__ import annotations

import json
import shutil

import pytest

from appliance import LLM, SamplingParams

OPTS = dict(max_num_seqs=4, num_kv_slots=2048, max_model_len=256)


@pytest.fixture(scope="module")
def llm(tiny_dense):
    return LLM(str(tiny_dense), **OPTS)


def test_string_and_token_prompts(llm):
    ids = llm.tokenizer.encode("def main():")
    a, b = llm.generate(
        ["def main():", ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    assert a.prompt_token_ids == ids and a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert a.finish_reason == "length" and a.text == llm.tokenizer.decode(a.token_ids)


def test_stop_string_truncates_text_and_frees_slots(llm):
    full = llm.generate("import os", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop.strip(), "the continuation is too short to pick a stop string"
    out = llm.generate(
        "import os", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert full.text.startswith(out.text)
    stats = llm.scheduler.stats()
    assert stats.kv_used == 0 and stats.state_used == 0


def test_seed_reproduces_and_differs(llm):
    p = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    a = llm.generate("x = ", SamplingParams(seed=1, **p))[0].token_ids
    b = llm.generate("x = ", SamplingParams(seed=1, **p))[0].token_ids
    c = llm.generate("x = ", SamplingParams(seed=2, **p))[0].token_ids
    assert a == b and a != c


def test_generate_without_params_samples_with_the_generation_config(llm, tiny_dense, tmp_path):
    tiny = llm.default_sampling_params()  # the tiny checkpoint's file: 0.6 / 20 / 0.95
    assert (tiny.temperature, tiny.top_k, tiny.top_p) == (0.6, 20, 0.95)
    (tmp_path / "generation_config.json").write_text('{"do_sample": false}')
    greedy = LLM(str(tiny_dense), generation_config=str(tmp_path), **OPTS)
    assert greedy.default_sampling_params().temperature == 0.0
    want = greedy.generate("x = ", SamplingParams(temperature=0))[0].token_ids
    assert [o.token_ids for o in greedy.generate(["x = ", "x = "])] == [want, want]
    assert LLM(str(tiny_dense), generation_config="none", **OPTS).default_sampling_params() == (
        SamplingParams()
    )


def test_n_outputs_a_prompt_prompt_by_prompt(llm):
    """SamplingParams.n gives n choices a prompt, grouped as vLLM's RequestOutput: one output a
    prompt (its first choice), `outputs` its n choices; with a seed, choice i samples as the
    server's choice i does (seed + i), so the choices differ and each reproduces."""
    p = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    outs = llm.generate(["x = ", "y = "], SamplingParams(n=3, seed=7, **p))
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [3, 3]
    assert [o.prompt_token_ids for o in outs] == [
        llm.tokenizer.encode("x = "),
        llm.tokenizer.encode("y = "),
    ]
    for i in range(3):
        alone = llm.generate("x = ", SamplingParams(seed=7 + i, **p))[0]
        assert outs[0].outputs[i].token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1
    # out[i] reads as its first choice too: out[i].text is out[i].outputs[0].text
    assert outs[0].outputs[0] is outs[0] and outs[1].outputs[0] is outs[1]
    assert [o.index for o in outs[1].outputs] == [0, 1, 2] and outs[1].prompt == "y = "
    assert all(c.finished for o in outs for c in o.outputs)
    # vLLM's loop over prompts and their choices sees each choice once
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 6 and texts[:3] == [c.text for c in outs[0].outputs]
    one = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert one[0].outputs == one and one[0].prompt is None and "outputs" not in repr(one[0])


def test_a_failed_or_interrupted_call_leaves_the_llm_as_new(llm, monkeypatch):
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = llm.generate("x = ", greedy)[0].token_ids
    with pytest.raises(ValueError, match="sampling_params: 2 given for 1 prompts"):
        llm.generate(["x = "], [greedy, greedy])
    with pytest.raises(ValueError, match="token id 999999 is not in the vocabulary"):
        llm.generate([[1, 2], [999999]], greedy)
    # an interrupt (Ctrl-C) in the middle of the steps drops the call's requests
    step, steps = llm.engine.step, []

    def interrupted():
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b", "c"], SamplingParams(max_tokens=20, ignore_eos=True))
    monkeypatch.undo()
    assert llm.generate("x = ", greedy)[0].token_ids == want
    stats = llm.scheduler.stats()
    assert stats.kv_used == 0 and stats.state_used == 0 and stats.num_waiting == 0


def test_bad_options_name_the_field(tiny_dense):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="no_such_option"):
        LLM(str(tiny_dense), no_such_option=1)
    with pytest.raises(ValueError, match="mtp_step"):
        LLM(str(tiny_dense), mtp_step=4)


def test_a_tp2_worker_that_cannot_load_says_why(tiny_dense, tmp_path):
    """TP=2 workers load in their own processes: the checkpoint's fault reaches the caller as one
    line naming the worker, the exception and the tensor."""
    from appliance.offline.workers import WorkerError
    from tests.e2e.test_cli import _without_a_tensor

    missing = _without_a_tensor(tiny_dense, tmp_path / "model", "layers.2.mlp.up_proj")
    with pytest.raises(
        WorkerError, match=r"worker \d failed during startup: CheckpointMismatch"
    ) as e:
        LLM(str(tmp_path / "model"), tp=2, **OPTS)
    assert missing.replace("language_model.", "") in str(e.value)


def test_tp2_worker_processes_match_tp1(tiny_moe):
    prompts = [[5, 6, 7] * 10, "def f(x):", [9] * 40]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tp1 = [o.token_ids for o in LLM(str(tiny_moe), **OPTS).generate(prompts, params)]
    with LLM(str(tiny_moe), tp=2, **OPTS) as tp2:
        assert [o.token_ids for o in tp2.generate(prompts, params)] == tp1
        # a second turn hits the first (KV and every rank's GDN state snapshot) and matches TP=1
        # without caching
        turn2 = prompts[0] + tp1[0] + [11, 12, 13]
        hits = tp2.scheduler.stats().prefix_cache_hits
        got = tp2.generate(turn2, params)[0].token_ids
        assert tp2.scheduler.stats().prefix_cache_hits - hits == len(prompts[0]) + 9
    plain = LLM(str(tiny_moe), prefix_caching=False, **OPTS)
    assert got == plain.generate(turn2, params)[0].token_ids


def test_chat_renders_conversations_as_the_server_does(llm):
    """`chat` is `generate` over the chat template's rendering: one conversation or several, a
    developer message as the system one, chat_template_kwargs and tools passed to the template."""
    from appliance.server.prompts import PromptBuilder
    from appliance.server.protocol import ChatMessage

    greedy = SamplingParams(max_tokens=6, temperature=0)
    talk = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    builder = PromptBuilder(llm.tokenizer.hf, 256)
    kwargs = {"enable_thinking": False}
    rendered = builder.chat([ChatMessage(**m) for m in talk], None, kwargs).token_ids
    assert "<|im_start|>system\nBe brief." in llm.tokenizer.hf.decode(rendered)
    [alone] = llm.chat(talk, greedy, chat_template_kwargs=kwargs)
    assert alone.prompt_token_ids == rendered
    assert alone.text == llm.generate([rendered], greedy)[0].text
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    two = llm.chat([talk, talk[1:]], greedy, chat_template_kwargs=kwargs, tools=tools)
    assert len(two) == 2 and "get_time" in llm.tokenizer.hf.decode(two[1].prompt_token_ids)
    with pytest.raises(ValueError, match="conversation 1: .*chat template rejected"):
        llm.chat([talk, []], greedy)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "robot", "content": "hi"}], greedy)


def test_vllm_keywords_and_a_tp_the_model_cannot_split(tiny_dense):
    with LLM(str(tiny_dense), tensor_parallel_size=1, enforce_eager=True, **OPTS) as llm:
        assert llm.config.parallel.tp == 1 and llm.config.graphs.disable_cuda_graph
    with LLM(str(tiny_dense), gpu_memory_utilization=0.9, **OPTS) as llm:  # vLLM's share
        assert llm.config.cache.gpu_memory_utilization == 0.9
    with LLM(str(tiny_dense), mem_fraction_static=0.7, **OPTS) as llm:  # SGLang's, read so
        assert llm.config.cache.gpu_memory_utilization == 0.7
    with pytest.raises(ValueError, match="tp 3 does not divide num_attention_heads 4"):
        LLM(str(tiny_dense), tensor_parallel_size=3, **OPTS)


def test_the_readme_offline_example_answers_as_printed(capsys):
    """README's offline example, run as printed: the embedded default model (`LLM()`) answers
    the chat with what its comment says."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    block = re.search(r"Offline, in Python.*?```python\n(.*?)```", readme, re.S).group(1)
    expected = re.search(r"print\(.*\)  # (.+)", block).group(1)
    exec(compile(block, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == expected == "Paris"


def test_bad_words_through_the_engine(llm):
    """vLLM's bad_words offline: a word the free greedy answer writes (as the tokenizer spells
    it) never appears, the answer is the same up to where it did, and a two-token word is cut
    only where its first token came."""
    prompt = [11, 300, 42, 7, 99]
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    [free] = llm.generate(prompt, SamplingParams(**greedy))
    hf = llm.tokenizer.hf
    spelled = [
        (k, t)
        for k, t in enumerate(free.token_ids)
        if [t]
        in SamplingParams(bad_words=[hf.decode([t])])
        .tokenize_bad_words(lambda w: hf.encode(w, add_special_tokens=False))
        .bad_words_token_ids
    ]
    assert spelled, free.token_ids
    k, token = spelled[0]
    first = free.token_ids.index(token)
    [out] = llm.generate(prompt, SamplingParams(bad_words=[hf.decode([token])], **greedy))
    assert token not in out.token_ids and out.token_ids[:first] == free.token_ids[:first]
    pair = free.token_ids[3:5]
    [cut] = llm.generate(prompt, SamplingParams(bad_words_token_ids=[pair], **greedy))
    assert cut.token_ids[:4] == free.token_ids[:4] and cut.token_ids[4] != free.token_ids[4]


def test_min_tokens_and_allowed_token_ids_through_the_engine(llm):
    """The router fills min_tokens' ban at admission (the stop ids, eos unless ignored): a stop
    id the greedy answer starts with cannot end it before min_tokens tokens; allowed_token_ids
    keeps every token among them."""
    prompt = [11, 300, 42, 7, 99]
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    stopped = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first])
    [short] = llm.generate(prompt, stopped)
    assert short.token_ids == [first] and short.finish_reason == "stop"
    held = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first], min_tokens=6)
    [out] = llm.generate(prompt, held)
    assert len(out.token_ids) >= 6 and first not in out.token_ids[:6]
    # a stop string in the text of the first min_tokens tokens does not end it either
    [free] = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop = free.text[:2]
    assert (
        stop
        and llm.generate(
            prompt, SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True)
        )[0].text
        == ""
    )
    [late] = llm.generate(
        prompt,
        SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True, min_tokens=12),
    )
    assert late.text.startswith(stop) and len(late.token_ids) == 12
    allowed = SamplingParams(max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=[50, 60, 70])
    [only] = llm.generate(prompt, allowed)
    assert len(only.token_ids) == 8 and set(only.token_ids) <= {50, 60, 70}
    vocab = len(llm.tokenizer.hf)
    for name in ("allowed_token_ids", "stop_token_ids"):
        with pytest.raises(ValueError, match=f"{name}: token id {vocab} is not in the vocabulary"):
            llm.generate(prompt, SamplingParams(max_tokens=2, **{name: [5, vocab]}))


def test_max_new_tokens_of_the_generation_config_fits_the_context(tiny_dense, tmp_path):
    # generation_config.json's max_new_tokens caps the default params' max_tokens (vLLM); past
    # the room a prompt leaves it shrinks to that room instead of refusing the prompt
    model = shutil.copytree(tiny_dense, tmp_path / "m")
    config = {"temperature": 0.0, "max_new_tokens": 2048}
    (model / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(model), max_model_len=64, num_kv_slots=512)
    assert llm.default_sampling_params().max_tokens == 2048
    prompt = llm.tokenizer.encode("hello world")
    [out] = llm.generate(prompt)
    assert 1 <= len(out.token_ids) <= 64 - len(prompt)
    config["max_new_tokens"] = 3
    (model / "generation_config.json").write_text(json.dumps(config))
    [short] = LLM(str(model), max_model_len=64, num_kv_slots=512).generate(prompt)
    assert len(short.token_ids) <= 3
    with pytest.raises(ValueError, match="2048"):  # asked for explicitly: still refused
        llm.generate(prompt, SamplingParams(max_tokens=2048))


def test_priority_orders_admission_under_the_priority_policy(llm, tiny_dense):
    """vLLM's generate(priority=...): refused on a first-come LLM (0s are fine, one a prompt);
    with scheduling_policy="priority" the lower values are admitted first."""
    prompts = [[11, 300, 42], [7, 99, 5], [3, 1, 4]]
    greedy = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(ValueError, match='scheduling_policy="priority"'):
        llm.generate(prompts, greedy, priority=[1, 0, 0])
    with pytest.raises(ValueError, match="priority: 2 given for 3 prompts"):
        llm.generate(prompts, greedy, priority=[0, 0])
    want = [o.token_ids for o in llm.generate(prompts, greedy, priority=[0, 0, 0])]
    ranked = LLM(str(tiny_dense), scheduling_policy="priority", max_num_seqs=1, num_kv_slots=512)
    admitted = []
    admit = ranked.scheduler._admit
    ranked.scheduler._admit = lambda req: admitted.append(req.priority) or admit(req)
    outs = ranked.generate(prompts, greedy, priority=[5, 0, -3])
    assert admitted == [-3, 0, 5] and [o.token_ids for o in outs] == want


def test_logprobs_mode_raw_by_default_processed_on_request(llm, tiny_dense):
    """vLLM's logprobs_mode through the engine: by default a request's bias does not move its
    logprobs (the model's own: the banned greedy token keeps its logprob among the top); with
    processed_logprobs they are those it was drawn from (the banned token reads the floor)."""
    prompt = [11, 300, 42, 7, 99]
    [free] = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=3))
    token = free.token_ids[0]
    banned = SamplingParams(max_tokens=1, temperature=0, logprobs=3, logit_bias={token: -100})
    [raw] = llm.generate(prompt, banned)
    assert raw.token_ids[0] != token
    assert raw.logprobs[0][token].logprob == pytest.approx(free.logprobs[0][token].logprob)
    processed = LLM(str(tiny_dense), logprobs_mode="processed_logprobs", num_kv_slots=512)
    [out] = processed.generate(prompt, banned)
    assert out.token_ids == raw.token_ids and token not in out.logprobs[0]
    assert out.logprobs[0][out.token_ids[0]].logprob > raw.logprobs[0][raw.token_ids[0]].logprob
