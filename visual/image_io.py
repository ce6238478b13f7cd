"""Image bytes in, RGB PIL image out: data: URIs, guarded http(s) fetching, bounded decoding.

Called by the API server while it validates a chat request (every failure is an `ImageError` whose
`reason` goes back to the client as HTTP 400). Torch-free: the API server never imports torch.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass

import httpx
from PIL import Image, ImageOps

DECODABLE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # PIL format names Image.open may try
# declared media types of data: URIs ("image/*": every image type); the decoder tells the format
# from the bytes (vLLM's rule), so a generic or unusual type (image/x-png, image/pjpeg) is as good
# as the right one, and a format it cannot read (image/tiff) is refused naming the ones it can
DATA_URI_TYPES = ("image/*", "application/octet-stream")
# EXIF orientations that ImageOps.exif_transpose acts on, and those that turn the picture a
# quarter (width and height swap)
_ORIENTATIONS = (1, 2, 3, 4, 5, 6, 7, 8)
_QUARTER_TURNS = (5, 6, 7, 8)
_REDIRECT_CODES = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

# PIL's decompression-bomb limit is a module global; we set it per call under this lock so that two
# requests with different limits cannot see each other's value.
_PIL_LIMIT_LOCK = threading.Lock()


class ImageError(ValueError):
    """A client-supplied image that cannot be used; `reason` is safe to show to the client."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024  # encoded bytes per image (data URI payload or download)
    max_pixels: int = 40_000_000  # width*height from the file header (decompression-bomb guard)

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError("max_bytes: expected an integer >= 1")
        if self.max_pixels < 1:
            raise ValueError("max_pixels: expected an integer >= 1")


@dataclass(frozen=True)
class FetchOptions:
    timeout_s: float = 10.0  # whole fetch deadline: every redirect hop plus the body
    max_redirects: int = 3  # redirect hops followed before giving up
    allowed_networks: tuple[str, ...] = ()  # CIDRs fetched even if non-public ("127.0.0.1/32")
    # media types accepted from the server ("image/*": every image type; the decoder tells the
    # format from the bytes)
    allowed_content_types: tuple[str, ...] = (*DATA_URI_TYPES, "binary/octet-stream")
    user_agent: str = "appliance-image-fetch/1"  # User-Agent header sent with each request

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError("timeout_s: expected a number > 0")
        if self.max_redirects < 0:
            raise ValueError("max_redirects: expected an integer >= 0")
        try:
            for cidr in self.allowed_networks:
                ipaddress.ip_network(cidr, strict=False)
        except ValueError as exc:
            raise ValueError(f"allowed_networks: expected CIDR strings ({exc})") from None


# ---------------------------------------------------------------------------------------- decoding


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of `image`; transparency composited onto white (as the HF processor does)."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _open_header(data: bytes, max_pixels: int) -> Image.Image:
    """Image.open (header only) with PIL's bomb limit set to `max_pixels` for this call."""
    with _PIL_LIMIT_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        previous = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            return Image.open(io.BytesIO(data), formats=list(DECODABLE_FORMATS))
        finally:
            Image.MAX_IMAGE_PIXELS = previous


