"""Decoding untrusted images: formats, EXIF orientation, and every way an image can be bad."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from vlmserve.preprocess.images import ImageError, ImageLimits, decode_image, load_image_file


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _two_tone(size=(40, 20)) -> Image.Image:
    image = Image.new("RGB", size, (255, 0, 0))
    image.paste((0, 0, 255), (size[0] // 2, 0, size[0], size[1]))
    return image


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_common_formats_decode_to_rgb(fmt):
    image = decode_image(_encode(_two_tone(), fmt))
    assert image.mode == "RGB" and image.size == (40, 20)


def test_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    r, g, b = decode_image(buf.getvalue()).getpixel((4, 4))
    assert r > 200 and g < 50 and b < 50


def test_exif_orientation_is_respected():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    data = _encode(_two_tone((40, 20)), "JPEG", exif=exif.tobytes())
    image = decode_image(data)
    assert image.size == (20, 40)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"definitely not an image", "not an image"),
        (_encode(_two_tone(), "PNG")[:60], "truncated or corrupt"),
        (_encode(_two_tone((200, 200)), "JPEG")[:300], "truncated or corrupt"),
    ],
)
def test_bad_bytes_raise_image_error(data, message):
    with pytest.raises(ImageError, match=message):
        decode_image(data)


def test_too_many_pixels_is_refused_before_decoding():
    data = _encode(Image.new("RGB", (300, 300)), "PNG")
    with pytest.raises(ImageError, match="pixel limit"):
        decode_image(data, ImageLimits(max_pixels=200 * 200))


def test_too_many_bytes_is_refused():
    with pytest.raises(ImageError, match="byte limit"):
        decode_image(b"x" * 101, ImageLimits(max_bytes=100))


def test_files_missing_or_not_regular(tmp_path):
    with pytest.raises(ImageError, match="no such file"):
        load_image_file(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="not a regular file"):
        load_image_file(tmp_path)
    path = tmp_path / "ok.png"
    path.write_bytes(_encode(_two_tone(), "PNG"))
    assert load_image_file(path).size == (40, 20)


def test_slow_preprocessing_is_logged_with_id_tokens_and_seconds(caplog):
    import logging
    import time

    from vlmserve.preprocess.prompt import build_prompt

    class SlowTokenizer:
        bos_token = None

        def apply_chat_template(self, messages, **kwargs):
            time.sleep(1.05)
            return "hello world"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1, 2, 3]}

    with caplog.at_level(logging.WARNING, logger="vlmserve.preprocess.prompt"):
        prompt = build_prompt(SlowTokenizer(), [{"role": "user", "content": "hi"}], request_id="req-42")
    assert prompt.input_ids == [1, 2, 3]
    (record,) = caplog.records
    assert "req-42" in record.message and "3 tokens" in record.message and " s" in record.message
