"""The API server's image handling (appliance/server/images.py + prompts.py): which checkpoints take
images, data: URIs and guarded http(s) fetches, the 400s for bad images, and the expansion of the
chat template's one <|image_pad|> per image into t*h*w/merge^2 tokens at the right offsets."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import threading

import pytest
from transformers import AutoTokenizer

from appliance.config import VisualConfig
from appliance.metrics import MetricsRecorder
from appliance.server.errors import BadRequest
from appliance.server.images import (
    expand_image_tokens,
    image_key,
    image_support,
    load_images,
    request_preprocess,
)
from appliance.server.prompts import PromptBuilder
from appliance.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    sampling_params,
)
from appliance.testing.tiny_vl import build_tiny_qwen3_vl
from tests.visual.conftest import random_image
from tests.visual.test_image_fetch import PNG as SERVED_PNG
from tests.visual.test_image_fetch import Handler, QuietServer
from tests.visual.test_image_io import encode, png_header_only
from visual.preprocess import image_grid

CONFIG = VisualConfig()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(build_tiny_qwen3_vl(tmp_path_factory.mktemp("vl_bpe"), tokenizer="bpe", seed=4))


@pytest.fixture(scope="module")
def http_server():
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png(width: int, height: int, seed: int) -> bytes:
    return encode(random_image(width, height, seed), "PNG")


def message(*parts, role: str = "user") -> ChatMessage:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": p}
        for p in parts
    ]
    return ChatMessage.model_validate({"role": role, "content": content})


def load(ckpt: str, messages, config: VisualConfig = CONFIG, metrics=None):
    return asyncio.run(load_images(image_support(ckpt, config), messages, metrics))


def test_support_follows_the_checkpoint_and_the_flag(ckpt, tiny_dense, tmp_path):
    assert image_support(ckpt, CONFIG).enabled
    assert image_support(str(tiny_dense), CONFIG).enabled  # Qwen3.5 VLM layout
    assert not image_support(ckpt, VisualConfig(vision=False)).enabled
    assert not image_support(str(tmp_path), CONFIG).enabled  # no config.json
    msgs = [message("hi", {"url": data_uri(png(32, 32, 0))})]
    with pytest.raises(BadRequest, match="image input is not supported") as info:
        load(ckpt, msgs, VisualConfig(vision=False))
    assert info.value.status == 400 and info.value.param == "messages"


def test_data_uris_across_turns_with_keys_grids_and_timings(ckpt):
    a, b = png(64, 48, 1), png(100, 30, 2)
    msgs = [
        message("first", {"url": data_uri(a), "detail": "high"}),
        message("ok", role="assistant"),
        message({"url": data_uri(b)}, "and", {"url": data_uri(a), "detail": "low"}),
    ]
    metrics = MetricsRecorder("tiny")
    images = load(ckpt, msgs, metrics=metrics)
    preprocess = image_support(ckpt, CONFIG).preprocess
    assert [i.data for i in images] == [a, b, a]
    digest = hashlib.blake2b(a, digest_size=16).hexdigest()
    assert images[0].key == images[2].key == f"{digest}_1x4x4"  # content hash + grid
    assert images[1].key != images[0].key
    assert images[1].grid_thw == image_grid(30, 100, preprocess)
    assert [i.num_tokens for i in images] == [
        t * h * w // 4 for t, h, w in (i.grid_thw for i in images)
    ]
    count = metrics.registry.get_sample_value(
        "appliance_image_stage_seconds_count", {"model_name": "tiny", "stage": "fetch_decode"}
    )
    assert count == 3


def test_http_image_is_fetched_when_allowed(ckpt, http_server):
    url = f"{http_server}/img.png"
    allowed = dataclasses.replace(CONFIG, image_fetch_allowed_networks="10.0.0.0/8, 127.0.0.1/32")
    (image,) = load(ckpt, [message("look", {"url": url})], allowed)
    assert image.data == SERVED_PNG
    with pytest.raises(BadRequest, match="non-public address"):
        load(ckpt, [message({"url": url})])  # loopback refused without the allow-list


@pytest.mark.parametrize(
    "url,reason",
    [
        (data_uri(png(32, 32, 3)[:1500]), "could not decode PNG"),  # truncated PNG
        (data_uri(b"definitely not an image"), "not a supported image"),
        (data_uri(png_header_only(50000, 50000)), "pixels"),  # decompression-bomb header
        ("ftp://example.com/cat.png", "unsupported image URL scheme ftp"),
        ("http://10.1.2.3/cat.png", "non-public address"),
        ("http://169.254.169.254/latest/meta-data", "non-public address"),
        ("data:text/plain;base64,aGVsbG8=", "media type"),
    ],
)
def test_bad_images_are_400s_with_the_reason(ckpt, url, reason):
    msgs = [message("fine", {"url": data_uri(png(32, 32, 0))}, "bad", {"url": url})]
    with pytest.raises(BadRequest) as info:
        load(ckpt, msgs)
    assert info.value.status == 400 and info.value.param == "messages"
    assert "image 2:" in str(info.value) and reason in str(info.value)
    fetched = url.startswith(("http", "ftp"))  # a URL that could not be fetched, or a bad file
    assert info.value.code == ("invalid_image_url" if fetched else "invalid_image")


def test_too_many_images(ckpt):
    one = {"url": data_uri(png(32, 32, 0))}
    config = dataclasses.replace(CONFIG, max_images_per_request=2)
    assert len(load(ckpt, [message(one, one)], config)) == 2
    with pytest.raises(BadRequest, match="3 images; at most 2"):
        load(ckpt, [message(one), message(one, one)], config)


def test_prompt_expands_each_placeholder_to_its_tokens(ckpt):
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    support = image_support(ckpt, CONFIG)
    pad = support.image_token_id
    assert pad == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    a, b = png(64, 64, 5), png(200, 40, 6)
    msgs = [
        message("one", {"url": data_uri(a)}),
        message("seen", role="assistant"),
        message({"url": data_uri(b)}, "two"),
    ]
    images = load(ckpt, msgs)
    builder = PromptBuilder(tokenizer, max_model_len=512)
    prompt = builder.chat(msgs, None, {"enable_thinking": False}, True, images, pad)
    # the same conversation rendered by hand: one placeholder per image, then expanded
    hand = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "image"}]},
        {"role": "assistant", "content": "seen"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "two"}]},
    ]
    text = tokenizer.apply_chat_template(
        hand, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.text == text and text.count("<|image_pad|>") == 2
    single = tokenizer.encode(text, add_special_tokens=False)
    first = single.index(pad)
    second = single.index(pad, first + 1)
    n_a, n_b = images[0].num_tokens, images[1].num_tokens
    expected = (
        single[:first]
        + [pad] * n_a
        + single[first + 1 : second]
        + [pad] * n_b
        + single[second + 1 :]
    )
    assert prompt.token_ids == expected
    offsets = [d.offset for d in prompt.images]
    assert offsets == [first, second - 1 + n_a]
    for data, image in zip(prompt.images, images):
        assert data.key == image.key and data.grid_thw == image.grid_thw
        run = prompt.token_ids[data.offset : data.offset + image.num_tokens]
        assert run == [pad] * image.num_tokens
        assert prompt.token_ids[data.offset - 1] == tokenizer.convert_tokens_to_ids(
            "<|vision_start|>"
        )
        assert prompt.token_ids[data.offset + image.num_tokens] == tokenizer.convert_tokens_to_ids(
            "<|vision_end|>"
        )


def test_placeholder_count_must_match_and_context_counts_image_tokens(ckpt):
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    support = image_support(ckpt, CONFIG)
    images = load(ckpt, [message({"url": data_uri(png(128, 128, 7))})])
    with pytest.raises(BadRequest, match="2 image placeholders for 1 images"):
        pad = support.image_token_id
        expand_image_tokens([5, pad, pad], pad, images)
    msgs = [message("hello", {"url": data_uri(png(128, 128, 7))})]
    without = PromptBuilder(tokenizer, max_model_len=512).chat(
        msgs, None, None, True, images, support.image_token_id
    )
    limit = len(without.token_ids) - images[0].num_tokens + 2  # room for the unexpanded prompt
    with pytest.raises(BadRequest, match="maximum context length"):
        PromptBuilder(tokenizer, max_model_len=limit).chat(
            msgs, None, None, True, images, support.image_token_id
        )
    with pytest.raises(BadRequest, match="image input is not supported"):
        PromptBuilder(tokenizer, max_model_len=512).chat(msgs, None, None)
    # the placeholder typed as text would take the image's place: refused naming the message
    typed = [message("hi"), message("look <|image_pad|> here", {"url": data_uri(png(128, 128, 7))})]
    with pytest.raises(BadRequest, match=r"messages\.1\.content: contains <\|image_pad\|>"):
        PromptBuilder(tokenizer, max_model_len=512).chat(
            typed, None, None, True, images, support.image_token_id
        )


def test_one_request_decodes_on_at_most_half_the_checking_threads(ckpt, monkeypatch):
    """Images are checked on a pool of their own, a request at most DECODES_PER_REQUEST at a
    time: a request of many large pictures leaves threads free for the next request's image."""
    import appliance.server.images as images
    from visual.image_io import check_image

    busy, most, lock = [0], [0], threading.Lock()

    def slow_check(data, limits):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            threading.Event().wait(0.05)
            return check_image(data, limits)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(images, "check_image", slow_check)
    support = image_support(ckpt, CONFIG)
    many = [message(*[{"url": data_uri(png(16, 16, seed))} for seed in range(8)])]
    one = [message("and this", {"url": data_uri(png(16, 16, 99))})]

    async def both():
        big = asyncio.ensure_future(load_images(support, many))
        await asyncio.sleep(0.01)
        small = await load_images(support, one)
        return big.done(), small, await big

    assert len(asyncio.run(load_images(support, many))) == 8
    assert most[0] == images.DECODES_PER_REQUEST <= images.DECODE_THREADS // 2
    big_done_first, small, big = asyncio.run(both())
    assert len(big) == 8 and len(small) == 1 and not big_done_first


