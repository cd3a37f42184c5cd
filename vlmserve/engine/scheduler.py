"""[worker] The scheduler decides: who is admitted, how many tokens each request runs this step,
and what the step's results mean for each request's state.

Per-step admission: every step admits waiting requests into free batch slots, so a new
request starts within one step and nothing waits for the batch to drain. Every running
request that finished its prompt decodes one token; the prompt tokens of the others share a
per-step budget (vLLM's ``num_scheduled_tokens``), so a step's prefill is really bounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from vlmserve.engine.memory import KVBudget
from vlmserve.engine.request import Request, RequestStatus


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8
    prefill_chunk: int = 512  # prompt tokens per step, over all prefilling requests


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: rows to decode (one token each), then prompt tokens per prefilling request."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_scheduled_tokens[r.request_id] for r in self.prefill)


@dataclass(slots=True, frozen=True)
class RequestUpdate:
    """What one step did to one request: the token it kept (if any) and how it ended (if it did)."""

    request: Request
    token_id: int | None = None
    finish: RequestStatus | None = None
    error: str | None = None


def kv_need(req: Request) -> int:
    """The positions a request may fill: its prompt and every token it may generate."""
    return min(req.num_prompt_tokens + req.params.max_tokens, req.max_context)


class Scheduler:
    def __init__(self, config: SchedulerConfig, budget: KVBudget | None = None) -> None:
        self.config = config
        self.budget = budget or KVBudget(None)
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

    @property
    def kv_reserved_bytes(self) -> int:
        return self.budget.batch_bytes([kv_need(r) for r in self.running])

    def admit(self) -> list[Request]:
        """Move waiting requests into free batch slots while the KV budget holds them; the caller
        starts them before ``schedule``."""
        admitted = []
        while self.waiting and len(self.running) < self.config.max_batch_size:
            if not self.budget.fits([kv_need(r) for r in (*self.running, self.waiting[0])]):
                break  # first come, first served: the head waits for memory, nobody overtakes it
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted

    def schedule(self) -> SchedulerOutput:
        """Plan the step over the running requests: one token per decode row, prompt tokens within budget."""
        out = SchedulerOutput(decode=[r for r in self.running if r.prefill_done])
        out.num_scheduled_tokens = {r.request_id: 1 for r in out.decode}
        budget = self.config.prefill_chunk
        for req in self.running:
            if req.prefill_done:
                continue
            n = self._prompt_tokens(req, budget, first=not out.prefill)
            if n == 0:
                break  # first come, first served: nobody overtakes a prompt that did not fit
            out.prefill.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
        return out

    @staticmethod
    def _prompt_tokens(req: Request, budget: int, first: bool) -> int:
        """Prompt tokens ``req`` runs this step. A prompt that cannot be split goes in whole: in a
        step of its own when it is bigger than the budget, else it would never run."""
        left = req.num_prompt_tokens - req.num_computed_tokens
        if req.chunkable:
            return min(left, max(budget, 0))
        return left if left <= budget or first else 0

    def update_from_output(self, plan: SchedulerOutput, sampled: Mapping[str, int],
                           failed: Mapping[str, str]) -> list[RequestUpdate]:
        """Apply one step: prompt progress, each sampled token, failures. Finished requests leave."""
        updates = []
        for req in (*plan.decode, *plan.prefill):
            if req.request_id in failed:
                self.finish(req, RequestStatus.FINISHED_ERROR)
                updates.append(RequestUpdate(req, finish=req.status, error=failed[req.request_id]))
                continue
            if not req.prefill_done:
                req.num_computed_tokens += plan.num_scheduled_tokens[req.request_id]
            token = sampled.get(req.request_id)
            if token is not None:
                updates.append(self._take(req, token))
        return updates

    def _take(self, req: Request, token: int) -> RequestUpdate:
        status = req.append_token(token)
        if status is not None:
            self.finish(req, status)
        kept = None if status is RequestStatus.FINISHED_STOPPED else token  # a stop token is not output
        return RequestUpdate(req, kept, status)

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
