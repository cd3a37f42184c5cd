"""[pool] Image and video sources from a request: data URLs, allowed local files, and (opt-in) remote URLs."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
from PIL import Image

from vlmserve.preprocess.audio import AudioLimits, audio_bytes, decode_audio
from vlmserve.preprocess.decode_budget import DecodeBudget
from vlmserve.preprocess.image_sizes import ProcessorLimit
from vlmserve.preprocess.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, ImageError, ImageLimits, decode_image
from vlmserve.preprocess.video import Video, VideoError, VideoSampling, decode_video

DEFAULT_MAX_VIDEO_BYTES = 200 * 1024 * 1024
# Pixels being decoded at once, server-wide: two 48 MP phone photos, about 0.7 GB at their peak.
DEFAULT_DECODE_PIXELS = 100_000_000
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,(?P<data>.*)$", re.S)


@dataclass(slots=True, frozen=True)
class MediaPolicy:
    """Where images may come from, and how big they may be."""

    allowed_dirs: tuple[Path, ...] = field(default_factory=tuple)
    allow_remote: bool = False
    allowed_domains: tuple[str, ...] = ()  # when given, the only hosts remote URLs may name
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = 8
    max_videos: int = 1
    max_audio: int = 4  # input_audio clips in one request
    audio: AudioLimits = AudioLimits()  # bytes and seconds of one clip
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    video_sampling: VideoSampling = VideoSampling(fps=2.0, max_frames=32)  # the server's defaults
    remote_timeout_s: float = 10.0
    decoding: DecodeBudget = field(default_factory=lambda: DecodeBudget(DEFAULT_DECODE_PIXELS), compare=False)

    @property
    def limits(self) -> ImageLimits:
        return ImageLimits(self.max_pixels, self.max_bytes)


def load_image_source(url: str, policy: MediaPolicy, label: str = "image",
                      keep: ProcessorLimit | None = None) -> Image.Image:
    """Fetch and decode one ``image_url`` (no larger than ``keep``, the model's processor limit, needs;
    under the policy's decode budget); every refusal is an ``ImageError`` naming the image."""
    source = _source(url, policy, label, "image", policy.max_bytes, ImageError)
    try:
        data = source if isinstance(source, bytes) else source.read_bytes()
    except OSError as exc:  # a permission, a race with a deletion
        raise ImageError(f"{label}: cannot read {url}: {type(exc).__name__}") from None
    return decode_image(data, policy.limits, label, keep, policy.decoding)


def load_video_source(url: str, policy: MediaPolicy, sampling: VideoSampling, label: str = "video") -> Video:
    """Fetch one ``video_url`` and decode the frames ``sampling`` chooses (under the policy's decode
    budget); every refusal is a ``VideoError`` naming the video."""
    source = _source(url, policy, label, "video", policy.max_video_bytes, VideoError)
    return decode_video(source, sampling, policy.max_pixels, label, policy.decoding)


def load_audio_source(data: str, fmt: str, policy: MediaPolicy, rate: int, label: str = "audio") -> np.ndarray:
    """Decode one ``input_audio`` to mono samples at ``rate`` (the model's feature extractor's) within the
    policy's bytes and seconds; every refusal is an ``AudioError`` naming the clip."""
    return decode_audio(audio_bytes(data, label, policy.audio), fmt, label, policy.audio, rate)


def _source(url: str, policy: MediaPolicy, label: str, kind: str, max_bytes: int,
            error: type[ImageError]) -> bytes | Path:
    """The bytes a URL names, or an allowed local file's path (read by its decoder)."""
    try:
        scheme = urlparse(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
        if url.startswith("data:"):
            return _data_url_bytes(url, label, kind, max_bytes)
        if scheme in ("http", "https"):
            return _fetch_remote(url, policy, label, max_bytes)
        if scheme in ("", "file"):
            return _allowed_file(Path(unquote(urlparse(url).path) if scheme == "file" else url), policy, label,
                                 max_bytes)
        raise ImageError(f"{label}: unsupported URL scheme {scheme!r} (use data:, file: or http(s):)")
    except ImageError as exc:
        raise exc if isinstance(exc, error) else error(str(exc)) from None


def _data_url_bytes(url: str, label: str, kind: str, max_bytes: int) -> bytes:
    match = _DATA_URL.match(url)
    if match is None or not match["b64"]:
        raise ImageError(f"{label}: malformed data URL (expected data:{kind}/...;base64,...)")
    if match["mime"] and not match["mime"].startswith(f"{kind}/"):
        raise ImageError(f"{label}: data URL has media type {match['mime']!r}, not {'an' if kind == 'image' else 'a'} "
                         f"{kind}")
    try:
        data = base64.b64decode(re.sub(r"\s+", "", match["data"]), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{label}: data URL is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageError(f"{label}: {len(data)} bytes is over the {max_bytes}-byte limit")
    return data


def _allowed_file(path: Path, policy: MediaPolicy, label: str, max_bytes: int) -> Path:
    if not policy.allowed_dirs:
        raise ImageError(f"{label}: local files are disabled (start the server with --allowed-media-dir)")
    if "\x00" in str(path):
        raise ImageError(f"{label}: the file path contains a NUL byte")
    try:
        resolved = path.expanduser().resolve()
        if not any(resolved.is_relative_to(d.resolve()) for d in policy.allowed_dirs):
            raise ImageError(f"{label}: {path} is outside the allowed media directories")
        if not resolved.is_file():
            raise ImageError(f"{label}: {path}: no such file")
        size = resolved.stat().st_size
        if size > max_bytes:
            raise ImageError(f"{label}: {size} bytes is over the {max_bytes}-byte limit")
        return resolved
    except ImageError:
        raise
    except (OSError, ValueError) as exc:  # a name too long, a permission, a race with a deletion
        raise ImageError(f"{label}: cannot read {path}: {type(exc).__name__}") from None


def _fetch_remote(url: str, policy: MediaPolicy, label: str, max_bytes: int) -> bytes:
    if not policy.allow_remote:
        raise ImageError(f"{label}: remote image URLs are disabled (start the server with --allow-remote-images)")
    from vlmserve.preprocess.remote import fetch_remote

    return fetch_remote(url, policy.allowed_domains, max_bytes, policy.remote_timeout_s, label)