def test_responses_style_parts_are_chat_parts(ckpt):
    """{"type": "input_text"} and {"type": "input_image", "image_url": "<url>"} (the Responses API's
    spellings, which vLLM takes in chat messages too) are read as text and image_url parts."""
    from appliance.server.protocol import ImagePart, TextPart

    url = data_uri(png(16, 16, 7))
    spelled = ChatMessage.model_validate(
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what is it?"},
                {"type": "input_image", "image_url": url, "detail": "low"},
            ],
        }
    )
    text, image = spelled.content
    assert isinstance(text, TextPart) and text.text == "what is it?"
    assert isinstance(image, ImagePart) and image.image_url.url == url
    assert image.image_url.detail == "low"
    (loaded,) = asyncio.run(load_images(image_support(ckpt, CONFIG), [spelled]))
    (plain,) = asyncio.run(load_images(image_support(ckpt, CONFIG), [message({"url": url})]))
    assert loaded == plain
    nested = {"role": "user", "content": [{"type": "input_image", "image_url": {"url": url}}]}
    (image,) = ChatMessage.model_validate(nested).content
    assert isinstance(image, ImagePart) and image.image_url.url == url


@pytest.mark.parametrize("route", [ChatCompletionRequest, CompletionRequest])
def test_mm_processor_kwargs_are_no_longer_refused_as_unsupported(route):
    base = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if route is ChatCompletionRequest
        else {"prompt": "hi"}
    )
    request = route.model_validate({**base, "mm_processor_kwargs": {"max_pixels": 64 * 64}})
    sampling_params(request, None, 1000)  # the route's field checks take it
    assert request.mm_processor_kwargs == {"max_pixels": 64 * 64}


