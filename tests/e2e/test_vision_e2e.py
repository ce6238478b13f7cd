"""Images end to end: the official `openai` SDK against a live appliance serving a tiny Qwen3-VL
(server, visual server, router, detokenizer, worker as real processes). Greedy text equals the
offline path (ModelRunner + in-process image store, prompts built by hand with the HF image
processor); a repeated image is served from the embedding cache; bad images get 400s and the server
keeps serving; preempted image requests are recomputed correctly; afterwards no KV/state slot is
used and no cache entry is pinned."""

from __future__ import annotations

import base64
import io
import re
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from transformers import AutoTokenizer

from appliance.models.mrope import ImageSpan
from appliance.testing.tiny_vl import build_tiny_qwen3_vl
from tests.e2e.live import start_appliance
from tests.models.qwen3_vl_oracle import Driver, VLPrompt, engine, hf_processor
from tests.visual.test_image_io import png_header_only
from visual.checkpoint import preprocess_config
from visual.preprocess import image_grid, pixel_range

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
MAX_TOKENS = 8
MODEL = "vl_e2e"  # the checkpoint folder's name is the served model id
KV_SLOTS = 160  # small on purpose: concurrent image requests preempt each other


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_uri(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / MODEL
    return build_tiny_qwen3_vl(out, tokenizer="bpe", seed=7)


@pytest.fixture(scope="module")
def app(ckpt, tmp_path_factory):
    app = start_appliance(
        ckpt,
        tmp_path_factory.mktemp("vl_live") / "appliance.log",
        "--max-num-seqs",
        "4",
        "--num-kv-slots",
        str(KV_SLOTS),
        "--visual-max-batch-size",
        "4",
    )
    yield app
    code = app.stop()
    assert code == 0, app.log()[-4000:]


@pytest.fixture(scope="module")
def sdk(app, ckpt):
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)
    assert client.models.list().data[0].id == ckpt.name == MODEL
    return client


@pytest.fixture(scope="module")
def offline(ckpt):
    """expected(conversation) -> greedy text of the offline path for the same conversation."""
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    driver = Driver(engine(ckpt), ckpt)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def expected(conversation: list[tuple[str, list]], max_tokens: int = MAX_TOKENS) -> str:
        hand, images = [], []
        for role, parts in conversation:
            content = []
            for part in parts:
                if isinstance(part, str):
                    content.append({"type": "text", "text": part})
                else:
                    content.append({"type": "image"})
                    images.append(part)
            hand.append({"role": role, "content": content})
        text = tokenizer.apply_chat_template(
            hand, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        single = tokenizer.encode(text, add_special_tokens=False)
        processed = hf_processor(ckpt)(images, return_tensors="pt")
        prompt = VLPrompt([], images, processed["pixel_values"], processed["image_grid_thw"])
        grids = [tuple(int(v) for v in g) for g in processed["image_grid_thw"]]
        for token in single:
            if token != pad:
                prompt.token_ids.append(token)
                continue
            grid = grids[len(prompt.spans)]
            prompt.spans.append(ImageSpan(len(prompt.token_ids), grid))
            prompt.token_ids += [pad] * (grid[0] * grid[1] * grid[2] // 4)
        (tokens,) = driver.greedy([prompt], max_tokens, chunk=2048)
        return tokenizer.decode(tokens, skip_special_tokens=True)

    return expected


def messages(conversation: list[tuple[str, list]]) -> list[dict]:
    out = []
    for role, parts in conversation:
        content = [
            {"type": "text", "text": p}
            if isinstance(p, str)
            else {"type": "image_url", "image_url": {"url": data_uri(p), "detail": "auto"}}
            for p in parts
        ]
        out.append({"role": role, "content": content})
    return out


def chat(sdk, conversation, max_tokens: int = MAX_TOKENS) -> str:
    out = sdk.chat.completions.create(
        model=MODEL,
        messages=messages(conversation),
        temperature=0,
        max_tokens=max_tokens,
        extra_body=NO_THINK,
    )
    return out.choices[0].message.content


ONE = [("user", ["What is in this picture?", random_image(64, 48, 1)])]
TWO = [("user", ["Compare", random_image(120, 40, 2), "with", random_image(50, 70, 3)])]
TURNS = [
    ("user", [random_image(96, 96, 4), "Remember this."]),
    ("assistant", ["I will."]),
    ("user", ["And this one?", random_image(40, 40, 5)]),
]


def router(app) -> dict:
    return app.status()["router"]


def test_one_image_matches_offline_and_stream(sdk, app, offline):
    text = chat(sdk, ONE)
    assert text == offline(ONE)
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=messages(ONE),
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINK,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens > 6  # the image's tokens are counted
    both = sdk.chat.completions.create(
        model=MODEL,
        messages=messages(ONE),
        temperature=0,
        max_tokens=MAX_TOKENS,
        n=2,
        extra_body=NO_THINK,
    )
    assert [c.message.content for c in both.choices] == [text, text]


def test_repeated_image_hits_the_cache(sdk, app):
    before = router(app)
    assert chat(sdk, ONE) == chat(sdk, ONE)
    after = router(app)
    assert after["mm_cache_hits"] >= before["mm_cache_hits"] + 2
    assert after["mm_cache_queries"] == before["mm_cache_queries"] + 2
    assert after["mm_cache_entries"] == before["mm_cache_entries"]  # nothing new encoded
    metrics = httpx.get(f"{app.url}/metrics").text  # the hits reach Prometheus too
    hits = re.search(r"^appliance_mm_cache_hits_total{[^}]*} (\S+)$", metrics, re.M)
    assert hits is not None and float(hits.group(1)) >= 2


def test_two_images_in_one_message_and_earlier_turns(sdk, offline):
    assert chat(sdk, TWO) == offline(TWO)
    assert chat(sdk, TURNS) == offline(TURNS)


@pytest.mark.parametrize(
    "url,reason",
    [
        (data_uri(random_image(32, 32, 9))[:200], "not valid base64"),
        (
            "data:image/png;base64," + base64.b64encode(b"plain text, no image").decode(),
            "not a supported image",
        ),
        (
            "data:image/png;base64," + base64.b64encode(png_header_only(50000, 50000)).decode(),
            "pixels",
        ),
        ("ftp://example.com/a.png", "scheme"),
        ("http://192.168.1.10/a.png", "non-public address"),
    ],
)
def test_bad_images_get_400_and_the_server_keeps_serving(sdk, url, reason):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert info.value.status_code == 400 and reason in info.value.message
    assert chat(sdk, ONE)  # still serving image requests


def test_truncated_png_is_refused(app):
    buf = io.BytesIO()
    random_image(64, 64, 11).save(buf, "PNG")
    truncated = base64.b64encode(buf.getvalue()[: len(buf.getvalue()) // 2]).decode()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/png;base64,{truncated}"},
                    }
                ],
            }
        ]
    }
    r = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "could not decode PNG" in r.json()["error"]["message"]


