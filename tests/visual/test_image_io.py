"""visual.image_io decoding and data: URIs: formats, limits and the reasons given for bad images."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from visual.image_io import ImageError, ImageLimits, check_image, decode_image, parse_data_uri


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height (no pixel data): a decompression-bomb header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt,kwargs", [("PNG", {}), ("WEBP", {"lossless": True}), ("BMP", {})])
def test_lossless_formats_decode_exactly(fmt, kwargs, make_image):
    image = make_image(37, 23, seed=4)
    decoded = decode_image(encode(image, fmt, **kwargs))
    assert decoded.mode == "RGB" and decoded.size == (37, 23)
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


def test_jpeg_decodes_close_to_source():
    gradient = np.linspace(0, 255, 48 * 32 * 3).reshape(32, 48, 3).astype(np.uint8)
    decoded = decode_image(encode(Image.fromarray(gradient), "JPEG", quality=95))
    assert decoded.size == (48, 32) and decoded.mode == "RGB"
    assert np.abs(np.asarray(decoded).astype(int) - gradient).mean() < 3


def test_gif_gives_first_frame():
    frames = [Image.new("RGB", (20, 10), color) for color in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    decoded = decode_image(data)
    assert decoded.mode == "RGB"
    assert np.asarray(decoded).reshape(-1, 3).tolist() == [[255, 0, 0]] * 200


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent
    rgba.putpixel((0, 0), (10, 20, 30, 255))  # one opaque pixel
    decoded = np.asarray(decode_image(encode(rgba, "PNG")))
    assert decoded[0, 0].tolist() == [10, 20, 30]
    assert decoded[3, 3].tolist() == [255, 255, 255]


def test_truncated_png_is_refused(make_image):
    data = encode(make_image(64, 64, seed=1), "PNG")
    with pytest.raises(ImageError, match="could not decode PNG"):
        decode_image(data[: len(data) // 2])


def test_non_image_bytes_are_refused():
    with pytest.raises(ImageError, match="not a supported image"):
        decode_image(b"<html>definitely not an image</html>")
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")


def test_unsupported_format_is_refused(make_image):
    with pytest.raises(ImageError, match="not a supported image"):
        decode_image(encode(make_image(8, 8), "TIFF"))


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_turns_the_picture_upright(make_image, orientation):
    """A phone photo stores its pixels as the sensor saw them and says how to turn them (EXIF
    Orientation): decoded as transformers' load_image and vLLM do, upright; check_image (the API
    server's, which sizes the ViT grid) gives the upright size without turning anything."""
    image = make_image(40, 12, seed=5)  # stored landscape
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image, "PNG", exif=exif.tobytes())
    decoded = decode_image(data)
    upright = {1: image, 3: image.transpose(Image.Transpose.ROTATE_180)}.get(orientation)
    if orientation == 6:
        upright = image.transpose(Image.Transpose.ROTATE_270)
    if orientation == 8:
        upright = image.transpose(Image.Transpose.ROTATE_90)
    assert decoded.size == upright.size and check_image(data) == upright.size
    assert np.array_equal(np.asarray(decoded), np.asarray(upright.convert("RGB")))


def _exif_orientation(field_type: int, count: int, value: bytes) -> bytes:
    """An EXIF block whose only entry is the Orientation tag (0x0112) of the given TIFF field
    type, written by hand: Pillow's writer only stores it as a SHORT."""
    entry = struct.pack(">HHI", 0x0112, field_type, count) + value.ljust(4, b"\0")
    tiff = b"MM\x00*" + struct.pack(">IH", 8, 1) + entry + struct.pack(">I", 0)
    return b"Exif\x00\x00" + tiff


@pytest.mark.parametrize(
    "field_type,count,value",
    [
        (2, 2, b"6\0"),  # ASCII "6": exif_transpose leaves the picture as stored
        (4, 1, struct.pack(">I", 6)),  # LONG 6: turned
        (7, 1, b"\x06"),  # UNDEFINED b"\x06": as stored
        (3, 1, struct.pack(">H", 9)),  # SHORT 9, not an orientation: as stored
    ],
)
def test_check_image_size_is_the_decoded_size_whatever_the_orientation_tag_holds(
    make_image, field_type, count, value
):
    """The API server sizes the ViT grid with check_image and the visual server decodes with
    decode_image; an Orientation tag stored as text once made them disagree (a 500, "grid ...
    differs from the server's")."""
    data = encode(
        make_image(40, 12, seed=5), "JPEG", exif=_exif_orientation(field_type, count, value)
    )
    assert check_image(data) == decode_image(data).size


def test_decompression_bomb_header_is_refused_and_pil_limit_restored():
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageError, match="pixels") as caught:
        decode_image(png_header_only(50000, 50000))
    assert "50000" in caught.value.reason or "more than" in caught.value.reason
    assert Image.MAX_IMAGE_PIXELS == before


def test_pixel_limit_is_per_call(make_image):
    data = encode(make_image(100, 100), "PNG")  # 10 000 pixels
    assert decode_image(data, ImageLimits(max_pixels=10_000)).size == (100, 100)
    with pytest.raises(ImageError, match="limit is 9999"):
        decode_image(data, ImageLimits(max_pixels=9_999))
    with pytest.raises(ImageError, match="more than 4000 pixels"):  # PIL's own check (> 2x limit)
        decode_image(data, ImageLimits(max_pixels=4_000))


def test_byte_limit(make_image):
    data = encode(make_image(32, 32), "PNG")
    with pytest.raises(ImageError, match="bytes"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))


def test_data_uri_round_trip(make_image):
    image = make_image(16, 12, seed=2)
    payload = base64.b64encode(encode(image, "PNG")).decode()
    wrapped = "\n".join(payload[i : i + 60] for i in range(0, len(payload), 60))
    uris = (
        f"data:image/png;base64,{payload}",
        f"data:IMAGE/PNG;base64,{wrapped}",
        f"DATA:application/octet-stream;base64,{payload}",  # schemes are case-insensitive
        f"data:image/x-png;base64,{payload}",  # any image type: the bytes tell the format
        f"data:image/jpeg;base64,{payload}",
    )
    for uri in uris:
        decoded = decode_image(parse_data_uri(uri))
        assert np.array_equal(np.asarray(decoded), np.asarray(image))


@pytest.mark.parametrize(
    "uri,reason",
    [
        ("data:image/png;base64", "no ','"),
        ("data:image/png,rawbytes", "base64"),
        ("data:text/plain;base64,aGVsbG8=", "media type text/plain"),
        ("data:;base64,aGVsbG8=", "media type"),
        ("data:application/pdf;base64,aGVsbG8=", "media type application/pdf"),
        ("data:image/png;base64,@@@notbase64@@@", "not valid base64"),
        ("https://example.com/x.png", "not a data: URI"),
    ],
)
def test_bad_data_uris(uri, reason):
    with pytest.raises(ImageError, match=reason):
        parse_data_uri(uri)


def test_data_uri_byte_limit_checked_before_decoding():
    payload = base64.b64encode(b"\0" * 4000).decode()
    with pytest.raises(ImageError, match="larger than the limit of 1000 bytes"):
        parse_data_uri(f"data:image/png;base64,{payload}", ImageLimits(max_bytes=1000))


def test_limits_validate():
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)
