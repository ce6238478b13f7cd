"""Image inputs on the worker: where a request's image embeddings come from (a store keyed by the
handle in `ImageInput`) and how they enter a step (M-RoPE positions, splice into the input
embeddings, Qwen3-VL deepstack rows). Called by the model runner; the visual server writes the
shared-memory segments that `SharedMemoryImageStore` (visual/shm.py) reads.

Embeddings of one image are one tensor [1 + num_deepstack, num_tokens, hidden]: row 0 is spliced
over the image's <|image_pad|> tokens, row 1 + i is added after decoder layer i (Qwen3-VL).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from appliance.engine.batch import StepBatch
from appliance.messages import ImageInput, NewRequest
from appliance.models.config import TextConfig
from appliance.models.context import DeepstackInput
from appliance.models.mrope import ImageSpan, MRopeLayout
from visual.shm import ImageInputError, stack_embeddings


class ImageEmbeddingStore(Protocol):
    """Writers `put` an image's ViT outputs under a handle; workers `load` them by handle."""

    def put(
        self, handle: str, embeds: torch.Tensor, deepstack: list[torch.Tensor] | tuple = ()
    ) -> str: ...

    def load(self, handle: str) -> torch.Tensor:
        """Embeddings of one image: [1 + num_deepstack, num_tokens, hidden] (any device)."""
        ...

    def release(self, handle: str) -> None: ...


class InProcessImageStore:
    """Embeddings held in this process (tests, the offline LLM, a visual encoder in-process)."""

    def __init__(self) -> None:
        self._items: dict[str, torch.Tensor] = {}

    def put(
        self, handle: str, embeds: torch.Tensor, deepstack: list[torch.Tensor] | tuple = ()
    ) -> str:
        self._items[handle] = stack_embeddings(embeds, deepstack)
        return handle

    def load(self, handle: str) -> torch.Tensor:
        try:
            return self._items[handle]
        except KeyError:
            raise ImageInputError(f"image embeddings {handle!r} are not in the store") from None

    def release(self, handle: str) -> None:
        self._items.pop(handle, None)


@dataclass
class RequestImages:
    """One request's images on the worker. Embeddings are dropped once their rows are computed;
    the layout stays for the request's life (decode positions = index + rope delta)."""

    layout: MRopeLayout
    inputs: list[ImageInput]
    embeds: list[torch.Tensor | None] = field(default_factory=list)  # [1 + D, n, H] per image


@dataclass
class StepImageInputs:
    positions: torch.Tensor  # [3, T]
    input_embeds: torch.Tensor  # [T, H]
    deepstack: DeepstackInput | None


class MultimodalInputs:
    """Per-request image state of one runner: admit/release with the request slot, and the
    step inputs (3-row positions, embeddings with image rows spliced, deepstack) of a batch."""

    def __init__(
        self,
        cfg: TextConfig,
        num_deepstack: int,
        store: ImageEmbeddingStore,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        vision = cfg.raw.get("vision_config")
        self.merge_size = int(vision.get("spatial_merge_size", 2)) if vision else 0
        self.image_token_id = cfg.raw.get("image_token_id")
        self.hidden = cfg.hidden_size
        self.num_deepstack = num_deepstack
        self.store, self.device, self.dtype = store, device, dtype
        self.requests: dict[int, RequestImages] = {}

    def release(self, req_slot: int) -> None:
        self.requests.pop(req_slot, None)

    def admit(self, req: NewRequest) -> None:
        self.requests.pop(req.req_slot, None)
        if not req.mm:
            return
        if not self.merge_size:
            raise ImageInputError(f"slot {req.req_slot}: this model has no vision tower")
        spans = [ImageSpan(img.offset, tuple(img.grid_thw)) for img in req.mm]
        try:
            layout = MRopeLayout(spans, self.merge_size)
        except ValueError as exc:
            raise ImageInputError(f"slot {req.req_slot}: {exc}") from None
        embeds = []
        for img, span, end in zip(req.mm, spans, layout.ends):
            n = span.num_tokens(self.merge_size)
            if img.num_tokens != n or end > len(req.token_ids):
                raise ImageInputError(
                    f"slot {req.req_slot}: image at {img.offset} has "
                    f"{img.num_tokens} tokens, grid {span.grid_thw} gives {n} "
                    f"({len(req.token_ids)} tokens in the request)"
                )
            run = req.token_ids[img.offset : img.offset + n]
            if self.image_token_id is not None and any(t != self.image_token_id for t in run):
                raise ImageInputError(
                    f"slot {req.req_slot}: tokens {img.offset}..{img.offset + n - 1} are not all "
                    f"<|image_pad|> ({self.image_token_id})"
                )
            tensor = self.store.load(img.handle)
            expected = (1 + self.num_deepstack, n, self.hidden)
            if tuple(tensor.shape) != expected:
                raise ImageInputError(
                    f"slot {req.req_slot}: embeddings {img.handle!r} have shape "
                    f"{tuple(tensor.shape)}, expected {expected}"
                )
            embeds.append(tensor.to(self.device, self.dtype))
        self.requests[req.req_slot] = RequestImages(layout, list(req.mm), embeds)

    def involved(self, batch: StepBatch) -> bool:
        return any(c.req_slot in self.requests for c in batch.chunks)

    def step_inputs(self, batch: StepBatch, embed_tokens: torch.nn.Module) -> StepImageInputs:
        positions = batch.positions.expand(3, -1).clone()  # [3, T]
        embeds = embed_tokens(batch.input_ids)  # [T, H]
        rows, deep = [], [[] for _ in range(self.num_deepstack)]
        first = 0
        for chunk in batch.chunks:
            req = self.requests.get(chunk.req_slot)
            start, end = chunk.start, chunk.start + chunk.num_tokens
            if req is not None:
                positions[:, first : first + chunk.num_tokens] = req.layout.positions(
                    start, end, positions.device
                )
                for i, img in enumerate(req.inputs):
                    lo, hi = max(start, img.offset), min(end, img.offset + img.num_tokens)
                    if lo >= hi:
                        continue
                    tensor = req.embeds[i]
                    if tensor is None:
                        raise ImageInputError(
                            f"slot {chunk.req_slot}: image at {img.offset} was already consumed"
                        )
                    src = slice(lo - img.offset, hi - img.offset)
                    embeds[first + lo - start : first + hi - start] = tensor[0, src]
                    rows.append(torch.arange(first + lo - start, first + hi - start))
                    for d in range(self.num_deepstack):
                        deep[d].append(tensor[1 + d, src])
                    if hi == img.offset + img.num_tokens:
                        req.embeds[i] = None  # fully computed: free the device copy
            first += chunk.num_tokens
        deepstack = None
        if rows and self.num_deepstack:
            deepstack = DeepstackInput(
                torch.cat(rows).to(embeds.device), [torch.cat(parts) for parts in deep]
            )
        return StepImageInputs(positions, embeds, deepstack)