def test_preempted_image_requests_are_recomputed_correctly(sdk, app, offline):
    conversations = [
        [("user", [f"Picture {i}, in detail please.", random_image(128, 128, 20 + i)])]
        for i in range(4)
    ]
    expected = [offline(c, 40) for c in conversations]
    before = router(app)["num_preemptions"]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = chat(sdk, conversations[i], max_tokens=40)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert router(app)["num_preemptions"] > before
    assert [results[i] for i in range(4)] == expected


BIG = random_image(128, 128, 40)  # the checkpoint's range keeps it: 8x8 patches, 16 tokens
SMALL = {"max_pixels": 64 * 64}  # vLLM's mm_processor_kwargs: 4x4 patches, 4 tokens


def ask(sdk, image: Image.Image, kwargs: dict | None = None) -> tuple[str, int]:
    """(greedy text, usage.prompt_tokens) of a one-image chat, at the request's pixel range."""
    extra = {**NO_THINK, **({"mm_processor_kwargs": kwargs} if kwargs is not None else {})}
    out = sdk.chat.completions.create(
        model=MODEL,
        messages=messages([("user", ["Describe.", image])]),
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body=extra,
    )
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_mm_processor_kwargs_resize_each_requests_images(sdk, ckpt, offline):
    """A smaller max_pixels: the grid check_image's sizing gives for that range, that many fewer
    prompt tokens, and the answer of the image pre-shrunk to that grid (BICUBIC, as the visual
    server resizes). One file at both ranges, back and forth, on every route: each answer is its
    own range's (the cache keys by content and grid, never confusing the two)."""
    config = preprocess_config(ckpt)
    small_grid = image_grid(128, 128, pixel_range(config, 0, SMALL["max_pixels"], 40_000_000))
    assert (image_grid(128, 128, config), small_grid) == ((1, 8, 8), (1, 4, 4))
    shrunk = BIG.resize((64, 64), Image.Resampling.BICUBIC)
    default_text, default_tokens = ask(sdk, BIG)
    small_text, small_tokens = ask(sdk, BIG, SMALL)
    assert default_tokens - small_tokens == 16 - 4
    assert ask(sdk, shrunk) == (small_text, small_tokens)
    assert small_text == offline([("user", ["Describe.", shrunk])])
    assert default_text == offline([("user", ["Describe.", BIG])])
    size = {"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}}  # transformers' spelling
    assert ask(sdk, BIG, size) == (small_text, small_tokens)
    assert ask(sdk, BIG, {}) == (default_text, default_tokens)
    content = [
        {"type": "input_text", "text": "Describe."},
        {"type": "input_image", "image_url": data_uri(BIG)},
    ]
    response = sdk.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        reasoning={"effort": "none"},
        extra_body={"ignore_eos": True, "mm_processor_kwargs": SMALL},
    )
    assert (response.output_text, response.usage.input_tokens) == (small_text, small_tokens)