def _load(data: bytes, limits: ImageLimits) -> Image.Image:
    """The first frame of PNG / JPEG / WebP / GIF / BMP bytes, fully decoded (every truncation or
    corruption found) within the byte and pixel limits."""
    if not data:
        raise ImageError("image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    try:
        image = _open_header(data, limits.max_pixels)
    except Image.DecompressionBombError:
        raise ImageError(f"image has more than {limits.max_pixels} pixels") from None
    except Image.UnidentifiedImageError:
        raise ImageError("data is not a supported image (PNG, JPEG, WebP, GIF or BMP)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"could not read image header: {exc}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"image has an invalid size {width}x{height}")
    if width * height > limits.max_pixels:
        raise ImageError(
            f"image is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}"
        )
    try:
        image.seek(0)  # first frame of an animated GIF / WebP
        image.load()
        return image
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise ImageError(f"could not decode {image.format} image: {exc}") from None


def _orientation(image: Image.Image) -> int:
    """The EXIF Orientation tag as exif_transpose reads it: a value it does not act on (a tag
    stored as text, "6", or out of range) counts as 1, so check_image's size (the ViT grid the
    API server announces) is always the size decode_image gives."""
    try:
        value = image.getexif().get(0x0112, 1)
    except (OSError, SyntaxError, ValueError, TypeError):
        return 1  # unreadable EXIF: as stored, as exif_transpose leaves it
    return int(value) if value in _ORIENTATIONS else 1


def check_image(data: bytes, limits: ImageLimits | None = None) -> tuple[int, int]:
    """(width, height) of the picture `decode_image` gives, after decoding it in full to find any
    fault (the API server's check: no RGB copy, no turn)."""
    image = _load(data, limits or ImageLimits())
    width, height = image.size
    return (height, width) if _orientation(image) in _QUARTER_TURNS else (width, height)


def decode_image(data: bytes, limits: ImageLimits | None = None) -> Image.Image:
    """PNG / JPEG / WebP / GIF (first frame) / BMP bytes as a loaded RGB image, turned upright as
    its EXIF orientation says (what transformers' load_image, vLLM and a photo viewer show)."""
    image = _load(data, limits or ImageLimits())
    if _orientation(image) != 1:
        try:
            image = ImageOps.exif_transpose(image)
        except (OSError, SyntaxError, ValueError, TypeError) as exc:
            raise ImageError(f"could not apply the image's EXIF orientation: {exc}") from None
    return to_rgb(image)


# ----------------------------------------------------------------------------------- data: URIs


def _type_allowed(media_type: str, allowed: tuple[str, ...]) -> bool:
    """`media_type` (lower case, no parameters) is one of `allowed`, where "image/*" is any image
    type."""
    return media_type in allowed or f"{media_type.partition('/')[0]}/*" in allowed


def is_data_uri(url: str) -> bool:
    return url[:5].lower() == "data:"


def parse_data_uri(uri: str, limits: ImageLimits | None = None) -> bytes:
    """Bytes of a `data:image/<type>;base64,<payload>` URI (RFC 2397, base64 form only)."""
    limits = limits or ImageLimits()
    if not is_data_uri(uri):  # URI schemes are case-insensitive (RFC 3986)
        raise ImageError("not a data: URI")
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise ImageError("malformed data: URI (no ',' before the payload)")
    media_type, *params = [part.strip().lower() for part in header.split(";")]
    if "base64" not in params:
        raise ImageError("data: URI must be base64-encoded (';base64,')")
    if not _type_allowed(media_type, DATA_URI_TYPES):
        shown = media_type or "(none)"
        raise ImageError(f"unsupported data: URI media type {shown}; use one of {DATA_URI_TYPES}")
    return parse_base64(payload, limits, "data: URI payload")


def parse_base64(payload: str, limits: ImageLimits | None = None, what: str = "image") -> bytes:
    """Bytes of a base64 image (a data: URI's payload, or SGLang's bare base64 strings); `what`
    names it in the error."""
    limits = limits or ImageLimits()
    payload = "".join(payload.split())  # clients sometimes wrap base64 lines
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise ImageError(f"image is larger than the limit of {limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what} is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    return data


# ---------------------------------------------------------------------------------------- http(s)


def _is_forbidden(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for loopback, private, link-local, reserved, multicast, unspecified, shared."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address.teredo is not None:
            embedded = address.teredo[1]
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None and _is_forbidden(embedded):
            return True
    return address.is_multicast or not address.is_global


def _check_addresses(host: str, addresses: list[str], options: FetchOptions) -> None:
    allowed = [ipaddress.ip_network(cidr, strict=False) for cidr in options.allowed_networks]
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone id
        if any(address in network for network in allowed):
            continue
        if _is_forbidden(address):
            raise ImageError(f"image URL host {host} resolves to a non-public address ({address})")


async def _resolve(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ImageError(f"could not resolve image URL host {host}: {exc}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise ImageError(f"could not resolve image URL host {host}")
    return addresses


def _parse_http_url(url: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise ImageError(f"invalid image URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        shown = parsed.scheme or "(none)"
        raise ImageError(f"unsupported image URL scheme {shown}; use http, https or a data: URI")
    if not parsed.host:
        raise ImageError("image URL has no host")
    if parsed.userinfo:
        raise ImageError("image URLs with credentials are not accepted")
    return parsed


async def _fetch_once(
    url: httpx.URL, options: FetchOptions, limits: ImageLimits, deadline: float
) -> tuple[bytes | None, str | None]:
    """One hop: (body, None) on 200, (None, next_url) on a redirect; connects to checked IPs."""
    host = url.raw_host.decode("ascii")
    port = url.port or (443 if url.scheme == "https" else 80)
    addresses = await _resolve(host, port)
    _check_addresses(host, addresses, options)
    # Pin the connection to the address we checked (no second DNS lookup that could rebind);
    # Host header and TLS SNI still carry the original name so virtual hosts and certificates work.
    pinned = url.copy_with(host=addresses[0])
    headers = {
        "Host": url.netloc.decode("ascii"),
        "User-Agent": options.user_agent,
        "Accept": "image/*",
    }
    extensions = {"sni_hostname": host} if url.scheme == "https" else {}
    timeout = httpx.Timeout(max(0.001, deadline - time.monotonic()))
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, timeout=timeout
    ) as client:
        request = client.build_request("GET", pinned, headers=headers, extensions=extensions)
        response = await client.send(request, stream=True)
        try:
            if response.status_code in _REDIRECT_CODES and "location" in response.headers:
                return None, urllib.parse.urljoin(str(url), response.headers["location"])
            if response.status_code != 200:
                raise ImageError(f"image URL returned HTTP {response.status_code}")
            media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if not _type_allowed(media_type, options.allowed_content_types):
                raise ImageError(f"image URL returned content type {media_type or '(none)'}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise ImageError(
                    f"image is {declared} bytes; the limit is {limits.max_bytes} bytes"
                )
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise ImageError(f"image is larger than the limit of {limits.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise ImageError(f"image download took longer than {options.timeout_s} s")
            return bytes(body), None
        finally:
            await response.aclose()


async def fetch_image_bytes(
    url: str, options: FetchOptions | None = None, limits: ImageLimits | None = None
) -> bytes:
    """Download an http(s) image with a deadline, a byte cap, a content-type check, bounded
    redirects and refusal of non-public addresses (every hop re-resolved and re-checked)."""
    options = options or FetchOptions()
    limits = limits or ImageLimits()
    deadline = time.monotonic() + options.timeout_s
    current = url
    try:
        for _hop in range(options.max_redirects + 1):
            body, redirect = await asyncio.wait_for(
                _fetch_once(_parse_http_url(current), options, limits, deadline),
                timeout=max(0.001, deadline - time.monotonic()),
            )
            if body is not None:
                return body
            current = redirect
    except asyncio.TimeoutError:
        raise ImageError(f"image download took longer than {options.timeout_s} s") from None
    except httpx.TimeoutException:
        raise ImageError(f"image download took longer than {options.timeout_s} s") from None
    except httpx.HTTPError as exc:
        raise ImageError(f"image download failed: {type(exc).__name__}: {exc}") from None
    raise ImageError(f"image URL redirected more than {options.max_redirects} times")


async def load_image(
    url: str, limits: ImageLimits | None = None, fetch: FetchOptions | None = None
) -> Image.Image:
    """An OpenAI `image_url.url` (data: URI or http(s) URL) as a decoded RGB image."""
    limits = limits or ImageLimits()
    if is_data_uri(url):
        data = parse_data_uri(url, limits)
    else:
        data = await fetch_image_bytes(url, fetch, limits)
    return await asyncio.to_thread(decode_image, data, limits)
