"""[loop] One API request's timing, recorded once: its log line and its /metrics (requests by status, e2e
latency, time to first token, the gaps between tokens, prompt and completion tokens).

Every endpoint records through it: chat completions, Responses and Messages through chat's ``Call``,
completions with one of its own; their outputs are observed by the flight they read (``flight.Flight``).
Before, completions logged by itself and never reached the metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vlmserve.api.errors import APIError
from vlmserve.api.metrics import ServerMetrics
from vlmserve.frontend.output import RequestOutput

log = logging.getLogger("vlmserve.requests")


@dataclass(slots=True)
class Timing:
    metrics: ServerMetrics
    model: str
    request_id: str
    start: float = field(default_factory=time.perf_counter)
    ttft: float | None = None
    last_token: float = 0.0
    recorded: bool = False

    def observe(self, out: RequestOutput, gaps: bool = True) -> None:
        """An output's tokens arrived: the first ones set the time to first token; later ones' gap to the
        ones before goes to the inter-token histogram (``gaps``: one stream of tokens, not several choices')."""
        if not out.token_ids:
            return
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
        elif gaps:
            self.metrics.tokens_arrived(self.model, now - self.last_token, len(out.token_ids))
        self.last_token = now

    def record(self, status: str, usage: dict[str, Any], detail: str = "", what: str = "") -> None:
        """The request ended with ``status`` (a finish reason, ``disconnected`` or ``error_<status>``): once."""
        if self.recorded:
            return
        self.recorded = True
        latency = time.perf_counter() - self.start
        self.metrics.finished(self.model, status, self.ttft, latency, usage)
        ttft = f"{self.ttft:.3f}s" if self.ttft is not None else "-"
        log.info("%s model=%s %sprompt=%s completion=%s ttft=%s total=%.3fs finish=%s%s", self.request_id, self.model,
                 what, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), ttft, latency, status, detail)

    def failed(self, error: APIError, usage: dict[str, Any] | None = None) -> APIError:
        """Record ``error`` as the request's end (``error_<status>``); the request's own line says it, so the
        error handler need not log it again."""
        self.record(f"error_{error.status}", usage or {}, f" code={error.code or '-'}: {error.message[:200]}")
        error.logged = True
        return error
