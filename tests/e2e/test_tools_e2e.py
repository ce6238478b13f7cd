"""Tool calls and reasoning through a live appliance and the official `openai` SDK (issue 8).

The tiny checkpoint's generations are forced by `appliance.testing.forced.ForcedRunner` (the real
forward runs; the logits are masked to the scripted token ids, which come from tokenizing the target
text with the checkpoint's BPE tokenizer). The server and its parsers see ordinary model output.
"""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from appliance.testing.forced import forced_copy
from tests.e2e.live import start_appliance

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
MODEL = "tiny-forced"  # the served name: the model folder's name


def _tool(name: str, description: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
            "strict": True,  # the SDK's stream helper parses only strict tools
        },
    }


TOOLS = [
    _tool(
        "get_weather",
        "Weather forecast for a city.",
        {"city": {"type": "string"}, "days": {"type": "integer"}},
    ),
    _tool("get_time", "Local time in a time zone.", {"timezone": {"type": "string"}}),
]

WEATHER_CALL = (
    "<tool_call><function=get_weather><parameter=city>\nParis\n</parameter>"
    "<parameter=days>\n3\n</parameter></function></tool_call>"
)
TWO_CALLS_TEXT = "I will look both up."
TWO_CALLS = (
    f"{TWO_CALLS_TEXT}\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n<function=get_time>\n"
    "<parameter=timezone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>"
)
THOUGHT = "A forecast for São Paulo."
THINK_CALL = (
    f"{THOUGHT}\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
ANSWER = "It is 18 degrees and sunny in Paris."
# the canonical form, as the grammar of tool_choice "required" writes it
CANONICAL_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
SCRIPTS = {  # prompt trigger -> forced model output
    "[case:weather]": WEATHER_CALL,
    "[case:canonical]": CANONICAL_CALL,
    "[case:two]": TWO_CALLS,
    "[case:think]": THINK_CALL,
    "[case:answer]": ANSWER,
}
PARIS = ("get_weather", {"city": "Paris", "days": 3})
PARIS_TIME = ("get_time", {"timezone": "Europe/Paris"})
SAO_PAULO = ("get_weather", {"city": "São Paulo", "days": 2})


def _user(trigger: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather like? {trigger}"}]


@pytest.fixture(scope="module")
def forced_model(tiny_dense, tmp_path_factory):
    """A copy of the tiny checkpoint (files linked) plus the forced-output scripts."""
    return forced_copy(tiny_dense, tmp_path_factory.mktemp("forced") / MODEL, SCRIPTS)


@pytest.fixture(scope="module")
def live(forced_model, tmp_path_factory):
    app = start_appliance(
        forced_model,
        tmp_path_factory.mktemp("live_tools") / "appliance.log",
        "--runner",
        "appliance.testing.forced:ForcedRunner",
        max_model_len=1024,
    )
    yield app
    code = app.stop()
    assert code == 0, app.log()[-4000:]


@pytest.fixture(scope="module")
def sdk(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(forced_model):
    return AutoTokenizer.from_pretrained(str(forced_model))


def test_scripts_are_the_tokenized_targets(forced_model, tokenizer):
    data = json.loads((forced_model / "forced_outputs.json").read_text())
    assert [s["trigger"] for s in data["scripts"]] == list(SCRIPTS)
    for script in data["scripts"]:
        ids = tokenizer.encode(script["text"], add_special_tokens=False)
        assert script["token_ids"] == ids and len(ids) > 10
        assert tokenizer.decode(ids) == SCRIPTS[script["trigger"]]
    assert data["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def _stream(sdk, model: str, messages: list[dict], extra_body: dict, **kw):
    """Streams through the SDK's accumulating helper; returns (raw chunks, arguments snapshots per
    index as the SDK accumulated them, the SDK's final completion)."""
    chunks, snapshots = [], {}
    with sdk.chat.completions.stream(
        model=model, messages=messages, tools=TOOLS, temperature=0, extra_body=extra_body, **kw
    ) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
            elif event.type == "tool_calls.function.arguments.delta":
                snapshots.setdefault(event.index, []).append(event.arguments)
        final = stream.get_final_completion()
    return chunks, snapshots, final


def _check_stream(chunks, snapshots, final, expected: list[tuple[str, dict]]) -> tuple[str, str]:
    """Checks the raw deltas and the SDK accumulation against the expected calls; returns the
    streamed (content, reasoning)."""
    targets = [json.dumps(args) for _, args in expected]
    accumulated = {i: "" for i in range(len(expected))}
    heads: dict[int, tuple[str, str]] = {}
    content, reasoning, finish = "", "", []
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index == 0
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                assert call.index in accumulated, call
                if call.index not in heads:  # the first fragment names the call
                    assert call.id and call.id.startswith("call_") and call.type == "function"
                    heads[call.index] = (call.id, call.function.name)
                else:
                    assert call.id is None and call.function.name is None
                accumulated[call.index] += call.function.arguments or ""
                assert targets[call.index].startswith(accumulated[call.index])
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    assert finish == ["tool_calls"]
    assert [accumulated[i] for i in range(len(expected))] == targets
    assert [heads[i][1] for i in range(len(expected))] == [name for name, _ in expected]
    assert len({call_id for call_id, _ in heads.values()}) == len(expected)
    # the SDK's own accumulation: every intermediate snapshot is a prefix, the final one is exact
    assert sorted(snapshots) == list(range(len(expected)))
    for index, seen in snapshots.items():
        assert all(targets[index].startswith(s) for s in seen)
        assert seen[-1] == targets[index]
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name) for c in message.tool_calls] == [
        heads[i] for i in range(len(expected))
    ]
    assert [c.function.arguments for c in message.tool_calls] == targets
    assert [c.function.parsed_arguments for c in message.tool_calls] == [a for _, a in expected]
    return content, reasoning


def _check_message(choice, expected: list[tuple[str, dict]], content: str | None) -> None:
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", n) for n, _ in expected]
    assert [c.function.arguments for c in calls] == [json.dumps(a) for _, a in expected]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)


def test_one_call_stream_and_non_stream(sdk, tokenizer):
    messages = _user("[case:weather]")
    chunks, snapshots, final = _stream(sdk, MODEL, messages, NO_THINK)
    content, reasoning = _check_stream(chunks, snapshots, final, [PARIS])
    assert (content, reasoning) == ("", "")
    out = sdk.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, extra_body=NO_THINK
    )
    _check_message(out.choices[0], [PARIS], None)
    scripted = tokenizer.encode(WEATHER_CALL, add_special_tokens=False)
    assert out.usage.completion_tokens == len(scripted) + 1  # the script, then the forced EOS


