"""The offline API as a vLLM script meets it: vLLM's constructor keywords (None for a default,
trust_remote_code, tokenizer, enable_prefix_caching, seed), prompt dicts, use_tqdm, max_tokens
None, the output fields (request_id, stop_reason, cumulative_logprob, logprobs as {id: Logprob}
dicts), structured_outputs / guided_decoding, chat's chat_template and continue_final_message,
get_tokenizer and the pooling methods' refusal."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from appliance import LLM, SamplingParams

OPTS = dict(max_num_seqs=4, num_kv_slots=2048, max_model_len=256)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dense):
    return LLM(str(tiny_dense), **OPTS)


def test_vllm_constructor_keywords(tiny_dense):
    """None means the default (vLLM's argparse defaults pass quantization=None ...);
    trust_remote_code is taken (no remote code ever runs); tokenizer may name the model itself;
    enable_prefix_caching is prefix_caching; seed seeds the sampling of unseeded requests, so
    two runs of a script sample alike."""
    model = str(tiny_dense)
    nones = dict(quantization=None, max_model_len=None, kv_cache_dtype=None, revision=None)
    with LLM(model, **nones, tokenizer=model, trust_remote_code=True) as llm:
        assert llm.config.model.quantization == "" and llm.config.model.max_model_len == 0
    off = LLM(model, enable_prefix_caching=False, **OPTS)
    assert not off.config.scheduler.prefix_caching
    with pytest.raises(ValueError, match="tokenizer: .* differs from the model"):
        LLM(model, tokenizer="Qwen/Qwen3-8B", **OPTS)
    free = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = [LLM(model, seed=3, **OPTS).generate([[5, 6, 7]] * 2, free) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def test_prompt_dicts_and_use_tqdm(llm):
    ids = llm.tokenizer.encode("def main():")
    want = llm.generate(ids, GREEDY)[0].token_ids
    tokens = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert len(tokens) == 1 and tokens[0].token_ids == want
    text, both = llm.generate([{"prompt": "def main():"}, {"prompt_token_ids": ids}], GREEDY)
    assert text.prompt == "def main():" and text.token_ids == both.token_ids == want
    with pytest.raises(ValueError, match="prompt 0: image 0: expected a PIL.Image"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}}, GREEDY)
    with pytest.raises(ValueError, match="prompt: lora_request is not supported"):
        llm.generate({"prompt": "hi", "lora_request": None}, GREEDY)


def test_a_prompt_dicts_cache_salt_keeps_its_prefixes_to_its_salt(llm):
    """vLLM's {"cache_salt": ...} in a prompt dict: a prompt hits the cached head of an earlier
    one only under the same salt; an empty salt is refused."""
    head = list(range(300, 340))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def hits(salt: str, tail: list[int]) -> int:
        before = llm.scheduler.stats().prefix_cache_hits
        llm.generate({"prompt_token_ids": head + tail, "cache_salt": salt}, one, use_tqdm=False)
        return llm.scheduler.stats().prefix_cache_hits - before

    assert hits("x", []) == 0  # caches head (its prompt-end state)
    assert hits("y", [5, 6]) == 0
    assert hits("x", [7, 8]) == len(head)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": "hi", "cache_salt": ""}, GREEDY)


def test_repetition_detection_offline(llm):
    """vLLM's repetition_detection offline: finish_reason "repetition", stop_reason as vLLM's."""
    looping = dict(max_tokens=20, temperature=0, logit_bias={42: 100.0})
    detect = {"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 5}
    [out] = llm.generate([5, 6, 7], SamplingParams(**looping, repetition_detection=detect))
    assert out.token_ids == [42] * 5
    assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")


def test_max_tokens_none_runs_to_the_end_of_the_context(llm):
    prompt = [5, 6, 7]
    [out] = llm.generate(prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 256 - len(prompt) and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_outputs_carry_vllm_fields(llm):
    """request_id, stop_reason (the stop id or string; None for a length finish),
    cumulative_logprob, and logprobs / prompt_logprobs as vLLM's {id: Logprob} dicts: the token
    itself and the top alternatives, ranked."""
    prompt = [11, 300, 42, 7, 99]
    scored = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    [out] = llm.generate(prompt, replace(scored, prompt_logprobs=1))
    assert out.request_id and out.stop_reason is None and out.finish_reason == "length"
    assert len(out.logprobs) == 8
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert token_id in entry and 2 <= len(entry) <= 3
        assert entry[token_id].rank == 1  # greedy: the most likely
        assert entry[token_id].decoded_token == llm.tokenizer.decode([token_id])
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank is not None)
        assert [r for r, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
    chosen = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert all(t in entry for t, entry in zip(prompt[1:], out.prompt_logprobs[1:]))
    assert llm.generate(prompt, GREEDY)[0].cumulative_logprob is None
    stop_id = out.token_ids[3]
    stopped = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id])
    assert llm.generate(prompt, stopped)[0].stop_reason == stop_id
    stop = out.text[len(out.text) // 2 :][:2]
    for keep in (False, True):
        params = SamplingParams(
            max_tokens=8,
            temperature=0,
            ignore_eos=True,
            stop=["@@", stop],
            include_stop_str_in_output=keep,
        )
        [cut] = llm.generate(prompt, params)
        assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)


def test_structured_outputs_and_guided_decoding(llm):
    """vLLM's structured_outputs (and its older guided_decoding), as a dict or an object with its
    attributes: the same guides the server makes of the request field."""

    class Params:  # vLLM's StructuredOutputsParams shape
        def __init__(self, **given):
            self.__dict__.update(given)

    free = dict(max_tokens=40, temperature=1.0, seed=1)
    prompt = [5, 6, 7]
    [pick] = llm.generate(prompt, SamplingParams(structured_outputs={"choice": ["yes", "no"]}))
    assert pick.text in ("yes", "no")
    [digits] = llm.generate(
        prompt, SamplingParams(guided_decoding=Params(regex="[0-9]{3}"), **free)
    )
    assert len(digits.text) == 3 and digits.text.isdigit()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    [obj] = llm.generate(prompt, SamplingParams(structured_outputs={"json": schema}, **free))
    assert isinstance(json.loads(obj.text)["a"], int)
    with pytest.raises(ValueError, match="structured_outputs: expected exactly one of json"):
        llm.generate(prompt, SamplingParams(structured_outputs={"jsn": schema}))
    with pytest.raises(ValueError, match="guided_decoding: regex: regex lookahead"):
        llm.generate(prompt, SamplingParams(guided_decoding={"regex": "(?=a)b"}))
    with pytest.raises(ValueError, match="structured_outputs and guided_decoding: only one"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})


def test_chat_template_and_continue_final_message(llm):
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"}]
    hf = llm.get_tokenizer()
    assert hf is llm.tokenizer.hf
    [cont] = llm.chat(talk, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert hf.decode(cont.prompt_token_ids).endswith("</think>\n\nThe answer")  # left open
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    [own] = llm.chat(talk, GREEDY, use_tqdm=False, chat_template=template)
    assert hf.decode(own.prompt_token_ids) == "[hi][The answer]"
    with pytest.raises(ValueError, match="continue_final_message: set add_generation_prompt"):
        llm.chat(talk, GREEDY, continue_final_message=True)


def test_vllm_helpers_and_the_pooling_methods_refused(llm):
    assert llm.get_default_sampling_params() == llm.default_sampling_params()
    for name in ("encode", "embed", "classify", "score", "reward"):
        with pytest.raises(NotImplementedError, match=f"LLM.{name}: pooling"):
            getattr(llm, name)("hi")


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's SamplingParams.truncate_prompt_tokens: the prompt's last k tokens are fed (-1: the
    context length); the same tokens untruncated generate the same greedy text."""
    ids = list(range(10, 40))
    cut = llm.generate([ids], replace(GREEDY, truncate_prompt_tokens=5))[0]
    whole = llm.generate([ids[-5:]], GREEDY)[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.token_ids == whole.token_ids
    assert (
        llm.generate([ids], replace(GREEDY, truncate_prompt_tokens=-1))[0].prompt_token_ids == ids
    )
    chat = [{"role": "user", "content": "hello there, how are you today?"}]
    full = llm.chat(chat, GREEDY)[0].prompt_token_ids
    assert (
        llm.chat(chat, replace(GREEDY, truncate_prompt_tokens=4))[0].prompt_token_ids == full[-4:]
    )
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([ids], replace(GREEDY, truncate_prompt_tokens=257))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_reset_prefix_cache(llm, tiny_dense):
    """vLLM's LLM.reset_prefix_cache: a second turn hits the first until the cache is reset;
    False with prefix caching off."""
    prompt = list(range(50, 90))
    first = llm.generate([prompt], GREEDY)[0].token_ids
    turn2 = prompt + first + [11, 12, 13]
    hits = llm.scheduler.stats().prefix_cache_hits
    llm.generate([turn2], GREEDY)
    assert llm.scheduler.stats().prefix_cache_hits > hits
    assert llm.reset_prefix_cache() is True
    assert llm.scheduler.stats().prefix_cache_tokens == 0
    hits = llm.scheduler.stats().prefix_cache_hits
    llm.generate([turn2 + [14]], GREEDY)
    assert llm.scheduler.stats().prefix_cache_hits == hits
    with LLM(str(tiny_dense), enable_prefix_caching=False, **OPTS) as off:
        assert off.reset_prefix_cache() is False
