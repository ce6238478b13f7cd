"""Helpers for the multimodal parity tests: image prompts built by hand (models.md §7.5), the fp32
transformers oracle (teacher-forced logits, greedy generate, get_rope_index) and a small driver
that runs image prompts through the real ModelRunner with `NewRequest.mm` (the router does not
carry images yet, so the driver plays the router: KV slots, chunked prefill, decode)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from appliance.engine.batch import build_batch
from appliance.engine.mm_inputs import InProcessImageStore
from appliance.engine.runner import ModelRunner
from appliance.messages import ImageInput, NewRequest, SamplingOptions, ScheduledChunk, StepPlan
from appliance.models.mrope import ImageSpan
from appliance.offline.llm import build_engine_config
from visual.encoder import VisionEncoder

GREEDY = SamplingOptions(temperature=0.0, seed=0)


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@dataclass
class VLPrompt:
    token_ids: list[int]
    images: list[Image.Image] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None  # [patches, 1536] fp32
    grid_thw: torch.Tensor | None = None  # [images, 3] int64
    spans: list[ImageSpan] = field(default_factory=list)


def _config(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / "config.json").read_text())


def hf_processor(ckpt: Path) -> Qwen2VLImageProcessorPil:
    raw = json.loads((Path(ckpt) / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(
        patch_size=raw["patch_size"],
        temporal_patch_size=raw["temporal_patch_size"],
        merge_size=raw["merge_size"],
        image_mean=raw["image_mean"],
        image_std=raw["image_std"],
        size=raw["size"],
    )


def make_prompt(ckpt: Path, pieces: list[int | Image.Image], seed: int) -> VLPrompt:
    """pieces: an int n adds n random text tokens, an image adds
    <|vision_start|> <|image_pad|> x t*h*w/4 <|vision_end|> (grid from the HF image processor)."""
    cfg = _config(ckpt)
    text_vocab = cfg["vision_start_token_id"] - 10  # stay clear of the special tokens
    gen = torch.Generator().manual_seed(seed)
    images = [p for p in pieces if isinstance(p, Image.Image)]
    prompt = VLPrompt([], images)
    if images:
        out = hf_processor(ckpt)(images, return_tensors="pt")
        prompt.pixel_values, prompt.grid_thw = out["pixel_values"], out["image_grid_thw"]
    image_index = 0
    for piece in pieces:
        if isinstance(piece, int):
            prompt.token_ids += torch.randint(0, text_vocab, (piece,), generator=gen).tolist()
            continue
        grid = tuple(int(v) for v in prompt.grid_thw[image_index])
        count = grid[0] * grid[1] * grid[2] // 4
        prompt.token_ids.append(cfg["vision_start_token_id"])
        prompt.spans.append(ImageSpan(len(prompt.token_ids), grid))
        prompt.token_ids += [cfg["image_token_id"]] * count + [cfg["vision_end_token_id"]]
        image_index += 1
    return prompt


# ------------------------------------------------------------------------------ HF oracle


@functools.lru_cache(maxsize=4)
def hf_model(ckpt: Path) -> torch.nn.Module:
    cls = getattr(transformers, _config(ckpt)["architectures"][0])
    return cls.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_inputs(ckpt: Path, prompt: VLPrompt, extra: list[int] = ()) -> dict:
    """Model inputs for one unpadded sequence; mm_token_type_ids is mandatory (models.md §4.3)."""
    ids = torch.tensor([prompt.token_ids + list(extra)])
    inputs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == _config(ckpt)["image_token_id"]).int(),
    )
    if prompt.images:
        inputs.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.grid_thw)
    return inputs


@torch.no_grad()
def hf_logits(ckpt: Path, prompt: VLPrompt, extra: list[int]) -> torch.Tensor:
    """Teacher-forced logits [L, V] of prompt + extra (no cache)."""
    return hf_model(ckpt)(**hf_inputs(ckpt, prompt, extra), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(ckpt: Path, prompt: VLPrompt, n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of exactly n tokens and the oracle's top-2 gap at each step."""
    out = hf_model(ckpt).generate(
        **hf_inputs(ckpt, prompt),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=None,
        pad_token_id=_config(ckpt)["text_config"]["pad_token_id"],
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt.token_ids) :].tolist()
    gaps = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.logits]
    return tokens, gaps


# ------------------------------------------------------------------------------ engine driver


