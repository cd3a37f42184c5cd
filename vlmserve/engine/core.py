"""[worker] EngineCore: the worker's step. Drain inbox and aborts -> admit -> run one step -> publish."""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.loader import LoadedModel, default_kv_budget
from vlmserve.engine.memory import KVBudget, measure_footprint
from vlmserve.engine.params import PromptInputs
from vlmserve.engine.prefix_cache import PrefixCache
from vlmserve.engine.request import (
    AbortRequest,
    AddRequest,
    EngineMetrics,
    Publisher,
    Request,
    RequestStatus,
    StepOutput,
    StepOutputs,
)
from vlmserve.engine.runner import ModelRunner
from vlmserve.engine.sampler import Sample
from vlmserve.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from vlmserve.engine.vision_cache import VisionCache
from vlmserve.engine.worker import MLXWorkerThread

log = logging.getLogger(__name__)
_EARLY_ABORTS = 4096  # aborts that overtook their request; bounded so a leak cannot grow


@dataclass(slots=True)
class _Pending:
    """What one step has for one request, published once at the end of the step."""

    request_id: str
    req: Request | None  # None for an abort that overtook its request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[object] = field(default_factory=list)
    finish: RequestStatus | None = None
    error: str | None = None


class EngineCore:
    """Owns the scheduler, the runner and the prefix cache; every method runs on the worker."""

    def __init__(self, loaded: LoadedModel, worker: MLXWorkerThread, publish: Publisher,
                 config: EngineConfig = EngineConfig()) -> None:
        self.loaded = loaded
        self.worker = worker
        self.publish = publish  # called on the worker once per step; must only hand the batch over
        self.config = config
        self.kv = KVBudget(config.kv_cache_bytes)
        self.scheduler = Scheduler(SchedulerConfig(config.max_batch_size, config.prefill_chunk), self.kv)
        self.runner = ModelRunner(loaded, self._new_vision_cache())
        self.prefix_cache = self._new_prefix_cache()
        self.metrics = EngineMetrics()
        self._inbox: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[str, _Pending] = {}
        self._requests: dict[str, Request] = {}

    def _new_prefix_cache(self) -> PrefixCache | None:
        config = self.config
        return PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes) if config.prefix_cache else None

    def measure_kv(self, prompt: PromptInputs) -> KVBudget:
        """Measure this model's KV bytes per position on a text prompt; size the budget if unset."""
        self.worker.assert_on_worker()
        self.kv.footprint = measure_footprint(self.runner, prompt)
        if self.kv.limit_bytes is None:
            self.kv.limit_bytes = default_kv_budget()
        self._record(self.metrics.last_step_s, False)
        return self.kv

    def _new_vision_cache(self) -> VisionCache | None:
        return VisionCache(self.config.vision_cache_bytes) if self.config.vision_cache_bytes > 0 else None

    def reset_caches(self) -> None:
        """Forget every cached prefix and image, and their counters (after the warm-up, whose
        prompts nobody sends)."""
        self.worker.assert_on_worker()
        self.prefix_cache = self._new_prefix_cache()
        self.metrics.vision_seconds = 0.0
        if self.runner.vision_cache is not None:
            self.runner.vision_cache = self._new_vision_cache()

    # -- any thread --------------------------------------------------------------

    def post(self, message: AddRequest | AbortRequest) -> None:
        """Non-blocking from any thread; the worker applies it at its next iteration."""
        self._inbox.put(message)
        self.worker.wake()

    # -- the worker's Stepper protocol ----------------------------------------------

    def has_work(self) -> bool:
        return not self._inbox.empty() or self.scheduler.has_unfinished()

    def step(self) -> None:
        self.worker.assert_on_worker()
        start = time.perf_counter()
        self._drain_inbox()
        self._start(self.scheduler.admit())
        plan = self.scheduler.schedule()
        samples, failed = self._execute(plan)
        tokens = {request_id: s.token_id for request_id, s in samples.items()}
        self._apply(self.scheduler.update_from_output(plan, tokens, failed), samples)
        # Counters first: whoever sees this step's outputs also sees the state they left behind.
        self._record(time.perf_counter() - start, not plan.empty)
        if self._pending or not plan.empty:
            self._publish()

    # -- inbox ----------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                self._add(message)
            else:
                self._abort(message.request_id)

    def _add(self, message: AddRequest) -> None:
        if message.request_id in self._early_aborts:
            del self._early_aborts[message.request_id]
            self._pending[message.request_id] = _Pending(message.request_id, None, finish=RequestStatus.FINISHED_ABORTED)
            return
        req = Request(
            message.request_id, message.prompt, message.params,
            eos_token_ids=self.loaded.eos_token_ids, max_context=self.loaded.max_context,
        )
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def _abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:  # not arrived yet (or already gone): drop it when it does
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > _EARLY_ABORTS:
                self._early_aborts.popitem(last=False)
            return
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    # -- one step -------------------------------------------------------------------

    def _start(self, admitted: list[Request]) -> None:
        """Admitted requests get their KV cache (a reused text prefix, or a fresh one) and their
        embeddings: image prompts admitted together share the vision forward where the family allows."""
        begun = {req.request_id: req for req in admitted if self._begin(req)}
        for group in self.runner.embedding_groups(list(begun)):
            reqs = [begun[r] for r in group]
            start = time.perf_counter()
            error = self._guarded(reqs, self.runner.embed, group)
            if reqs[0].prompt.has_images:
                self.metrics.vision_seconds += time.perf_counter() - start
            if len(group) > 1 and error is None:
                self.metrics.vision_batches += 1
            for req in reqs:
                if error is not None:
                    self._finish(req, RequestStatus.FINISHED_ERROR, error)
                else:
                    req.num_prompt_tokens = self.runner.prompt_length(req.request_id)
                    req.chunkable = self.runner.adapter.can_chunk(req.prompt)

    def _begin(self, req: Request) -> bool:
        cache, cached = None, 0
        if self._prefix_cacheable(req):
            cache, cached = self.prefix_cache.lookup(req.prompt.input_ids)
        error = self._guarded([req], self.runner.begin, req.request_id, req.prompt, req.params, cache, cached)
        if error is not None:
            self._finish(req, RequestStatus.FINISHED_ERROR, error)
            return False
        req.num_computed_tokens = req.num_cached_tokens = cached
        return True

    def _prefix_cacheable(self, req: Request) -> bool:
        # Never reuse KV for a prompt with pixel_values: same tokens, different image.
        return self.prefix_cache is not None and not req.prompt.has_images and self.runner.adapter.reuses_prefix

    def _execute(self, plan: SchedulerOutput) -> tuple[dict[str, Sample], dict[str, str]]:
        """Run the plan; a part that raises fails just the requests it touched."""
        samples: dict[str, Sample] = {}
        failed: dict[str, str] = {}
        if plan.decode:
            error = self._guarded(plan.decode, lambda: samples.update(self.runner.decode()))
            if error is not None:
                failed.update(dict.fromkeys((r.request_id for r in plan.decode), error))
            failed.update(self.runner.guide_errors)
            self.runner.guide_errors.clear()
        together = [r for r in plan.prefill
                    if self.runner.prefills_whole(r.request_id, plan.num_scheduled_tokens[r.request_id])]
        if len(together) > 1:  # whole prompts starting in this step: one left-padded forward
            error = self._guarded(together, self._prefill_together, together, samples)
            if error is not None:
                failed.update(dict.fromkeys((r.request_id for r in together), error))
        for req in plan.prefill:
            if len(together) > 1 and req in together:
                continue
            error = self._guarded([req], self._prefill, req, plan.num_scheduled_tokens[req.request_id], samples)
            if error is not None:
                failed[req.request_id] = error
        return samples, failed

    def _prefill(self, req: Request, num_tokens: int, samples: dict[str, Sample]) -> None:
        first = self.runner.prefill(req.request_id, num_tokens)
        if first is not None:
            samples[req.request_id] = first
            self._prefilled(req)

    def _prefill_together(self, reqs: list[Request], samples: dict[str, Sample]) -> None:
        samples.update(self.runner.prefill_together([r.request_id for r in reqs]))
        self.metrics.prefill_batches += 1
        for req in reqs:
            self._prefilled(req)

    def _prefilled(self, req: Request) -> None:
        self.metrics.prompt_tokens += req.num_prompt_tokens - req.num_cached_tokens
        if self._prefix_cacheable(req):
            self.prefix_cache.store(req.prompt.input_ids, self.runner.prompt_cache(req.request_id))

    def _apply(self, updates: list[RequestUpdate], samples: dict[str, Sample]) -> None:
        """Queue each update's output; finished requests leave the runner, new decoders join its batch."""
        joining = []
        for update in updates:
            req = update.request
            pending = self._pending_for(req)
            if update.token_id is not None:
                pending.tokens.append(update.token_id)
                pending.logprobs.append(samples[req.request_id].logprob)
                self.metrics.generated_tokens += 1
            if update.finish is not None:
                self._release(req)
                pending.finish, pending.error = update.finish, update.error
            elif req.request_id in self.runner.prefilling:
                joining.append(req)
        if joining and (error := self._guarded(joining, self.runner.join, [r.request_id for r in joining])):
            for req in joining:
                self._finish(req, RequestStatus.FINISHED_ERROR, error)

    def _guarded(self, reqs: list[Request], fn: Callable[..., object], *args: object) -> str | None:
        """Run one part of a step; if it raises, log it and return the error the requests end with."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - an engine fault ends its requests, not the engine
            log.exception("engine step failed for %s", [r.request_id for r in reqs])
            self.metrics.step_errors += 1
            return f"{type(exc).__name__}: {exc}"
        return None

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """End a request outside a step's results (abort, admission fault, shutdown)."""
        self.scheduler.finish(req, status)
        self._release(req)
        pending = self._pending_for(req)
        pending.finish, pending.error = status, error

    def _release(self, req: Request) -> None:
        self.runner.remove([req.request_id])
        self._requests.pop(req.request_id, None)

    def _pending_for(self, req: Request) -> _Pending:
        pending = self._pending.get(req.request_id)
        if pending is None:
            pending = self._pending[req.request_id] = _Pending(req.request_id, req)
        return pending

    def _publish(self) -> None:
        """One message per step for the loop: every request's output and the counters after the step."""
        outputs = tuple(
            StepOutput(p.request_id, tuple(p.tokens), tuple(p.logprobs), p.finish.value if p.finish else None,
                       p.error, p.req.num_prompt_tokens if p.req else 0, p.req.num_cached_tokens if p.req else 0,
                       self.metrics.steps)
            for p in self._pending.values()
        )
        self._pending.clear()
        try:
            self.publish(StepOutputs(outputs, dataclasses.replace(self.metrics)))
        except Exception:  # noqa: BLE001 - a closed event loop must not kill the worker
            log.exception("could not deliver the outputs of step %d", self.metrics.steps)

    def _record(self, seconds: float, worked: bool) -> None:
        m = self.metrics
        if worked:
            m.steps += 1
            m.last_step_s = seconds
        m.running, m.waiting = self.scheduler.num_running, self.scheduler.num_waiting
        m.batch_size = len(self.runner.batch)
        m.kv_reserved_bytes, m.kv_budget_bytes = self.scheduler.kv_reserved_bytes, self.kv.limit_bytes
        m.prefix = self.prefix_cache.stats() if self.prefix_cache is not None else None
        m.vision = self.runner.vision_cache.stats() if self.runner.vision_cache is not None else None

    def snapshot(self) -> EngineMetrics:
        """Exact counters between steps (call on the worker); ``metrics`` may lag a step."""
        self._record(self.metrics.last_step_s, False)
        return dataclasses.replace(self.metrics)

    def fail_all(self, message: str) -> None:
        """Shutdown: every waiting and running request gets a final error item."""
        self._drain_inbox()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(req, RequestStatus.FINISHED_ERROR, message)
        self._record(self.metrics.last_step_s, False)
        if self._pending:
            self._publish()
