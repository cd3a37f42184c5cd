"""[pool] Audio clips from a request: OpenAI's ``input_audio`` (base64 wav or mp3) decoded to mono float32.

Decoded as mlx-vlm's own ``load_audio`` decodes a file (mlx-audio's miniaudio reader, its polyphase
resampler to the feature extractor's rate, channels averaged), so a clip gives the same waveform here
as there. Bounded before and while decoding: bytes, then seconds (the decoder stops just past the limit).
The two pieces of mlx-audio used here are numpy in and out (miniaudio, scipy): they never load MLX, so no
array is made off the worker (tests/test_audio.py checks that in a fresh process).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import wave
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlmserve.inputs import AUDIO_KEYS, HostArray, ImageItem
from vlmserve.preprocess.images import ImageError

FORMATS = ("wav", "mp3")  # OpenAI's input_audio formats
DEFAULT_MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's limit on a transcription upload
DEFAULT_MAX_AUDIO_SECONDS = 30.0  # Gemma 4: 750 soft tokens at 40 ms, what its processor keeps of a clip
SAMPLING_RATE = 16_000  # Gemma 4's feature extractor's; the processor's own rate is passed where known


class AudioError(ImageError):
    """A clip that cannot or must not be decoded; the message says which and why (a 400)."""


@dataclass(slots=True, frozen=True)
class AudioLimits:
    max_bytes: int = DEFAULT_MAX_AUDIO_BYTES
    max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS


def audio_bytes(data: str, label: str, limits: AudioLimits) -> bytes:
    """The bytes of an ``input_audio.data`` (base64, or a data URL's base64), within the byte limit."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    if len(data) * 3 // 4 > limits.max_bytes + 3:  # refused before decoding the base64
        raise AudioError(f"{label}: over the {limits.max_bytes}-byte limit")
    try:
        raw = base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise AudioError(f"{label}: data is not valid base64") from None
    if len(raw) > limits.max_bytes:
        raise AudioError(f"{label}: {len(raw)} bytes is over the {limits.max_bytes}-byte limit")
    return raw


def decode_audio(raw: bytes, fmt: str, label: str, limits: AudioLimits, rate: int = SAMPLING_RATE) -> np.ndarray:
    """Mono float32 samples at ``rate``; an ``AudioError`` for an unknown format, undecodable bytes, or a
    clip longer than the limit."""
    if fmt not in FORMATS:
        raise AudioError(f"{label}: format {fmt!r} is not supported ({' or '.join(FORMATS)})")
    samples, source_rate = _read(raw, label, limits.max_seconds + 1.0)
    seconds = len(samples) / source_rate
    if seconds > limits.max_seconds:
        raise AudioError(f"{label}: longer than the {limits.max_seconds:g}-second limit per clip")
    if samples.size == 0:
        raise AudioError(f"{label}: no samples")
    return _resampled(samples, source_rate, rate)


def _read(raw: bytes, label: str, most_seconds: float) -> tuple[np.ndarray, int]:
    from mlx_audio.audio_io import read

    try:
        samples, source_rate = read(io.BytesIO(raw), dtype="float32", duration=most_seconds)
    except Exception as exc:  # noqa: BLE001 - miniaudio's errors are the input's fault
        raise AudioError(f"{label}: cannot decode the audio ({type(exc).__name__})") from None
    samples = np.asarray(samples, dtype=np.float32)
    return (samples.mean(axis=1) if samples.ndim > 1 else samples), int(source_rate)


def _resampled(samples: np.ndarray, source_rate: int, rate: int) -> np.ndarray:
    if source_rate == rate:
        return samples
    from mlx_audio.resample import resample_audio_array

    return np.asarray(resample_audio_array(samples, source_rate, rate), dtype=np.float32)


def pcm_wav(samples: np.ndarray, rate: int) -> bytes:
    """Mono samples as 16-bit PCM WAV. mlx-audio's reader decodes through 16-bit PCM, so samples it decoded come
    back from this the very same (a transcription's windows go through the chat path as clips of their own)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes())
    return out.getvalue()


def windows(samples: np.ndarray, rate: int, seconds: float) -> list[np.ndarray]:
    """Consecutive fixed windows of ``seconds`` (the last one shorter), no overlap: a long file's clips."""
    size = max(1, int(seconds * rate))
    return [samples[start:start + size] for start in range(0, len(samples), size)]


def clip_items(clips: Sequence[np.ndarray], arrays: dict[str, HostArray]) -> tuple[ImageItem, ...]:
    """One item per clip: its rows of the processor's mel features cut to its own valid frames (the processor
    pads every clip to the longest; the tower's valid output is the same either way, bitwise), keyed by the
    decoded samples' hash. ``()`` where the features are not one padded row per clip."""
    features, mask = (arrays.get(k) for k in AUDIO_KEYS)
    if not isinstance(features, np.ndarray) or not isinstance(mask, np.ndarray) or len(features) != len(clips):
        return ()
    items = []
    for i, samples in enumerate(clips):
        valid = int(mask[i].sum())
        if not mask[i, :valid].all():  # valid frames first, then padding: else the cut would not be the clip's
            return ()
        own = {AUDIO_KEYS[0]: features[i:i + 1, :valid], AUDIO_KEYS[1]: mask[i:i + 1, :valid]}
        items.append(ImageItem(clip_key(samples), own))
    return tuple(items)


def clip_key(samples: np.ndarray) -> str:
    """The vision cache's key of a decoded clip: its samples' hash (the feature extractor is the model's, fixed),
    apart from every image key."""
    h = hashlib.blake2b(digest_size=20)
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    h.update(f"audio:{samples.shape};".encode())
    h.update(samples.data)
    return "audio:" + h.hexdigest()
