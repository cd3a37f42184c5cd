"""[worker] The scheduler decides: who is admitted, who prefills this step, who decodes.

Per-step admission: every step admits waiting requests into free batch slots, so a new
request starts within one step and nothing waits for the batch to drain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vlmserve.engine.request import Request, RequestStatus


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8
    prefill_chunk: int = 512  # prompt tokens prefilled per step, over all prefilling requests


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: rows to decode, then requests to prefill a chunk of."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: prefilling or decoding, in admission order

    def add(self, req: Request) -> None:
        assert req.status is RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None

    def schedule(self) -> SchedulerOutput:
        self._admit()
        out = SchedulerOutput(decode=[r for r in self.running if r.prefill_done])
        budget = self.config.prefill_chunk
        for req in self.running:
            if budget <= 0:
                break
            if not req.prefill_done:
                out.prefill.append(req)
                budget -= req.num_prompt_tokens - req.num_computed_tokens
        return out

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch_size:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of the scheduler for good (done, aborted or failed)."""
        assert status.finished
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        req.status = status

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
