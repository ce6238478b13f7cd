"""The offline `LLM` takes images as vLLM's does (prompt dicts with `multi_modal_data`, chat image
parts): greedy text equals the served appliance's /v1/chat/completions for the same image and
conversation (a tiny Qwen3-VL, one live appliance); the prompt-dict, image_url, image_pil and bytes
forms agree; bad input is a ValueError naming the prompt, and no embedding entry or shared-memory
segment outlives a call."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from appliance import LLM, SamplingParams
from appliance.offline.prompts import PLACEHOLDER
from appliance.testing.tiny_vl import build_tiny_qwen3_vl
from tests.e2e.live import start_appliance

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NO_THINK = {"enable_thinking": False}
OPTS = dict(max_num_seqs=4, num_kv_slots=2048, max_model_len=1024)


def random_png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def image_parts(pngs: list[bytes]) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_uri(png)}} for png in pngs]


def user(question: str, parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


PNG_A, PNG_B = random_png(64, 48, 1), random_png(40, 72, 2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "vl_offline"
    return build_tiny_qwen3_vl(out, tokenizer="bpe", seed=7)


@pytest.fixture(scope="module")
def sdk(ckpt, tmp_path_factory):
    app = start_appliance(ckpt, tmp_path_factory.mktemp("vl_live") / "appliance.log")
    yield openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)
    assert app.stop() == 0, app.log()[-4000:]


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(str(ckpt), **OPTS) as llm:
        yield llm


def served(sdk, messages: list[dict]) -> str:
    out = sdk.chat.completions.create(
        model=sdk.models.list().data[0].id,
        messages=messages,
        max_tokens=GREEDY.max_tokens,
        temperature=0,
        extra_body={"chat_template_kwargs": NO_THINK, "ignore_eos": True},
    )
    return out.choices[0].message.content


def prompt_text(llm, num_images: int, question: str) -> str:
    """The chat template's rendering, which holds PLACEHOLDER once per image (vLLM's examples)."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        **NO_THINK,
    )


def assert_nothing_held(llm) -> None:
    stats = llm.scheduler.stats()
    assert stats.kv_used == 0 and stats.num_running == 0
    assert llm.images().num_entries == 0
    assert not list(Path("/dev/shm").glob(f"apimg{os.getpid()}_*"))


def test_text_only_calls_do_not_load_the_vision_tower(llm):
    [out] = llm.generate("Hello there", GREEDY)
    [chat] = llm.chat([{"role": "user", "content": "Hello"}], GREEDY, chat_template_kwargs=NO_THINK)
    assert len(out.token_ids) == len(chat.token_ids) == GREEDY.max_tokens
    assert llm._images is None or llm._images._encoder is None


def test_vision_off_takes_no_images_and_loads_no_vit(ckpt):
    """vision=False (and vLLM's language_model_only / limit_mm_per_prompt image 0): text as
    usual, image prompts a ValueError saying so, no ViT. On CPU the ViT is not loaded up front
    either way (nothing is sized from free memory): reserve_vit holds nothing."""
    from appliance.offline.images import reserve_vit

    for off in (dict(vision=False), dict(language_model_only=True)):
        with LLM(str(ckpt), **off, **OPTS) as text_only:
            assert text_only.runner.reserved_bytes == 0
            [out] = text_only.generate("Hello there", GREEDY)
            assert len(out.token_ids) == GREEDY.max_tokens
            image = {"prompt": prompt_text(text_only, 1, "Describe."), "multi_modal_data": {}}
            image["multi_modal_data"]["image"] = PNG_A
            with pytest.raises(ValueError, match=r"takes no images \(vision=False\)"):
                text_only.generate(image, GREEDY)
            assert text_only.images()._encoder is None
    with LLM(str(ckpt), limit_mm_per_prompt={"image": 0}, **OPTS) as none:
        assert none.vision is False
    assert reserve_vit(str(ckpt), _cpu_config(ckpt), True) == (None, 0)


def _cpu_config(ckpt):
    from appliance.offline.options import build_engine_config

    return build_engine_config(str(ckpt), 1, {"device": "cpu"})


