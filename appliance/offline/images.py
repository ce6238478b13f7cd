"""Images of the offline `LLM`'s prompts (vLLM's `multi_modal_data`, chat image parts): decoded,
resized to the checkpoint's pixel range, encoded by the vision tower in this process and handed to
the workers as `ImageInput` handles. Called by offline/llm.py and offline/prompts.py.

The served path splits this over the API server (appliance/server/images.py), the visual server
(appliance/encoder/) and the router's ReleaseImages; offline one `OfflineImages` does all three.
On CUDA the ViT loads with the LLM and its worst-case activation memory is held back from the
pools, as behind the visual server (`reserve_vit`; `vision=False` opts out); on CPU it loads on the
first image. Embeddings go where the workers read them: at TP=1 the runner's store, swapped for an
in-process one (no copy through shared memory); at TP>1 shared-memory segments, written as the
visual server writes them. Each entry is held by the requests that use it and released when the
last of them ends.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from appliance.config import EngineConfig, VisualConfig
from appliance.logging import get_logger
from appliance.messages import ImageInput
from appliance.server.errors import BadRequest
from appliance.server.images import image_key, image_support, request_preprocess
from visual.checkpoint import has_vision_tower
from visual.image_io import ImageError, decode_image, fetch_image_bytes, parse_data_uri
from visual.preprocess import PreprocessConfig, preprocess_image

logger = get_logger(__name__)

# Image limits and batch size: the served defaults (`appliance serve`'s visual flags), which the
# offline LLM does not take as options
VISUAL = VisualConfig()


@dataclass
class PromptImage:
    """One preprocessed image of a prompt, in prompt order (`pixel_values` dropped once encoded)."""

    key: str  # content hash + grid (the served cache key for image files)
    grid_thw: tuple[int, int, int]  # ViT patch grid after smart resize
    num_tokens: int  # <|image_pad|> tokens it takes: t*h*w / merge^2
    pixel_values: np.ndarray | None  # [patches, patch_dim] until encoded


@dataclass
class _Entry:
    handle: str  # where the workers load it (ImageInput.handle)
    owners: set[str] = field(default_factory=set)  # live requests using it
    pending: PromptImage | None = None  # not encoded yet


def load_vit(model_dir: str, config: EngineConfig) -> Any:
    """The checkpoint's vision tower on worker rank 0's device, in the model's dtype (where the
    visual server would load it)."""
    from appliance.encoder.startup import vit_placement
    from visual.encoder import VisionEncoder

    device, dtype = vit_placement(config)
    load = config.model.load_format != "dummy"
    logger.info("loading the vision tower on %s for image prompts", device)
    return VisionEncoder.from_pretrained(model_dir, device, dtype, load_weights=load)


def reserve_vit(model_dir: str, config: EngineConfig, vision: bool) -> tuple[Any, int]:
    """(the ViT, the device bytes the workers leave free for its activations) when the model
    takes images and runs on CUDA: loaded up front and its worst case measured, as the visual
    server does before the workers size their pools, so a large image later does not run out of
    memory. (None, 0) otherwise: on CPU nothing is sized from free memory, and the ViT loads on
    the first image."""
    from appliance.encoder.startup import describe_reservation, plan_reservation, vit_placement

    if not image_support(model_dir, replace(VISUAL, vision=vision)).enabled:
        return None, 0
    device, _ = vit_placement(config)
    if device.type != "cuda":
        return None, 0
    encoder = load_vit(model_dir, config)
    info = plan_reservation(encoder, VISUAL)
    logger.info("%s", describe_reservation(info))
    return encoder, info.reserved_bytes


def _pil_key(image: Any, grid: tuple[int, int, int]) -> str:
    """A decoded image's content key: its pixels, mode and size hashed, and its grid."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    t, h, w = grid
    return f"pil{digest.hexdigest()}_{t}x{h}x{w}"


