"""[loop] ``/health`` and ``/ready``: their answers, and which raw requests intake.py may answer itself.

The app's routes give the same answers, to the probes that take the usual way (intake.py says which).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmserve.api.state import ServerState
from vlmserve.frontend.async_engine import STARTING_RETRY_S


@dataclass(slots=True, frozen=True)
class ProbeAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def health(state: ServerState) -> ProbeAnswer:
    """Liveness: the process answers (draining included)."""
    return ProbeAnswer(200, {"status": "ok"})


def readiness(state: ServerState) -> ProbeAnswer:
    """200 once every pinned model serves; 503 while one loads (with Retry-After), after one failed, or draining.
    The models of --model-dir say their status (``available`` ones load on their first request)."""
    models = {m.name: _engine_status(m.engine) if m.pinned else m.status for m in state.models}
    loading = not state.ready and not state.draining and any(m.engine.starting for m in state.pinned)
    headers = {"Retry-After": str(STARTING_RETRY_S)} if loading else {}
    return ProbeAnswer(200 if state.ready else 503, {"ready": state.ready, "models": models}, headers)


def _engine_status(engine: Any) -> str:
    if engine.ready:
        return "ready"
    return f"failed: {engine.dead_reason}" if engine.dead_reason else "loading"


PROBES: dict[bytes, Callable[[ServerState], ProbeAnswer]] = {b"/health": health, b"/ready": readiness}
_UNUSUAL = (b"\norigin:", b"\ncontent-length:", b"\ntransfer-encoding:", b"\nupgrade:", b"\nexpect:")


def request_id(given: bytes) -> bytes:
    """The client's ``x-request-id`` (up to 128 printable characters), else a new one, as vLLM and most
    proxies do."""
    ok = 0 < len(given) <= 128 and all(33 <= c < 127 for c in given)
    return given if ok else uuid.uuid4().hex.encode()


def probe_path(data: bytes) -> bytes | None:
    """The probe's path when ``data`` is exactly one plain ``GET /health`` or ``GET /ready`` (its headers
    complete, none of ``_UNUSUAL``); else None."""
    if not data.startswith(b"GET /") or not data.endswith(b"\r\n\r\n") or data.count(b"\r\n\r\n") != 1:
        return None
    path = data[4:data.find(b" ", 4)].partition(b"?")[0]
    head = data.lower()
    return path if path in PROBES and not any(name in head for name in _UNUSUAL) else None


def encode(answer: ProbeAnswer) -> bytes:
    """The answer's body as Starlette's JSONResponse encodes it."""
    return json.dumps(answer.body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