def test_one_image_matches_the_served_appliance_in_every_form(llm, sdk):
    messages = user("What is in the picture?", image_parts([PNG_A]))
    want = served(sdk, messages)
    [chat] = llm.chat(messages, GREEDY, chat_template_kwargs=NO_THINK)
    assert chat.text == want and len(chat.token_ids) == GREEDY.max_tokens
    pil = Image.open(io.BytesIO(PNG_A))
    as_pil = user("What is in the picture?", [{"type": "image_pil", "image_pil": pil}])
    [chat_pil] = llm.chat(as_pil, GREEDY, chat_template_kwargs=NO_THINK)
    text = prompt_text(llm, 1, "What is in the picture?")
    assert text.count(PLACEHOLDER) == 1
    by_pil, by_bytes = llm.generate(
        [
            {"prompt": text, "multi_modal_data": {"image": pil}},
            {"prompt": text, "multi_modal_data": {"image": [PNG_A]}},
        ],
        GREEDY,
    )
    ids = llm.tokenizer.encode(text)
    [by_ids] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": pil}}, GREEDY)
    assert chat_pil.text == by_pil.text == by_bytes.text == by_ids.text == want
    assert by_pil.prompt_token_ids == chat.prompt_token_ids  # the image's tokens expanded alike
    assert assert_nothing_held(llm) is None


def test_two_images_in_one_prompt_and_n_choices(llm, sdk):
    messages = user("Compare them.", image_parts([PNG_A, PNG_B]))
    want = served(sdk, messages)
    [chat] = llm.chat(messages, GREEDY, chat_template_kwargs=NO_THINK)
    text = prompt_text(llm, 2, "Compare them.")
    two = SamplingParams(n=2, max_tokens=8, temperature=0, ignore_eos=True)
    [out] = llm.generate({"prompt": text, "multi_modal_data": {"image": [PNG_A, PNG_B]}}, two)
    assert chat.text == want == out.outputs[0].text == out.outputs[1].text
    swapped = llm.generate({"prompt": text, "multi_modal_data": {"image": [PNG_B, PNG_A]}}, GREEDY)
    assert swapped[0].prompt_token_ids != out.prompt_token_ids  # other grids, other lengths
    assert_nothing_held(llm)


def test_bad_input_is_a_value_error_naming_the_prompt(llm):
    text = prompt_text(llm, 1, "Describe.")
    good = {"prompt": text, "multi_modal_data": {"image": PNG_A}}
    with pytest.raises(ValueError, match="prompt 1: 1 image placeholders for 2 images"):
        llm.generate([good, {"prompt": text, "multi_modal_data": {"image": [PNG_A, PNG_B]}}])
    with pytest.raises(ValueError, match="prompt 0: 0 image placeholders for 1 images"):
        llm.generate({"prompt": "no slot here", "multi_modal_data": {"image": PNG_A}})
    with pytest.raises(ValueError, match="prompt 2: image 0: .*not a supported image"):
        llm.generate([good, good, {"prompt": text, "multi_modal_data": {"image": b"nope"}}])
    with pytest.raises(ValueError, match="prompt 0: multi_modal_data.video is not supported"):
        llm.generate({"prompt": text, "multi_modal_data": {"video": PNG_A}})
    with pytest.raises(ValueError, match="mm_processor_kwargs.fps: not supported"):
        llm.generate({**good, "mm_processor_kwargs": {"fps": 2}})
    broken = user(
        "Describe.", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    )
    with pytest.raises(ValueError, match="messages: image 0: "):
        llm.chat(broken, GREEDY)
    assert_nothing_held(llm)
    [out] = llm.generate(good, GREEDY)  # still serving
    assert len(out.token_ids) == GREEDY.max_tokens
    assert_nothing_held(llm)


def test_tp2_worker_processes_read_shared_memory(llm, ckpt):
    messages = user("What is in the picture?", image_parts([PNG_A, PNG_B]))
    [want] = llm.chat(messages, GREEDY, chat_template_kwargs=NO_THINK)
    with LLM(str(ckpt), tp=2, **OPTS) as tp2:
        [got] = tp2.chat(messages, GREEDY, chat_template_kwargs=NO_THINK)
        assert got.token_ids == want.token_ids
        assert_nothing_held(tp2)