class OfflineImages:
    """Preprocessing, the ViT and the embedding entries of one offline LLM."""

    def __init__(
        self,
        model_dir: str,
        config: EngineConfig,
        runner: Any,
        tp: int,
        vision: bool = True,
        encoder: Any = None,
    ) -> None:
        """`vision` False: the prompts take no images (vLLM's language_model_only); `encoder`: the
        ViT the LLM loaded up front (on CUDA, to reserve its memory), else it loads on the first
        image."""
        self.model_dir = model_dir
        self.config = config
        self.runner = runner
        self.tp = tp
        self.support = image_support(model_dir, replace(VISUAL, vision=vision))
        self._encoder = encoder
        self._store = None
        self._entries: dict[str, _Entry] = {}  # content key -> entry

    @property
    def image_token_id(self) -> int | None:
        return self.support.image_token_id

    def check_enabled(self, where: str) -> None:
        if not self.support.enabled:
            raise ValueError(
                f"{where}: this LLM takes no images (vision=False)"
                if has_vision_tower(self.model_dir)
                else f"{where}: this model ({self.model_dir}) has no vision tower; its prompts "
                "take no images"
            )

    def preprocess_config(self, kwargs: dict | None, where: str) -> PreprocessConfig:
        """The checkpoint's preprocessing, resized to the pixel range of vLLM's
        `mm_processor_kwargs` (min_pixels / max_pixels / size), checked as the server checks it."""
        try:
            config = request_preprocess(self.support, kwargs)
        except BadRequest as exc:
            raise ValueError(f"{where}: {exc.message}") from None
        assert config is not None  # support.enabled was checked
        return config

    # ------------------------------------------------------------------ inputs
    def file_bytes(self, url: str, where: str) -> bytes:
        """An image_url's file: a data: URI unpacked, an http(s) URL fetched as the server fetches
        it (public addresses only, the served size limit and timeout)."""
        try:
            if url.startswith("data:"):
                return parse_data_uri(url, self.support.limits)
            fetch = fetch_image_bytes(url, self.support.fetch, self.support.limits)
            with ThreadPoolExecutor(1) as pool:  # asyncio.run: also under a running event loop
                return pool.submit(asyncio.run, fetch).result()
        except ImageError as exc:
            raise ValueError(f"{where}: {exc.reason}") from None

    def load(self, source: Any, config: PreprocessConfig, where: str) -> PromptImage:
        """A PIL image or an image file's bytes -> its ViT input rows and grid; a ValueError
        naming `where` for one that cannot be decoded or is too large."""
        from PIL import Image

        try:
            if isinstance(source, bytes | bytearray | memoryview):
                data = bytes(source)
                image = decode_image(data, self.support.limits)
            elif isinstance(source, Image.Image):
                data, image = None, source
                width, height = image.size
                if width * height > self.support.limits.max_pixels:
                    raise ImageError(
                        f"image is {width}x{height} pixels; the limit is "
                        f"{self.support.limits.max_pixels}"
                    )
            else:
                raise ImageError(
                    f"expected a PIL.Image or an image file's bytes, got {type(source).__name__}"
                )
            processed = preprocess_image(image, config)
        except ImageError as exc:
            raise ValueError(f"{where}: {exc.reason}") from None
        except (OSError, ValueError) as exc:  # a PIL image that cannot be converted
            raise ValueError(f"{where}: could not read the image: {exc}") from None
        grid = processed.grid_thw
        key = image_key(data, grid) if data is not None else _pil_key(image, grid)
        return PromptImage(key, grid, processed.num_tokens, processed.pixel_values)

    def inputs(
        self, images: Sequence[PromptImage], offsets: Sequence[int], req_id: str
    ) -> list[ImageInput]:
        """The request's `mm`: one handle per image, held for `req_id` until `release`. An image
        not seen yet is queued for `encode_pending` (the same image twice is encoded once)."""
        out = []
        for image, offset in zip(images, offsets):
            entry = self._entries.get(image.key)
            if entry is None:
                entry = _Entry(self._handle(image.key), pending=image)
                self._entries[image.key] = entry
            entry.owners.add(req_id)
            out.append(
                ImageInput(offset, image.num_tokens, image.grid_thw, entry.handle, image.key)
            )
        return out

    # ------------------------------------------------------------------ encoding
    def encode_pending(self) -> None:
        """Encodes every queued image, VISUAL.visual_max_batch_size per ViT forward, into the
        store; an entry's pixels are dropped once its embeddings are written."""
        pending = [entry for entry in self._entries.values() if entry.pending is not None]
        if not pending:
            return
        encoder, store = self._ensure_encoder()
        batch_size = VISUAL.visual_max_batch_size
        for first in range(0, len(pending), batch_size):
            batch = pending[first : first + batch_size]
            grids = [entry.pending.grid_thw for entry in batch]
            rows = np.concatenate([entry.pending.pixel_values for entry in batch])
            embeds, deepstack = encoder.encode(rows, grids)  # [tokens, hidden] each
            counts = [t * h * w // encoder.merge_unit for t, h, w in grids]
            parts = [x.cpu().split(counts) for x in (embeds, *deepstack)]  # [1 + D][images]
            for i, entry in enumerate(batch):
                store.put(entry.handle, parts[0][i], [deep[i] for deep in parts[1:]])
                entry.pending = None

    def _ensure_encoder(self):
        if self._store is None:
            if self.tp == 1:
                from appliance.engine.mm_inputs import InProcessImageStore

                self.runner.mm.store = self._store = InProcessImageStore()
            else:  # the worker processes read shared memory, as behind the visual server
                from visual.shm import UntrackedSegmentStore

                self._store = UntrackedSegmentStore()
        if self._encoder is None:
            self._encoder = load_vit(self.model_dir, self.config)
        return self._encoder, self._store

    def _handle(self, key: str) -> str:
        from visual.cache import segment_name

        return segment_name(key) if self.tp > 1 else key

    # ------------------------------------------------------------------ release
    def release(self, req_ids: Sequence[str]) -> None:
        """These requests ended: entries no live request holds are freed (segments unlinked)."""
        for key in [key for key, e in self._entries.items() if e.owners.intersection(req_ids)]:
            entry = self._entries[key]
            entry.owners.difference_update(req_ids)
            if not entry.owners:
                del self._entries[key]
                if entry.pending is None and self._store is not None:
                    self._store.release(entry.handle)

    def release_all(self) -> None:
        owners = {owner for entry in self._entries.values() for owner in entry.owners}
        self.release(sorted(owners))

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def __del__(self) -> None:  # an LLM dropped without close(): no segment outlives it
        try:
            self.release_all()
        except Exception:  # interpreter shutdown: modules may be gone
            pass
