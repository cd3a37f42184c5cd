"""[any] Small video clips for tests and benchmarks: a disc crossing a white frame, written as mp4."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_clip(path: Path, frames: int = 16, fps: float = 8.0, size: tuple[int, int] = (96, 64),
               color: tuple[int, int, int] = (0, 0, 255)) -> Path:
    """An mp4 (``mp4v``) of ``frames`` frames at ``fps``: a disc of ``color`` (OpenCV's BGR) crossing a
    white ``size`` (width, height) frame from left to right."""
    import cv2

    width, height = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    try:
        for i in range(frames):
            frame = np.full((height, width, 3), 255, np.uint8)
            x = width // 12 + i * (width - width // 6) // max(frames - 1, 1)
            cv2.circle(frame, (x, height // 2), height // 6, color, -1)
            writer.write(frame)
    finally:
        writer.release()
    return path
