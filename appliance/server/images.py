"""Images of requests on the API server (chat's image parts, /generate's image_data): fetch or
unpack each one, decode it to check it (on a thread pool of its own, a request at most half of it;
every refusal is an HTTP 400 naming the image and the reason), work out its ViT grid from its
upright size and the request's pixel range (vLLM's `mm_processor_kwargs`, checked here), and
expand the prompt's single `<|image_pad|>` per image into t*h*w/merge^2 of them.

Called by serving_chat.py / serving_completion.py / serving_generate.py (range and loading, before
the prompt is built) and prompts.py (expansion). The pixels themselves are not processed here: the
encoded file travels on to the visual server in `ImageData`, with the range (preprocessing runs
there, and only on a cache miss). Torch-free.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

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
    parse_base64,
    parse_data_uri,
)
from visual.preprocess import PreprocessConfig, image_grid, pixel_range

NOT_SUPPORTED = "messages: image input is not supported by this model server."
MM_KWARGS = "mm_processor_kwargs"
# vLLM's Qwen2-VL / Qwen3-VL image keys: min/max_pixels, or transformers' size dict (pixel counts
# despite the edge names); min_pixels / max_pixels spell the same bounds as the size entries
_BOUNDS = ("min_pixels", "max_pixels")
_SIZE_BOUNDS = {"shortest_edge": "min_pixels", "longest_edge": "max_pixels"}
# Images are decoded (to check them) on threads of their own, and one request uses at most half of
# them: a request with many large pictures does not hold up the next request's small one.
DECODE_THREADS = max(2, min(8, os.cpu_count() or 2))
DECODES_PER_REQUEST = DECODE_THREADS // 2
_decoder = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="image-check")
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")


@dataclass(frozen=True)
class RequestImage:
    """One checked image of a request, in message order."""

    key: str  # content hash of the file + its grid (the visual server's cache key, image_key)
    data: bytes  # the file as received
    grid_thw: tuple[int, int, int]  # ViT patch grid after smart resize
    num_tokens: int  # <|image_pad|> tokens it expands to
    min_pixels: int = 0  # the request's resize range (mm_processor_kwargs); 0: the checkpoint's
    max_pixels: int = 0


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


def image_key(data: bytes, grid_thw: tuple[int, int, int]) -> str:
    """The embedding-cache key of a file resized to `grid_thw`: its content hash and the grid. The
    embeddings depend on nothing else (the pixels are resized to exactly grid * patch), so one file
    at two pixel ranges giving two grids is two entries (shared-memory segments, prefix-cache
    keys), and at two ranges giving the same grid one."""
    t, h, w = grid_thw
    return f"{hashlib.blake2b(data, digest_size=16).hexdigest()}_{t}x{h}x{w}"


def _bound(given: dict[str, tuple[str, int]], bound: str, spelling: str, value: Any) -> None:
    if value is None:  # vLLM reads null as unset
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(
            f"{MM_KWARGS}.{spelling}: expected a pixel count, an integer >= 1, got {value!r}.",
            MM_KWARGS,
        )
    if bound in given and given[bound][1] != value:
        other, before = given[bound]
        raise BadRequest(
            f"{MM_KWARGS}.{spelling}: {value} differs from {other} {before} (the same bound).",
            MM_KWARGS,
        )
    given[bound] = (spelling, value)


def _given_bounds(kwargs: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """min_pixels / max_pixels -> (the key that set it, the value), unknown keys refused."""
    given: dict[str, tuple[str, int]] = {}
    for key, value in kwargs.items():
        if key in _BOUNDS:
            _bound(given, key, key, value)
        elif key == "size" and (value is None or isinstance(value, dict)):
            for edge, count in (value or {}).items():
                if edge not in _SIZE_BOUNDS:
                    raise BadRequest(
                        f"{MM_KWARGS}.size.{edge}: not supported; size takes shortest_edge and "
                        "longest_edge (pixel counts).",
                        MM_KWARGS,
                    )
                _bound(given, _SIZE_BOUNDS[edge], f"size.{edge}", count)
        elif key == "size":
            raise BadRequest(
                f"{MM_KWARGS}.size: expected an object with shortest_edge / longest_edge.",
                MM_KWARGS,
            )
        else:
            raise BadRequest(
                f"{MM_KWARGS}.{key}: not supported; images take min_pixels, max_pixels and size "
                "(shortest_edge / longest_edge).",
                MM_KWARGS,
            )
    return given


def request_preprocess(
    support: ImageSupport, kwargs: dict[str, Any] | None
) -> PreprocessConfig | None:
    """The preprocessing settings of a request's images: the checkpoint's, resized to the pixel
    range its mm_processor_kwargs give (vLLM's Qwen-VL keys). A 400 naming the key for an unknown
    key, a value that is not a positive integer, min above max, or a range the ViT's memory
    reservation does not cover (max_pixels above the checkpoint's). Checked on every request of a
    server that takes images, images or not; None (ignored) on one that takes none."""
    if not support.enabled:
        return None
    given = _given_bounds(kwargs or {})
    if not given:
        return support.preprocess
    low, high = (given.get(bound, ("", 0))[1] for bound in _BOUNDS)
    try:
        return pixel_range(support.preprocess, low, high, support.limits.max_pixels)
    except ValueError as exc:
        bound, _, reason = str(exc).partition(": ")
        spelling = given.get(bound, (bound, 0))[0]
        raise BadRequest(f"{MM_KWARGS}.{spelling}: {reason}.", MM_KWARGS) from None


def image_parts(messages: Sequence[ChatMessage]) -> list[ImagePart]:
    """Every image part of every message (earlier turns included), in conversation order."""
    return [
        part
        for message in messages
        if isinstance(message.content, list)
        for part in message.content
        if isinstance(part, ImagePart)
    ]


@dataclass(frozen=True)
class ImageSource:
    """One image of a request as the client gave it, and how a 400 about it is worded."""

    url: str  # http(s) URL or data: URI (or bare base64 where `bare_base64`)
    label: str  # "messages: image 2", "image_data: prompt 1, image 1"
    param: str  # the field the 400 names
    bare_base64: bool = False  # SGLang's image_data: a string that is no URL is base64


async def _load_one(
    support: ImageSupport,
    preprocess: PreprocessConfig,
    source: ImageSource,
    metrics: MetricsRecorder | None,
    decoding: asyncio.Semaphore,
) -> RequestImage:
    start = time.monotonic()
    code = "invalid_image"  # OpenAI's machine-readable code: the file is unusable ...
    url = source.url
    try:
        if is_data_uri(url):
            data = parse_data_uri(url, support.limits)
        elif source.bare_base64 and not _is_url(url):
            data = _bare_base64(url, support)
        else:
            code = "invalid_image_url"  # ... or could not be fetched
            data = await fetch_image_bytes(url, support.fetch, support.limits)
            code = "invalid_image"
        async with decoding:
            loop = asyncio.get_running_loop()
            width, height = await loop.run_in_executor(_decoder, check_image, data, support.limits)
        grid = image_grid(height, width, preprocess)
    except ImageError as exc:
        raise BadRequest(f"{source.label}: {exc.reason}", source.param, code) from None
    if metrics is not None:
        metrics.on_image_stage("fetch_decode", time.monotonic() - start)
    num_tokens = grid[0] * grid[1] * grid[2] // preprocess.merge_size**2
    ranged = preprocess != support.preprocess  # the message carries 0s for the checkpoint's
    low, high = (preprocess.min_pixels, preprocess.max_pixels) if ranged else (0, 0)
    return RequestImage(image_key(data, grid), data, grid, num_tokens, low, high)


def _is_url(text: str) -> bool:
    return "://" in text[:16]


def _bare_base64(text: str, support: ImageSupport) -> bytes:
    """SGLang's bare base64 image string. SGLang also reads a string that is neither a URL nor
    base64 as a file path on the server; this server reads no local files."""
    neither = (
        "neither an http(s) URL, a data: URI nor base64 (local file paths are not read by this "
        "server)"
    )
    if not _BASE64.fullmatch(text):
        raise ImageError(neither)
    try:
        return parse_base64(text, support.limits)
    except ImageError as exc:
        if "not valid base64" in exc.reason:
            raise ImageError(neither) from None
        raise


async def load_image_sources(
    support: ImageSupport,
    sources: Sequence[ImageSource],
    param: str,
    metrics: MetricsRecorder | None = None,
    preprocess: PreprocessConfig | None = None,
) -> list[RequestImage]:
    """Fetch / unpack and check `sources`, concurrently, sized by `preprocess` (the request's,
    request_preprocess; None: the checkpoint's). BadRequest (400, naming `param` or the image's
    field) when the model takes no images, there are too many, or one of them is unusable (the
    reason says why)."""
    if not sources:
        return []
    if not support.enabled:
        raise BadRequest(NOT_SUPPORTED.replace("messages", param, 1), param)
    if len(sources) > support.max_images:
        raise BadRequest(
            f"{param}: {len(sources)} images; at most {support.max_images} per request.", param
        )
    decoding = asyncio.Semaphore(DECODES_PER_REQUEST)
    preprocess = preprocess or support.preprocess
    loads = [_load_one(support, preprocess, s, metrics, decoding) for s in sources]
    return list(await asyncio.gather(*loads))


async def load_images(
    support: ImageSupport,
    messages: Sequence[ChatMessage],
    metrics: MetricsRecorder | None = None,
    preprocess: PreprocessConfig | None = None,
) -> list[RequestImage]:
    """Every image part of a chat request's messages, loaded by load_image_sources."""
    sources = [
        ImageSource(p.image_url.url, f"messages: image {i + 1}", "messages")
        for i, p in enumerate(image_parts(messages))
    ]
    return await load_image_sources(support, sources, "messages", metrics, preprocess)


def expand_image_tokens(
    token_ids: list[int],
    image_token_id: int,
    images: Sequence[RequestImage],
    where: tuple[str, str, str] = ("messages", "the chat template produced", ""),
) -> tuple[list[int], list[ImageData]]:
    """The rendered prompt has one `<|image_pad|>` per image; each becomes `num_tokens` of them.
    Returns the expanded ids and, per image, its ImageData (offset of its first pad token).
    `where` words a count mismatch's 400: (the field it names, what made the placeholders, a
    hint to end it)."""
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) != len(images):
        param, made, hint = where
        raise BadRequest(
            f"{param}: {made} {len(positions)} image placeholders for {len(images)} images."
            + (f" {hint}" if hint else ""),
            param,
        )
    expanded: list[int] = []
    data: list[ImageData] = []
    previous = 0
    for position, image in zip(positions, images):
        expanded += token_ids[previous:position]
        data.append(
            ImageData(
                image.key,
                image.data,
                len(expanded),
                image.grid_thw,
                image.min_pixels,
                image.max_pixels,
            )
        )
        expanded += [image_token_id] * image.num_tokens
        previous = position + 1
    expanded += token_ids[previous:]
    return expanded, data
