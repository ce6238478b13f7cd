"""A quantised checkpoint served for real: a tiny Qwen3.5 VLM written in llm-compressor's static FP8
layout (per-tensor weight scales, calibrated `input_scale`s) with its vision tower quantised too,
`appliance serve` with MTP on (server, visual server, router, detokenizer, worker as processes).
Text and image requests through the official SDK; greedy text equals the offline `LLM` on the same
folder; the startup log says what was read past."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from PIL import Image

from appliance import LLM, SamplingParams
from appliance.testing.fp8_checkpoint import COMPRESSED_IGNORE, write_fp8_checkpoint
from appliance.testing.tiny import build_qwen3_5
from tests.e2e.live import start_appliance

PROMPT = [11, 300, 42, 7, 99, 5, 6]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_e2e")
    src = build_qwen3_5(root / "src", seed=7)
    ignore = [p for p in COMPRESSED_IGNORE if "visual" not in p]
    options = dict(scales="tensor", activations="static", quantize_visual=True, ignore=ignore)
    return write_fp8_checkpoint(src, root / "vl_fp8", root / "twin", **options)


@pytest.fixture(scope="module")
def app(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("fp8_live") / "appliance.log"
    app = start_appliance(ckpt, log, "--max-num-seqs", "4", "--mtp-step", "1")
    yield app
    code = app.stop()
    assert code == 0, app.log()[-4000:]


@pytest.fixture(scope="module")
def sdk(app):
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)


def test_served_fp8_greedy_equals_offline(ckpt, app, sdk):
    served = sdk.completions.create(
        model=sdk.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    offline = LLM(str(ckpt), max_model_len=512, mtp_step=1).generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    assert served.choices[0].text == offline.text
    assert served.usage.completion_tokens == 12
    assert "static activation scales (input_scale) checked and not used" in app.log()


def test_image_request_on_the_dequantised_vision_tower(sdk):
    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (200, 30, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "colour?"},
    ]
    out = sdk.chat.completions.create(
        model=sdk.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens > 20  # the image's placeholder tokens are in the prompt