def engine(ckpt: Path, max_num_seqs: int = 4) -> ModelRunner:
    config = build_engine_config(
        str(ckpt), 1, dict(max_num_seqs=max_num_seqs, num_kv_slots=2048, max_model_len=256)
    )
    runner = ModelRunner(config)
    runner.mm.store = InProcessImageStore()
    return runner


@functools.lru_cache(maxsize=4)
def vision_encoder(ckpt: Path) -> VisionEncoder:
    return VisionEncoder.from_pretrained(ckpt)


def image_inputs(runner: ModelRunner, ckpt: Path, prompt: VLPrompt, tag: str) -> list[ImageInput]:
    """Encode the prompt's images with the appliance's ViT and put them in the runner's store."""
    if not prompt.images:
        return []
    encoder = vision_encoder(ckpt)
    embeds, deepstack = encoder.encode(prompt.pixel_values, prompt.grid_thw)
    per_image = encoder.split_per_image(embeds, prompt.grid_thw)
    per_deep = [encoder.split_per_image(d, prompt.grid_thw) for d in deepstack]
    out = []
    for i, (span, rows) in enumerate(zip(prompt.spans, per_image)):
        handle = runner.mm.store.put(f"{tag}-{i}", rows, [d[i] for d in per_deep])
        out.append(ImageInput(span.offset, rows.shape[0], span.grid_thw, handle))
    return out


class Driver:
    """Plays the router for a fixed set of requests: one request slot each, fresh KV slots."""

    def __init__(self, runner: ModelRunner, ckpt: Path) -> None:
        self.runner, self.ckpt = runner, ckpt
        self.next_kv = 0
        self.step = 0

    def _plan(
        self, new: list[NewRequest], chunks: list[ScheduledChunk], released: list[int] = ()
    ) -> StepPlan:
        self.step += 1
        return StepPlan(self.step, new, chunks, list(released))

    def _chunk(self, slot: int, start: int, n: int, sample: bool) -> ScheduledChunk:
        kv = list(range(self.next_kv, self.next_kv + n))
        self.next_kv += n
        return ScheduledChunk(slot, start, n, kv, sample)

    def admit(self, prompts: list[VLPrompt], seqs: list[list[int]]) -> None:
        new = [
            NewRequest(slot, seq, GREEDY, mm=image_inputs(self.runner, self.ckpt, p, str(slot)))
            for slot, (p, seq) in enumerate(zip(prompts, seqs))
        ]
        self.runner.execute(self._plan(new, []))

    def release(self, count: int) -> None:
        self.runner.execute(self._plan([], [], range(count)))
        self.next_kv = 0

    @torch.inference_mode()
    def logits(
        self,
        prompts: list[VLPrompt],
        seqs: list[list[int]],
        chunk: int,
        after_admit: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """Teacher-forced logits [L, V] of every sequence, all in one batch per step, each
        advancing at most `chunk` tokens per step. `after_admit` may edit the worker's state."""
        self.admit(prompts, seqs)
        if after_admit is not None:
            after_admit()
        done, out = [0] * len(seqs), [[] for _ in seqs]
        while any(d < len(s) for d, s in zip(done, seqs)):
            chunks = [
                self._chunk(slot, done[slot], min(chunk, len(seq) - done[slot]), False)
                for slot, seq in enumerate(seqs)
                if done[slot] < len(seq)
            ]
            batch = build_batch(chunks, self.runner.requests, self.runner.device)
            logits = self.runner.model.compute_logits(self.runner.forward_batch(batch))
            first = 0
            for c in batch.chunks:
                out[c.req_slot].append(logits[first : first + c.num_tokens])
                done[c.req_slot] += c.num_tokens
                first += c.num_tokens
        self.release(len(seqs))
        return [torch.cat(parts) for parts in out]

    def greedy(self, prompts: list[VLPrompt], n: int, chunk: int) -> list[list[int]]:
        """Greedy continuations of n tokens through `runner.execute` (chunked prefill, decode)."""
        seqs = [p.token_ids for p in prompts]
        self.admit(prompts, seqs)
        done, outs = [0] * len(seqs), [[] for _ in seqs]
        while any(len(o) < n for o in outs):
            chunks = []
            for slot, seq in enumerate(seqs):
                known = len(seq) + len(outs[slot])
                if len(outs[slot]) >= n:
                    continue
                count = min(chunk, known - done[slot])
                chunks.append(self._chunk(slot, done[slot], count, done[slot] + count == known))
                done[slot] += count
            result = self.runner.execute(self._plan([], chunks))
            for sampled in result.sampled:
                outs[sampled.req_slot] += sampled.token_ids
        self.release(len(seqs))
        return outs