def test_mm_processor_kwargs_spellings_give_the_requests_range(ckpt):
    """vLLM's Qwen-VL keys: min_pixels / max_pixels or transformers' size dict (the same two
    bounds, pixel counts); an unset bound is the checkpoint's; null or {} is unset; a server that
    takes no images ignores the field, as vLLM does for text-only models."""
    support = image_support(ckpt, CONFIG)
    checkpoint = support.preprocess
    assert (checkpoint.min_pixels, checkpoint.max_pixels) == (32 * 32, 128 * 128)
    for unset in (None, {}, {"max_pixels": None}, {"size": {}}):
        assert request_preprocess(support, unset) == checkpoint
    ranged = request_preprocess(support, {"max_pixels": 64 * 64})
    assert (ranged.min_pixels, ranged.max_pixels) == (32 * 32, 64 * 64)
    both = {"min_pixels": 48 * 48, "max_pixels": 64 * 64}
    size = {"size": {"shortest_edge": 48 * 48, "longest_edge": 64 * 64}}
    mixed = {"min_pixels": 48 * 48, "size": {"shortest_edge": 48 * 48, "longest_edge": 64 * 64}}
    configs = [request_preprocess(support, kwargs) for kwargs in (both, size, mixed)]
    assert configs[0] == configs[1] == configs[2]
    assert (configs[0].min_pixels, configs[0].max_pixels) == (48 * 48, 64 * 64)
    text_only = image_support(ckpt, VisualConfig(vision=False))
    assert request_preprocess(text_only, {"fps": 2}) is None


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"fps": 2}, "mm_processor_kwargs.fps: not supported; images take min_pixels"),
        ({"do_resize": False}, "mm_processor_kwargs.do_resize: not supported"),
        ({"size": {"height": 64}}, "mm_processor_kwargs.size.height: not supported"),
        ({"size": 4096}, "mm_processor_kwargs.size: expected an object"),
        ({"max_pixels": "4096"}, "max_pixels: expected a pixel count, an integer >= 1, got '4096'"),
        ({"max_pixels": 4096.0}, "max_pixels: expected a pixel count"),
        ({"min_pixels": True}, "min_pixels: expected a pixel count"),
        ({"max_pixels": 0}, "max_pixels: expected a pixel count"),
        ({"size": {"shortest_edge": -5}}, "size.shortest_edge: expected a pixel count"),
        ({"min_pixels": 8192, "max_pixels": 4096}, "min_pixels: 8192 is above max_pixels 4096"),
        ({"max_pixels": 20000}, "max_pixels: 20000 is above 16384, the checkpoint's largest"),
        (
            {"size": {"longest_edge": 20000}},
            "mm_processor_kwargs.size.longest_edge: 20000 is above",
        ),
        ({"max_pixels": 512}, "max_pixels: 512 is below 1024, the checkpoint's smallest"),
        ({"min_pixels": 16384}, "min_pixels: 16384 would upscale some images past the ViT's"),
        (
            {"max_pixels": 4096, "size": {"longest_edge": 8192}},
            "size.longest_edge: 8192 differs from max_pixels 4096",
        ),
    ],
)
def test_bad_mm_processor_kwargs_are_400s_naming_the_key(ckpt, kwargs, words):
    with pytest.raises(BadRequest) as caught:
        request_preprocess(image_support(ckpt, CONFIG), kwargs)
    assert words in caught.value.message
    assert caught.value.status == 400 and caught.value.param == "mm_processor_kwargs"


