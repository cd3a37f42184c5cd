"""[pool] Decoding untrusted videos into sampled frames: how many, which, and within what limits.

Frames are chosen by mlx-vlm's own rule (``mlx_vlm.utils.load_video``), so a clip gives the frames
mlx-vlm's video path would give it: ``fps`` frames per second of the clip, no fewer than
``min_frames`` and no more than ``max_frames``, in a multiple of ``frame_factor`` (Qwen's vision
tower takes frames two at a time), evenly spread from the first frame to the last. The caller's
values win, then the processor's declared ones (Gemma 4 keeps 32 frames), then mlx-vlm's defaults.

OpenCV reads the file (it comes with mlx-vlm). Frames are read in order, keeping the chosen ones;
a clip whose stream does not say how many frames it has is counted first. Every frame's pixels
count against the server's decode budget while the clip decodes.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from vlmserve.preprocess.decode_budget import DecodeBudget
from vlmserve.preprocess.images import ImageError

# Frames one clip may hold, counted before sampling: ten minutes at 60 fps. Counting reads them all.
MAX_SOURCE_FRAMES = 36_000


class VideoError(ImageError):
    """A video that cannot or must not be decoded; the message says which and why."""


@dataclass(slots=True, frozen=True)
class VideoSampling:
    """How many frames to take from a clip; an unset field is filled by ``merge``."""

    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    frame_factor: int | None = None

    def merge(self, fallback: VideoSampling) -> VideoSampling:
        """A copy with every unset field taken from ``fallback``."""
        return VideoSampling(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None
                                else getattr(fallback, f.name) for f in fields(self)})


# mlx-vlm's DEFAULT_VIDEO_SAMPLING: the end of every chain.
LIBRARY_SAMPLING = VideoSampling(fps=2.0, min_frames=4, max_frames=768, frame_factor=2)


@dataclass(slots=True, frozen=True)
class Video:
    """A decoded clip: the sampled frames ``(T, C, H, W)`` uint8 RGB, and where they came from."""

    frames: np.ndarray
    source_fps: float
    source_frames: int
    indices: tuple[int, ...]

    @property
    def sampled_fps(self) -> float:
        """Frames per second actually taken, as mlx-vlm reports it to the processors (``fps``)."""
        return len(self.indices) / max(self.source_frames, 1e-6) * self.source_fps

    def metadata(self) -> dict[str, Any]:
        """The clip as ``transformers``' ``VideoMetadata`` names it, for processors that time frames."""
        return {"total_num_frames": self.source_frames, "fps": self.source_fps, "frames_indices": list(self.indices),
                "height": int(self.frames.shape[2]), "width": int(self.frames.shape[3]),
                "duration": self.source_frames / self.source_fps}


def processor_sampling(processor: Any) -> VideoSampling:
    """The sampling a processor declares, as mlx-vlm reads it: a ``video_sampling_defaults()`` hook on
    its video processor or itself, else ``fps``/``min_frames``/``max_frames`` on the video processor."""
    component = getattr(processor, "video_processor", None)
    if component is None:
        return VideoSampling()
    for owner in (component, processor):
        hook = getattr(owner, "video_sampling_defaults", None)
        if callable(hook):
            declared = hook()
            given = declared if isinstance(declared, dict) else {f.name: getattr(declared, f.name, None)
                                                                 for f in fields(VideoSampling)}
            return VideoSampling(**{k: v for k, v in given.items() if k in {f.name for f in fields(VideoSampling)}})
    return VideoSampling(**{name: getattr(component, name, None) for name in ("fps", "min_frames", "max_frames")})


