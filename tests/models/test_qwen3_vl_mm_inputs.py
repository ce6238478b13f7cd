"""Image inputs on the worker: the NewRequest.mm message, the in-process and shared-memory embedding
stores, admission checks, freeing consumed embeddings, the registry entries and the Qwen3-VL-MoE
expert loader in both orientations."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.engine.mm_inputs import ImageInputError, InProcessImageStore
from appliance.messages import ImageInput, NewRequest, SamplingOptions, decoder, encode
from appliance.models.config import load_text_config
from appliance.models.qwen3_5 import Qwen3_5ForCausalLM
from appliance.models.qwen3_vl import Qwen3VLForCausalLM
from appliance.models.registry import model_class
from appliance.testing.tiny_vl import build_tiny_qwen3_vl
from tests.models.qwen3_vl_oracle import Driver, engine, make_prompt, random_image
from visual.shm import SharedMemoryImageStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread avoids OpenMP waits on busy shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("vl"), tokenizer="none", seed=21)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return build_tiny_qwen3_vl(
        tmp_path_factory.mktemp("vl_moe"), moe=True, tokenizer="none", seed=22
    )


@pytest.fixture(scope="module")
def runner(vl_ckpt):
    return engine(vl_ckpt)


def test_new_request_with_images_round_trips():
    req = NewRequest(
        3,
        [1, 2, 5, 7, 7, 7, 7, 6],
        SamplingOptions(temperature=0.0),
        mm=[ImageInput(3, 4, (1, 4, 4), "img-abc")],
    )
    back = decoder(NewRequest).decode(encode(req))
    assert back == req and back.mm[0].grid_thw == (1, 4, 4)
    # a text-only request still encodes without images and decodes to mm == []
    plain = decoder(NewRequest).decode(encode(NewRequest(0, [1, 2], SamplingOptions())))
    assert plain.mm == []
    with pytest.raises(msgspec.ValidationError):
        decoder(ImageInput).decode(
            msgspec.msgpack.encode(
                {"offset": 0, "num_tokens": 4, "grid_thw": [1, 4], "handle": "x"}
            )
        )


def test_in_process_store():
    store = InProcessImageStore()
    embeds, deep = torch.randn(4, 8), torch.randn(4, 8)
    assert store.put("a", embeds, [deep]) == "a"
    assert torch.equal(store.load("a"), torch.stack([embeds, deep]))
    store.release("a")
    with pytest.raises(ImageInputError, match="not in the store"):
        store.load("a")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_memory_store_across_processes(dtype):
    store = SharedMemoryImageStore()
    handle = f"appl-test-{uuid.uuid4().hex[:12]}"
    embeds = torch.randn(6, 16).to(dtype)
    deep = [torch.randn(6, 16).to(dtype) for _ in range(2)]
    store.put(handle, embeds, deep)
    try:
        # another process reads the segment and must leave it in place when it exits
        code = (
            "import torch\n"
            "from visual.shm import SharedMemoryImageStore\n"
            f"t = SharedMemoryImageStore().load({handle!r})\n"
            "print(t.dtype, list(t.shape), float(t.float().sum()))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        expected = torch.stack([embeds, *deep])
        assert out[0] == str(dtype) and out[1:4] == ["[3,", "6,", "16]"]
        assert abs(float(out[4]) - float(expected.float().sum())) < 1e-3
        loaded = store.load(handle)  # still there after the reader exited
        assert loaded.dtype == dtype and torch.equal(loaded, expected)
    finally:
        store.release(handle)
    with pytest.raises(ImageInputError, match="no such shared memory"):
        store.load(handle)


def _request(prompt, handle: str, slot: int = 0, **changes) -> NewRequest:
    span = prompt.spans[0]
    image = dict(
        offset=span.offset, num_tokens=span.num_tokens(2), grid_thw=span.grid_thw, handle=handle
    )
    image.update(changes)
    return NewRequest(slot, prompt.token_ids, SamplingOptions(), mm=[ImageInput(**image)])


def test_admission_checks(runner, vl_ckpt):
    prompt = make_prompt(vl_ckpt, [3, random_image(64, 64, 1), 2], seed=0)
    n, hidden = prompt.spans[0].num_tokens(2), 64
    runner.mm.store.put("good", torch.randn(n, hidden), [torch.randn(n, hidden)])
    runner.mm.store.put("no-deepstack", torch.randn(n, hidden))
    with pytest.raises(ImageInputError, match=r"expected \(2, 4, 64\)"):
        runner.mm.admit(_request(prompt, "no-deepstack"))
    with pytest.raises(ImageInputError, match="has 5 tokens, grid"):
        runner.mm.admit(_request(prompt, "good", num_tokens=5))
    with pytest.raises(ImageInputError, match="tokens in the request"):
        runner.mm.admit(_request(prompt, "good", offset=len(prompt.token_ids) - 2))
    with pytest.raises(ImageInputError, match=re.escape("are not all <|image_pad|> (1996)")):
        runner.mm.admit(_request(prompt, "good", offset=prompt.spans[0].offset - 1))
    with pytest.raises(ImageInputError, match="multiple of merge size"):
        runner.mm.admit(_request(prompt, "good", grid_thw=(1, 3, 4)))
    with pytest.raises(ImageInputError, match="not in the store"):
        runner.mm.admit(_request(prompt, "missing"))
    assert not runner.mm.requests


def test_text_only_model_refuses_images(runner, vl_ckpt, tmp_path):
    for name in ("model.safetensors", "config.json"):
        shutil.copy(Path(vl_ckpt) / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    text_only = engine(tmp_path)
    prompt = make_prompt(vl_ckpt, [3, random_image(64, 64, 1), 2], seed=0)
    with pytest.raises(ImageInputError, match="no vision tower"):
        text_only.mm.admit(_request(prompt, "good"))


def test_consumed_embeddings_are_freed_and_shm_matches_in_process(runner, vl_ckpt):
    prompt = make_prompt(
        vl_ckpt, [3, random_image(64, 64, 1), 2, random_image(64, 128, 2), 4], seed=1
    )
    driver = Driver(runner, vl_ckpt)
    seen = []

    def watch() -> None:
        seen.append(runner.mm.requests[0])

    reference = driver.logits([prompt], [prompt.token_ids], chunk=9, after_admit=watch)
    state = seen[0]
    assert state.embeds == [None, None]  # dropped once their rows were computed
    assert state.layout.rope_delta == (2 - 4) + (4 - 8)
    assert not runner.mm.requests  # released with the slot

    in_process = runner.mm.store
    runner.mm.store = SharedMemoryImageStore()
    try:
        (got,) = driver.logits([prompt], [prompt.token_ids], chunk=9)
    finally:
        for handle in list(runner.mm.store._owned):
            runner.mm.store.release(handle)
        runner.mm.store = in_process
    assert torch.equal(got, reference[0])


def test_registry_maps_vlm_architectures(vl_ckpt, moe_ckpt):
    assert model_class(load_text_config(vl_ckpt)) is Qwen3VLForCausalLM
    assert model_class(load_text_config(moe_ckpt)) is Qwen3VLForCausalLM
    for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        cfg = load_text_config(vl_ckpt)
        cfg = type(cfg)(**{**cfg.__dict__, "architecture": arch})
        assert model_class(cfg) is Qwen3_5ForCausalLM


def test_moe_experts_load_in_both_orientations(moe_ckpt, tmp_path):
    hub = load_file(str(Path(moe_ckpt) / "model.safetensors"))
    gate_up = hub["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (8, 64, 96)  # Hub layout [E, H, 2I]
    in_memory = {
        k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in hub.items()
    }
    shutil.copy(Path(moe_ckpt) / "config.json", tmp_path / "config.json")
    save_file(in_memory, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    a = dict(engine(moe_ckpt).model.named_parameters())
    b = dict(engine(tmp_path).model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    w = a["model.layers.0.mlp.w_gate_up"]
    assert w.shape == (8, 96, 64) and torch.equal(w, gate_up.transpose(1, 2))
