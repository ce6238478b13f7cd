"""`--chat-template` (vLLM's flag): a file or the template text renders every chat request (and
/tokenize) instead of the checkpoint's, also for a checkpoint without one; a value that is no file
and no template, or a template that does not parse, is one line before anything starts."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from transformers import AutoTokenizer

from appliance.chat_template import ChatTemplateError, load_chat_template
from appliance.cli import main
from tests.e2e.live import free_port, start_appliance

# renders each message as [role] content, then an open assistant turn
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MSG = [{"role": "user", "content": "hello there"}]


def test_load_chat_template_reads_a_file_or_the_text(tmp_path):
    assert load_chat_template("") is None
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == (TEMPLATE, str(path))
    assert load_chat_template(TEMPLATE)[0] == TEMPLATE
    with pytest.raises(ChatTemplateError, match="no such file, and not a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match=r"not a valid Jinja template \(line 1"):
        load_chat_template("{% for m in messages %}{{ m.content }}")  # no endfor
    path.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ChatTemplateError, match="cannot read it"):
        load_chat_template(str(path))


@pytest.mark.parametrize(
    "value, expected",
    [
        ("/no/such/t.jinja", "no such file, and not a Jinja template either"),
        ("{% if x %}open", "is not a valid Jinja template"),
    ],
)
def test_a_bad_chat_template_is_one_line_before_starting(capsys, tiny_dense, value, expected):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tiny_dense), "--port", str(free_port()), "--chat-template", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("appliance serve: error: --chat-template") and expected in err
    assert err.count("\n") == 1


def test_served_chat_renders_with_the_given_template(tiny_dense, tmp_path):
    """The checkpoint has no chat template of its own here: the flag's alone serves chat."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dense, ckpt)
    for name in ("chat_template.jinja", "chat_template.json"):
        (ckpt / name).unlink(missing_ok=True)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(str(ckpt)).chat_template is None
    template = tmp_path / "plain.jinja"
    template.write_text(TEMPLATE)
    app = start_appliance(ckpt, tmp_path / "log.txt", "--chat-template", str(template))
    try:
        counted = httpx.post(f"{app.url}/tokenize", json={"messages": MSG}, timeout=30).json()
        rendered = httpx.post(
            f"{app.url}/detokenize", json={"tokens": counted["tokens"]}, timeout=30
        ).json()["prompt"]
        assert rendered == "[user] hello there\n[assistant]"
        body = {"messages": MSG, "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == counted["count"]
        assert "(--chat-template), not the checkpoint's" in app.log()
    finally:
        assert app.stop() == 0


def test_default_chat_template_kwargs_render_unless_a_request_says(tiny_dense, tmp_path, capsys):
    """--default-chat-template-kwargs (vLLM's and SGLang's): chat requests (and /tokenize of
    messages) render with them, a request's own chat_template_kwargs win; a value that is not a
    JSON object, or a switch that is not a boolean, is one line before anything starts."""
    for bad in ("[1]", '{"enable_thinking": "no"}', "{oops"):
        with pytest.raises(SystemExit):
            main(["serve", str(tiny_dense), "--default-chat-template-kwargs", bad])
        assert "--default-chat-template-kwargs" in capsys.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(tiny_dense)

    def rendered(**switches) -> str:
        return tokenizer.apply_chat_template(
            MSG, add_generation_prompt=True, tokenize=False, **switches
        )

    assert rendered(enable_thinking=False) != rendered()
    app = start_appliance(
        tiny_dense,
        tmp_path / "log.txt",
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
    )
    try:

        def prompt(**body) -> str:
            counted = httpx.post(f"{app.url}/tokenize", json={"messages": MSG, **body}, timeout=30)
            ids = counted.json()["tokens"]
            return httpx.post(f"{app.url}/detokenize", json={"tokens": ids}, timeout=30).json()[
                "prompt"
            ]

        assert prompt() == rendered(enable_thinking=False)
        on = {"chat_template_kwargs": {"enable_thinking": True}}
        assert prompt(**on) == rendered(enable_thinking=True)
        body = {"messages": MSG, "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        want = len(tokenizer.encode(rendered(enable_thinking=False), add_special_tokens=False))
        assert r.json()["usage"]["prompt_tokens"] == want
        assert r.json()["choices"][0]["message"].get("reasoning_content") is None
    finally:
        assert app.stop() == 0