def frame_indices(total: int, source_fps: float, sampling: VideoSampling, label: str) -> list[int]:
    """The frames to keep of a ``total``-frame clip: mlx-vlm's rule (module docstring)."""
    s = sampling.merge(LIBRARY_SAMPLING)
    assert s.fps is not None and s.min_frames is not None and s.max_frames is not None and s.frame_factor is not None
    factor = s.frame_factor
    low = math.ceil(s.min_frames / factor) * factor
    high = math.floor(min(s.max_frames, total) / factor) * factor
    n = min(max(total / source_fps * s.fps, low), high, total)
    n = math.floor(n / factor) * factor
    if not factor <= n <= total:
        raise VideoError(f"{label}: {total} frame(s), and a video needs at least {max(factor, 1)} (with "
                         f"max_frames {s.max_frames})")
    return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]


def decode_video(source: bytes | Path, sampling: VideoSampling, max_pixels: int, label: str = "video",
                 budget: DecodeBudget | None = None) -> Video:
    """The clip's sampled frames; every refusal is a ``VideoError`` naming the clip. ``max_pixels``
    bounds one frame; the frames kept count against ``budget`` while they are read."""
    with _as_file(source) as path:
        return _read(path, sampling, max_pixels, label, budget)


@contextmanager
def _as_file(source: bytes | Path) -> Iterator[str]:
    """OpenCV reads files: bytes are written to a private temporary one, removed after."""
    if isinstance(source, Path):
        yield str(source)
        return
    if not source:
        raise VideoError("empty")
    fd, name = tempfile.mkstemp(prefix="vlmserve-video-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        yield name
    finally:
        os.unlink(name)


def _read(path: str, sampling: VideoSampling, max_pixels: int, label: str, budget: DecodeBudget | None) -> Video:
    import cv2

    capture = cv2.VideoCapture(path)
    try:
        if not capture.isOpened():
            raise VideoError(f"{label}: not a video (unrecognized or corrupt)")
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width < 1 or height < 1:
            raise VideoError(f"{label}: not a video (no frame size)")
        if width * height > max_pixels:
            raise VideoError(f"{label}: {width}x{height} frames are over the {max_pixels}-pixel limit")
        fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
        if not math.isfinite(fps) or fps <= 0:
            raise VideoError(f"{label}: the stream gives no frame rate")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        if total <= 0:  # some containers do not say: count by reading
            capture.release()
            total = _count_frames(path)
            capture = cv2.VideoCapture(path)
        if total > MAX_SOURCE_FRAMES:
            raise VideoError(f"{label}: {total} frames is over the {MAX_SOURCE_FRAMES}-frame limit")
        wanted = frame_indices(total, fps, sampling, label)
        with budget.hold(width * height * len(wanted)) if budget else _nothing():
            frames = _frames_at(capture, wanted, label)
    finally:
        capture.release()
    if len({f.shape for f in frames}) > 1:
        raise VideoError(f"{label}: its frames change size mid-stream")
    return Video(np.ascontiguousarray(np.stack(frames).transpose(0, 3, 1, 2)), fps, total, tuple(wanted))


def _frames_at(capture: Any, wanted: list[int], label: str) -> list[np.ndarray]:
    """The frames at ``wanted`` (sorted, repeats allowed), read in order, as RGB ``(H, W, 3)``."""
    import cv2

    frames: list[np.ndarray] = []
    position, last = 0, wanted[-1]
    chosen = iter(wanted)
    target = next(chosen)
    while position <= last:
        if not capture.grab():
            raise VideoError(f"{label}: truncated or corrupt video (frame {position} of {last + 1} unreadable)")
        while target == position:
            ok, frame = capture.retrieve()
            if not ok or frame is None:
                raise VideoError(f"{label}: truncated or corrupt video (frame {position} would not decode)")
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            target = next(chosen, -1)
        position += 1
    return frames


def _count_frames(path: str) -> int:
    import cv2

    capture = cv2.VideoCapture(path)
    try:
        count = 0
        while count <= MAX_SOURCE_FRAMES and capture.grab():
            count += 1
        return count
    finally:
        capture.release()


@contextmanager
def _nothing() -> Iterator[None]:
    yield
