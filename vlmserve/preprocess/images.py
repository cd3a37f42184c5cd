"""[pool] Decoding untrusted images safely: size limits, truncation, EXIF orientation, first frame."""

from __future__ import annotations

import io
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from vlmserve.preprocess.decode_budget import DecodeBudget
from vlmserve.preprocess.image_sizes import ProcessorLimit

# 50 MP: a 7000x7000 photo decodes, a decompression bomb does not.
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
_ORIENTATION = 0x0112  # EXIF: 5 to 8 turn the image a quarter, so its upright width is its stored height
_TURNED = (5, 6, 7, 8)
_REDUCIBLE = ("L", "LA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")


class ImageError(ValueError):
    """An image that cannot or must not be decoded; the message says which and why."""


@dataclass(slots=True, frozen=True)
class ImageLimits:
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES


def load_image_file(path: str | Path, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Read and decode an image file; every failure is an ``ImageError``."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ImageError(f"{path}: no such file") from None
    except OSError as exc:
        raise ImageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not path.is_file():
        raise ImageError(f"{path}: not a regular file")
    if size > limits.max_bytes:
        raise ImageError(f"{path}: {size} bytes is over the {limits.max_bytes}-byte limit")
    return decode_image(path.read_bytes(), limits, label=str(path))


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), label: str = "image",
                 keep: ProcessorLimit | None = None, budget: DecodeBudget | None = None) -> Image.Image:
    """Decode bytes to an RGB image, upright per EXIF; GIFs and APNGs give their first frame.

    With ``keep`` (the model's processor limit), a larger image is decoded at reduced size: JPEG in
    draft mode (1/2 to 1/8 scale, never fully), any other format whole then reduced by a whole factor,
    never below what the processor keeps. With ``budget``, its pixels count against the server's
    pixels being decoded at once while it decodes."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{label}: {len(data)} bytes is over the {limits.max_bytes}-byte limit")
    if not data:
        raise ImageError(f"{label}: empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_pixels(image, limits, label)
            image.seek(0)
            factor = _reduction(image, keep)
            if factor > 1 and image.format == "JPEG":
                image.draft(None, (image.width // factor, image.height // factor))  # sets the size it will decode
            with budget.hold(image.width * image.height) if budget else nullcontext():
                image.load()
                decoded = _upright_rgb(image, keep)
                if decoded is not image:
                    image.close()  # frees the full-size pixels now, before the budget gives memory back
                return decoded
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{label}: not an image (unrecognized format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{label}: too many pixels to decode safely") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"{label}: truncated or corrupt image ({exc})") from None


def _reduction(image: Image.Image, keep: ProcessorLimit | None) -> int:
    """The whole factor this (not yet upright) image may shrink by; reduction is the same both ways."""
    if keep is None:
        return 1
    width, height = image.size
    if image.getexif().get(_ORIENTATION, 1) in _TURNED:
        width, height = height, width
    return keep.reduction(width, height)


def _upright_rgb(image: Image.Image, keep: ProcessorLimit | None) -> Image.Image:
    """The image upright and in RGB, box-reduced to what the processor keeps: reduced first where
    Pillow can (its 8-bit modes), turned in place, converted last, so no full-size copy is made."""
    factor = _reduction(image, keep)
    if factor > 1 and image.mode in _REDUCIBLE:
        image, factor = image.reduce(factor), 1
    ImageOps.exif_transpose(image, in_place=True)
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return rgb.reduce(factor) if factor > 1 else rgb


def _check_pixels(image: Image.Image, limits: ImageLimits, label: str) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{label}: empty image ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageError(
            f"{label}: {width}x{height} is over the {limits.max_pixels}-pixel limit"
        )
