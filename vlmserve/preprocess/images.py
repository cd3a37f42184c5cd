"""[pool] Decoding untrusted images safely: size limits, truncation, EXIF orientation, first frame."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

# 50 MP: a 7000x7000 photo decodes, a decompression bomb does not.
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_MAX_BYTES = 20 * 1024 * 1024


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


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), label: str = "image") -> Image.Image:
    """Decode bytes to an RGB image, upright per EXIF; GIFs and APNGs give their first frame."""
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
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{label}: not an image (unrecognized format)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{label}: too many pixels to decode safely") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"{label}: truncated or corrupt image ({exc})") from None


def _check_pixels(image: Image.Image, limits: ImageLimits, label: str) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{label}: empty image ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageError(
            f"{label}: {width}x{height} is over the {limits.max_pixels}-pixel limit"
        )