def test_bad_mm_processor_kwargs_get_400_naming_them_and_the_server_keeps_serving(app, sdk):
    image = [{"type": "image_url", "image_url": {"url": data_uri(BIG)}}]
    chat_body = {"messages": [{"role": "user", "content": image}], "max_tokens": 2}
    cases = [
        ("chat/completions", chat_body, {"fps": 2}, "mm_processor_kwargs.fps: not supported"),
        ("chat/completions", chat_body, {"max_pixels": 20000}, "is above 16384"),
        ("chat/completions", chat_body, {"min_pixels": 4096, "max_pixels": 2048}, "is above"),
        ("chat/completions", chat_body, {"max_pixels": "4096"}, "expected a pixel count"),
        ("completions", {"prompt": "hi", "max_tokens": 2}, {"do_resize": False}, "do_resize"),
        ("responses", {"input": "hi"}, {"size": {"longest_edge": 10**9}}, "size.longest_edge"),
    ]
    for route, body, kwargs, words in cases:
        r = httpx.post(
            f"{app.url}/v1/{route}", json={**body, "mm_processor_kwargs": kwargs}, timeout=30
        )
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "mm_processor_kwargs", (route, r.text)
        assert words in error["message"], (route, error)
    assert chat(sdk, ONE)  # still serving image requests


def test_sglang_generate_takes_image_data(app, ckpt, sdk, offline):
    """SGLang's POST /generate with image_data (data: URI, bare base64, a batch with one entry per
    prompt) answers what the chat route answers for the same rendered prompt; a placeholder
    count that does not match the images is a 400 naming the field."""
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    hand = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}],
        }
    ]
    text = tokenizer.apply_chat_template(
        hand, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    image = ONE[0][1][1]
    uri = data_uri(image)
    bare = uri.partition(",")[2]
    sampling = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}

    def generate(**body) -> httpx.Response:
        return httpx.post(f"{app.url}/generate", json=body, timeout=60)

    want = offline(ONE)
    one = generate(text=text, image_data=uri, sampling_params=sampling)
    assert one.status_code == 200, one.text
    assert one.json()["text"] == want == chat(sdk, ONE)
    ids = tokenizer.encode(text, add_special_tokens=False)
    by_ids = generate(input_ids=ids, image_data=[bare], sampling_params=sampling).json()
    assert by_ids["text"] == want
    other = random_image(50, 70, 3)
    batch = generate(
        text=[text, text, "plain text"],
        image_data=[uri, [data_uri(other)], None],
        sampling_params=sampling,
    ).json()
    assert [b["text"] for b in batch][:2] == [
        want,
        offline([("user", ["What is in this picture?", other])]),
    ]
    assert batch[0]["meta_info"]["prompt_tokens"] > len(ids)  # the image's tokens count
    for body, says in [
        ({"text": "no placeholder", "image_data": uri}, "0 image placeholders for 1 images"),
        ({"text": text, "image_data": "/etc/passwd"}, "local file paths"),
        ({"text": text, "image_data": [uri, uri]}, "1 image placeholders for 2 images"),
        ({"text": [text, text], "image_data": [uri]}, "one entry per prompt"),
    ]:
        r = generate(**body, sampling_params=sampling)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] in ("text", "image_data")


def test_afterwards_no_slot_and_no_pin_is_held(app):
    deadline = time.monotonic() + 10
    while True:
        status = router(app)
        idle = status["kv_used"] == 0 and status["state_used"] == 0
        if (idle and status["mm_cache_pinned"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["kv_used"] == 0 and status["state_used"] == 0
    assert status["num_running"] == 0 and status["num_waiting"] == 0
    assert status["mm_cache_pinned"] == 0 and status["mm_cache_entries"] >= 9
    assert "ViT worst case: 4 x grid (1, 16, 16)" in app.log()