def test_a_required_call_under_its_grammar(sdk):
    """tool_choice "required" samples under a grammar, behind the step in flight (its sampling
    is launched when that step is collected, in inference mode as the rest of the step): the
    scripted canonical call passes the grammar whole."""
    out = sdk.chat.completions.create(
        model=MODEL,
        messages=_user("[case:canonical]"),
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        extra_body=NO_THINK,
    )
    _check_message(out.choices[0], [PARIS], None)


def test_two_functions_in_one_block_after_text(sdk):
    messages = _user("[case:two]")
    chunks, snapshots, final = _stream(sdk, MODEL, messages, NO_THINK)
    content, reasoning = _check_stream(chunks, snapshots, final, [PARIS, PARIS_TIME])
    assert (content, reasoning) == (TWO_CALLS_TEXT, "")
    assert final.choices[0].message.content == TWO_CALLS_TEXT
    out = sdk.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, extra_body=NO_THINK
    )
    _check_message(out.choices[0], [PARIS, PARIS_TIME], TWO_CALLS_TEXT)


def test_reasoning_then_call(sdk):
    messages = _user("[case:think]")
    chunks, snapshots, final = _stream(sdk, MODEL, messages, THINK)
    content, reasoning = _check_stream(chunks, snapshots, final, [SAO_PAULO])
    assert (content, reasoning) == ("", THOUGHT)
    out = sdk.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, extra_body=THINK
    )
    _check_message(out.choices[0], [SAO_PAULO], None)
    assert out.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    assert '"S\\u00e3o Paulo"' in out.choices[0].message.tool_calls[0].function.arguments


def test_tool_choice_none_gives_raw_text(sdk):
    out = sdk.chat.completions.create(
        model=MODEL,
        messages=_user("[case:weather]"),
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        extra_body=NO_THINK,
    )
    choice = out.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (WEATHER_CALL, None)
    assert choice.finish_reason == "stop"


def test_tool_results_in_history_render_through_the_template(sdk, tokenizer):
    arguments = {"city": "Paris", "days": 3}
    history = [
        *_user("[case:weather]"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123", "content": "18 degrees, sunny [case:answer]"},
    ]
    out = sdk.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, extra_body=NO_THINK
    )
    choice = out.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (ANSWER, None)
    assert choice.finish_reason == "stop"
    # The prompt is the template's rendering with the call's arguments as a mapping (the form
    # Qwen templates iterate over), so its length is known exactly.
    rendered = json.loads(json.dumps(history))
    rendered[1]["tool_calls"][0]["function"]["arguments"] = arguments
    text = tokenizer.apply_chat_template(
        rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert "<parameter=city>\nParis\n</parameter>" in text and "<tool_response>" in text
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    first = sdk.chat.completions.create(
        model=MODEL,
        messages=history[:1],
        tools=TOOLS,
        max_tokens=1,
        extra_body=NO_THINK,
    )
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 20
