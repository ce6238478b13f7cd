"""Image parts of chat requests on the API server: fetch or unpack each `image_url`, decode it to
check it (on a thread pool of its own, a request at most half of it; every refusal is an HTTP 400
naming the image and the reason), work out its ViT grid from its upright size, and expand the chat
template's single `<|image_pad|>` per image into t*h*w/merge^2 of them.

Called by serving_chat.py (loading, before the prompt is built) and prompts.py (expansion). The
pixels themselves are not processed here: the encoded file travels on to the visual server in
`ImageData` (preprocessing runs there, and only on a cache miss). Torch-free.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from appliance.config import VisualConfig
from appliance.encoder.startup import wants_visual_server
from appliance.messages import ImageData
from appliance.metrics import MetricsRecorder
from appliance.server.errors import BadRequest
from appliance.server.protocol import ChatMessage, ImagePart
from visual.checkpoint import image_token_id, preprocess_config
from visual.image_io import (
    FetchOptions,
    ImageError,
    ImageLimits,
    check_image,
    fetch_image_bytes,
    is_data_uri,
    parse_data_uri,
)
from visual.preprocess import PreprocessConfig, image_grid

NOT_SUPPORTED = "messages: image input is not supported by this model server."
# Images are decoded (to check them) on threads of their own, and one request uses at most half of
# them: a request with many large pictures does not hold up the next request's small one.
DECODE_THREADS = max(2, min(8, os.cpu_count() or 2))
DECODES_PER_REQUEST = DECODE_THREADS // 2
_decoder = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="image-check")


@dataclass(frozen=True)
class RequestImage:
    """One checked image of a request, in message order."""

    key: str  # content hash of the file (the visual server's cache key)
    data: bytes  # the file as received
    grid_thw: tuple[int, int, int]  # ViT patch grid after smart resize
    num_tokens: int  # <|image_pad|> tokens it expands to


@dataclass(frozen=True)
class ImageSupport:
    """What this server accepts: on only when the visual server runs (same rule as the launcher)."""

    enabled: bool
    limits: ImageLimits
    fetch: FetchOptions
    max_images: int
    preprocess: PreprocessConfig | None = None
    image_token_id: int | None = None


@functools.lru_cache(maxsize=8)
def image_support(model_dir: str, config: VisualConfig) -> ImageSupport:
    enabled = wants_visual_server(model_dir, config)
    return ImageSupport(
        enabled,
        ImageLimits(config.max_image_bytes, config.max_image_pixels),
        FetchOptions(
            timeout_s=config.image_fetch_timeout_s, allowed_networks=config.allowed_networks
        ),
        config.max_images_per_request,
        preprocess_config(model_dir) if enabled else None,
        image_token_id(model_dir) if enabled else None,
    )


def image_parts(messages: Sequence[ChatMessage]) -> list[ImagePart]:
    """Every image part of every message (earlier turns included), in conversation order."""
    return [
        part
        for message in messages
        if isinstance(message.content, list)
        for part in message.content
        if isinstance(part, ImagePart)
    ]


async def _load_one(
    support: ImageSupport,
    url: str,
    index: int,
    metrics: MetricsRecorder | None,
    decoding: asyncio.Semaphore,
) -> RequestImage:
    start = time.monotonic()
    code = "invalid_image"  # OpenAI's machine-readable code: the file is unusable ...
    try:
        if is_data_uri(url):
            data = parse_data_uri(url, support.limits)
        else:
            code = "invalid_image_url"  # ... or could not be fetched
            data = await fetch_image_bytes(url, support.fetch, support.limits)
            code = "invalid_image"
        async with decoding:
            loop = asyncio.get_running_loop()
            width, height = await loop.run_in_executor(_decoder, check_image, data, support.limits)
        grid = image_grid(height, width, support.preprocess)
    except ImageError as exc:
        raise BadRequest(f"messages: image {index + 1}: {exc.reason}", "messages", code) from None
    if metrics is not None:
        metrics.on_image_stage("fetch_decode", time.monotonic() - start)
    num_tokens = grid[0] * grid[1] * grid[2] // support.preprocess.merge_size**2
    key = hashlib.blake2b(data, digest_size=16).hexdigest()
    return RequestImage(key, data, grid, num_tokens)


async def load_images(
    support: ImageSupport,
    messages: Sequence[ChatMessage],
    metrics: MetricsRecorder | None = None,
) -> list[RequestImage]:
    """Fetch / unpack and check every image of a request, concurrently. BadRequest (400) when the
    model takes no images, there are too many, or one of them is unusable (the reason says why)."""
    parts = image_parts(messages)
    if not parts:
        return []
    if not support.enabled:
        raise BadRequest(NOT_SUPPORTED, "messages")
    if len(parts) > support.max_images:
        raise BadRequest(
            f"messages: {len(parts)} images; at most {support.max_images} per request.",
            "messages",
        )
    decoding = asyncio.Semaphore(DECODES_PER_REQUEST)
    loads = [_load_one(support, p.image_url.url, i, metrics, decoding) for i, p in enumerate(parts)]
    return list(await asyncio.gather(*loads))


def expand_image_tokens(
    token_ids: list[int], image_token_id: int, images: Sequence[RequestImage]
) -> tuple[list[int], list[ImageData]]:
    """The rendered prompt has one `<|image_pad|>` per image; each becomes `num_tokens` of them.
    Returns the expanded ids and, per image, its ImageData (offset of its first pad token)."""
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) != len(images):
        raise BadRequest(
            f"messages: the chat template produced {len(positions)} image placeholders for "
            f"{len(images)} images.",
            "messages",
        )
    expanded: list[int] = []
    data: list[ImageData] = []
    previous = 0
    for position, image in zip(positions, images):
        expanded += token_ids[previous:position]
        data.append(ImageData(image.key, image.data, len(expanded), image.grid_thw))
        expanded += [image_token_id] * image.num_tokens
        previous = position + 1
    expanded += token_ids[previous:]
    return expanded, data
