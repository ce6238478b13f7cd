"""The offline `LLM`'s images on CUDA (run on the GPU machine with -m gpu; needs Pillow): the ViT
loads with the LLM on the model's device and its worst-case activation memory is held back from
the pools (as the visual server's is), the chat and prompt-dict forms give the same greedy tokens,
the image changes the prompt, no embedding entry outlives a call; vision=False loads no ViT and
holds nothing back."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.offline.prompts import PLACEHOLDER
from appliance.testing.tiny_vl import build_tiny_qwen3_vl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NO_THINK = {"enable_thinking": False}


def _png(seed: int, width: int, height: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_offline_images_on_cuda(tmp_path):
    ckpt = build_tiny_qwen3_vl(tmp_path / "vl", tokenizer="bpe", seed=7)
    png_a, png_b = _png(1, 64, 48), _png(2, 40, 72)
    opts = dict(device="cuda", max_num_seqs=4, num_kv_slots=4096, max_model_len=1024)
    with LLM(str(ckpt), vision=False, **opts) as text_only:
        assert text_only.runner.reserved_bytes == 0 and text_only._images is None
    with LLM(str(ckpt), **opts) as llm:
        assert llm.runner.reserved_bytes > 0  # measured before the pools were sized
        assert llm._images._encoder.device.type == "cuda"  # loaded with the LLM
        uri = f"data:image/png;base64,{base64.b64encode(png_a).decode()}"
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": uri}},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ]
        [chat] = llm.chat(messages, GREEDY, chat_template_kwargs=NO_THINK)
        text = llm.get_tokenizer().apply_chat_template(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image"},
                        {"type": "text", "text": "What is in the picture?"},
                    ],
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
            **NO_THINK,
        )
        assert text.count(PLACEHOLDER) == 1
        by_a, by_b = llm.generate(
            [
                {"prompt": text, "multi_modal_data": {"image": png_a}},
                {"prompt": text, "multi_modal_data": {"image": png_b}},
            ],
            GREEDY,
        )
        assert by_a.token_ids == chat.token_ids and len(chat.token_ids) == GREEDY.max_tokens
        assert by_a.prompt_token_ids == chat.prompt_token_ids
        assert by_b.prompt_token_ids != by_a.prompt_token_ids  # another grid, other tokens
        assert llm.images().num_entries == 0
        assert llm.scheduler.stats().kv_used == 0