def test_images_are_sized_keyed_and_sent_at_the_requests_range(ckpt):
    """One file at the checkpoint's range and at a smaller one: other grid, fewer tokens, another
    cache key; the range travels in ImageData so the visual server resizes it the same way (0s:
    the checkpoint's)."""
    support = image_support(ckpt, CONFIG)
    data = png(128, 128, 8)
    msgs = [message("look", {"url": data_uri(data)})]
    ranged = request_preprocess(support, {"max_pixels": 64 * 64})
    (default,) = load(ckpt, msgs)
    (small,) = asyncio.run(load_images(support, msgs, None, ranged))
    assert (default.grid_thw, default.num_tokens) == ((1, 8, 8), 16)
    assert (small.grid_thw, small.num_tokens) == ((1, 4, 4), 4) == (image_grid(128, 128, ranged), 4)
    assert small.key != default.key and small.data == default.data
    assert small.key == image_key(data, (1, 4, 4)) and default.key == image_key(data, (1, 8, 8))
    assert (default.min_pixels, default.max_pixels) == (0, 0)
    assert (small.min_pixels, small.max_pixels) == (32 * 32, 64 * 64)
    pad = support.image_token_id
    ids, sent = expand_image_tokens([5, pad, 6, pad, 7], pad, [default, small])
    assert ids == [5] + [pad] * 16 + [6] + [pad] * 4 + [7]
    assert [(d.key, d.offset, d.grid_thw) for d in sent] == [
        (default.key, 1, (1, 8, 8)),
        (small.key, 18, (1, 4, 4)),
    ]
    assert [(d.min_pixels, d.max_pixels) for d in sent] == [(0, 0), (32 * 32, 64 * 64)]


def test_responses_input_image_detail_is_named_where_it_was_sent():
    """A bad `detail` of a Responses input_image is a 400 naming input.N.content.M.detail, not
    the chat form's path it is translated to (…image_url.image_url.detail)."""
    from appliance.server.responses_input import chat_messages

    part = {"type": "input_image", "image_url": data_uri(png(16, 16, 7)), "detail": "ultra"}
    with pytest.raises(BadRequest) as caught:
        chat_messages([{"role": "user", "content": [part]}], None)
    assert caught.value.message.startswith("input.0.content.0.detail: expected 'auto', 'low'")
    for detail in (None, "auto", "low", "high"):
        (message,) = chat_messages(
            [{"role": "user", "content": [{**part, "detail": detail}]}], None
        )
        assert message.content[0].image_url.detail == detail
