"""[worker] EngineCore: the worker's step. Drain inbox and aborts -> schedule -> execute -> update -> publish."""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlmserve.engine.caches import CachePolicy, EngineCaches, cache_policy
from vlmserve.engine.costs import FLOOR_TOKENS, StepCosts, measure_costs
from vlmserve.engine.dflash import DFlashDrafter
from vlmserve.engine.disk_store import DiskStore
from vlmserve.engine.disk_tier import IMAGES, TEXT, DiskTier, identity, model_folder
from vlmserve.engine.draft_model import DraftModel
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.loader import LoadedModel, default_kv_budget
from vlmserve.engine.memory import KVBudget, batch_memory, measure_footprint, mlx_memory
from vlmserve.engine.models import ModelAdapter
from vlmserve.engine.mtp import MtpDrafter
from vlmserve.engine.mtp_prefix import DraftPrefix
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import RunnerOutput, SchedulerOutput
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
from vlmserve.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from vlmserve.engine.vision_cache import VisionCache
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.inputs import PromptInputs

log = logging.getLogger(__name__)
_EARLY_ABORTS = 4096  # aborts that overtook their request; bounded so a leak cannot grow


@dataclass(slots=True)
class _Pending:
    """What one step has for one request, published once at the end of the step."""

    request_id: str
    req: Request | None  # None for an abort that overtook its request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[object] = field(default_factory=list)
    prompt_logprobs: tuple[object, ...] | None = None
    stop_logprob: object = None  # the logprob of the stop token that ended it (not output), when asked
    finish: RequestStatus | None = None
    error: str | None = None


class Runner(Protocol):
    """What the core needs of a runner: one call per step (ModelRunner; a fake in the core's tests)."""

    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...


def scheduler_config(adapter: ModelAdapter, config: EngineConfig) -> SchedulerConfig:
    """The scheduler's view of one model: the engine's budgets and the adapter's layer facts."""
    # Across ranks a prompt is not split by layers: each rank's slice runs whole, one hop each
    layers, starts = (1, None) if config.pipeline else (adapter.num_layers, adapter.layer_starts())
    verifies = adapter.verifies_drafts and not config.pipeline  # across ranks every rank would have to verify
    return SchedulerConfig(config.max_batch_size, config.prefill_chunk, config.stream_prefill_chunk,
                           config.encoder_budget, layers, starts,
                           adapter.num_vision_blocks, adapter.reuses_prefix, not adapter.trims_cache,
                           config.speculative if verifies else None, verifies, holds_rows=config.join_gate and not config.pipeline)


def disk_tier(loaded: LoadedModel, config: EngineConfig, policy: CachePolicy,
              prefill_s: Callable[[], float]) -> DiskTier | None:
    """The prefix stores' disk tier where ``--prefix-cache-dir`` asks for one (it locks the directory) and the
    policy keeps a prefix store."""
    if config.prefix_cache_dir is None or not (policy.prefix or policy.mm_prefix):
        return None
    quant = loaded.adapter.kv_quant
    kv = f"{quant.bits}-{quant.group_size}-{quant.start}" if quant is not None else "full"
    spec = config.speculative
    drafter = spec.model if spec is not None and _keeps_draft_state(loaded) else None
    store = DiskStore(model_folder(config.prefix_cache_dir, loaded.name), config.prefix_cache_disk_bytes,
                      identity(loaded.path, loaded.model_type, loaded.model, kv, drafter))
    return DiskTier(store, stored_cache(loaded), prefill_s)


def stored_cache(loaded: LoadedModel) -> Callable[[], list[Any]]:
    """A fresh cache of what the prefix stores keep for this model: its layers, and the MTP drafter's,
    DFlash drafter's or draft model's state after them where it has one (engine/mtp_prefix.py)."""
    make = loaded.adapter.make_cache
    return (lambda: [*make(), DraftPrefix()]) if _keeps_draft_state(loaded) else make


def _keeps_draft_state(loaded: LoadedModel) -> bool:
    return isinstance(loaded.drafter, (MtpDrafter, DFlashDrafter, DraftModel))


def new_request(loaded: LoadedModel, request_id: str, prompt: PromptInputs, params: SamplingParams,
                arrival_time: float | None = None) -> Request:
    """A request as the scheduler sees it, with what the family allows its prompt."""
    req = Request(request_id, prompt, params, eos_token_ids=loaded.eos_token_ids, max_context=loaded.max_context)
    if arrival_time is not None:
        req.arrival_time = arrival_time
    req.chunkable, req.batchable = loaded.adapter.can_chunk(prompt), loaded.adapter.can_batch(prompt)
    req.text_tail = None if req.chunkable else loaded.adapter.text_tail(prompt)
    req.batchable = req.batchable and params.prompt_logprobs is None  # its logits are taken alone
    return req


class EngineCore:
    """Owns the scheduler, the caches and the runner; every method runs on the worker."""

    def __init__(self, loaded: LoadedModel, worker: MLXWorkerThread, publish: Publisher,
                 config: EngineConfig = EngineConfig(), runner: Runner | None = None,
                 runner_for: Callable[[LoadedModel, EngineCaches], Runner] = ModelRunner) -> None:
        self.loaded = loaded
        self.worker = worker
        self.publish = publish  # called on the worker once per step; must only hand the batch over
        self.config = config
        self.kv = KVBudget(config.kv_cache_bytes)
        self.caches = EngineCaches(None, None)
        self.policy = cache_policy(config, loaded.adapter)  # which caches this engine keeps
        self.tier = disk_tier(loaded, config, self.policy, lambda: self.costs.prompt_token_s)  # kept across reset_caches
        self._new_caches()
        self.scheduler = Scheduler(scheduler_config(loaded.adapter, config), self.kv, self.caches)
        self.runner: Runner = runner if runner is not None else runner_for(loaded, self.caches)
        self.costs = StepCosts(config.stream_step_share, FLOOR_TOKENS, config.prefill_chunk, config.stream_step_share_max)
        self.metrics = EngineMetrics()
        self._inbox: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[str, _Pending] = {}
        self._requests: dict[str, Request] = {}

    def _new_caches(self) -> None:
        config, policy = self.config, self.policy
        tier = self.tier
        prefix = PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes, tier, TEXT) if policy.prefix else None
        self.caches.prefix = prefix
        self.caches.vision = VisionCache(config.vision_cache_bytes) if policy.vision else None
        self.caches.mm_prefix = PrefixCache(config.prefix_cache_entries, config.mm_prefix_cache_bytes, tier, IMAGES) \
            if policy.mm_prefix else None
        self.caches.media_ids = self.loaded.adapter.media_token_ids()
        self.caches.last_run_marks = self.loaded.adapter.last_run_marks(self.loaded.processor)
        self.caches.mm_limit = self.loaded.adapter.mm_prefix_limit
        self.caches.text_for_images = policy.text_for_images

    def calibrate(self, prompt: PromptInputs) -> tuple[KVBudget, StepCosts, EngineMetrics]:
        """After the warm-up, once: the KV budget from this model's bytes per position, what a prompt token
        and a decode step cost, and the counters from here on (not the warm-up's last step)."""
        return self.measure_kv(prompt), self.measure_costs(prompt), self.snapshot()

    def measure_kv(self, prompt: PromptInputs) -> KVBudget:
        """Measure this model's KV bytes per position on a text prompt; size the budget if unset."""
        self.worker.assert_on_worker()
        self.runner.execute(SchedulerOutput(finished=self.scheduler.take_finished()))
        self.kv.footprint = measure_footprint(self.runner, prompt)
        if self.kv.limit_bytes is None:
            self.kv.limit_bytes = default_kv_budget()
        self._record(self.metrics.last_step_s, False)
        return self.kv

    def measure_costs(self, prompt: PromptInputs) -> StepCosts:
        """Probe what a prompt token and a decode step cost here (engine/costs.py), once, at start-up."""
        self.worker.assert_on_worker()
        self.costs.prompt_token_s, self.costs.decode_step_s, self.costs.sync_step_s = measure_costs(self.runner, prompt)
        return self.costs

    def close_caches(self) -> None:
        """A clean shutdown: what the prefix stores hold goes to the disk tier, whose writes then finish."""
        self.worker.assert_on_worker()
        if self.tier is not None:
            for store in (self.caches.prefix, self.caches.mm_prefix):
                if store is not None:
                    store.spill_all()
            self.tier.close()

    def limit_batch(self, rows: int) -> None:
        """At most ``rows`` requests run at once from the next step on (an untested family whose start-up
        check found that decoding together changes its tokens)."""
        self.scheduler.config = dataclasses.replace(self.scheduler.config, max_batch_size=rows)

    def reset_caches(self) -> None:
        """Forget every cached prefix and image, and their counters (after the warm-up, whose
        prompts nobody sends)."""
        self.worker.assert_on_worker()
        self._new_caches()
        self.metrics.vision_seconds = 0.0

    # -- any thread --------------------------------------------------------------

    def post(self, message: AddRequest | AbortRequest) -> None:
        """Non-blocking from any thread; the worker applies it at its next iteration."""
        self._inbox.put(message)
        self.worker.wake()

    # -- the worker's Stepper protocol ----------------------------------------------

    def has_work(self) -> bool:
        # Finished requests count: the step that tells the runner frees their KV at once.
        return not self._inbox.empty() or self.scheduler.has_unfinished() or self.scheduler.has_finished()

    def step(self) -> None:
        self.worker.assert_on_worker()
        start = time.perf_counter()
        self._drain_inbox()
        if self.config.stream_prefill_chunk is None:
            self.scheduler.stream_tokens = self.costs.stream_tokens(self.scheduler.longest_wait(time.monotonic()))
            self.scheduler.pixel_tokens = self.costs.pixel_tokens()
        if self.scheduler.drafts is not None:
            if isinstance(self.loaded.drafter, DraftModel):  # it times its own prompt prefills
                self.costs.draft_prefill_token_s = self.loaded.drafter.prefill_token_s
            self.scheduler.drafts.measured(self.costs)
        plan = self.scheduler.schedule()
        output = self.runner.execute(plan)
        self._apply(plan, output, self.scheduler.update_from_output(plan, output))
        self.costs.observe_vision(plan.encode_pixels, output.vision_seconds)
        self.costs.observe_drafts(output.draft_seconds, output.draft_tokens)
        if (plan.decode or plan.prefill) and not output.verified:  # a verify's step is not a decode step's cost
            self.costs.observe(time.perf_counter() - start, self._prompt_work(plan), output.vision_seconds,
                               bool(plan.decode))
        # Counters first: whoever sees this step's outputs also sees the state they left behind.
        self._record(time.perf_counter() - start, not plan.empty)
        if self._pending or not plan.empty:
            self._publish()

    def _prompt_work(self, plan: SchedulerOutput) -> float:
        """The step's prompt tokens, each counted by the share of the layers it ran through."""
        layers = self.scheduler.config.num_layers
        return sum(c.num_tokens * ((c.last_layer or layers) - c.first_layer) / layers for c in plan.prefill)

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
        req = new_request(self.loaded, message.request_id, message.prompt, message.params, message.arrival_time)
        for fork_id, params in message.forks:
            fork = new_request(self.loaded, fork_id, message.prompt, params, message.arrival_time)
            fork.fork_of = req.request_id
            req.forks.append(fork)
            self._requests[fork_id] = fork
        self._requests[req.request_id] = req
        self.scheduler.add(req)
        if self.tier is not None and self.scheduler.config.reuses_prefix and req.params.prompt_logprobs is None:
            self.caches.prefetch(req.prompt)

    def _abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:  # not arrived yet (or already gone): drop it when it does
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > _EARLY_ABORTS:
                self._early_aborts.popitem(last=False)
            return
        self._finish(req, RequestStatus.FINISHED_ABORTED)

    # -- results --------------------------------------------------------------------

    def _apply(self, plan: SchedulerOutput, output: RunnerOutput, updates: list[RequestUpdate]) -> None:
        """Queue each update's output for this step's message, and count the step's work."""
        m = self.metrics
        m.step_errors += output.faults
        m.vision_seconds += output.vision_seconds
        m.vision_batches += output.vision_batches
        m.prefill_batches += output.prefill_batches
        m.prompt_tokens += sum(c.num_tokens for c in plan.prefill if c.final and c.request_id not in output.errors)
        self._count_drafts(output.verified.values())
        for update in updates:
            req = update.request
            pending = self._pending_for(req)
            sample = update.sample
            if sample is not None:  # the prompt's logprobs, whatever its first token does (a stop token too)
                pending.prompt_logprobs = sample.prompt_logprobs or pending.prompt_logprobs
            if update.token_id is not None:
                assert sample is not None
                pending.tokens.append(update.token_id)
                pending.logprobs.append(sample.logprob)
                m.generated_tokens += 1
            elif sample is not None and update.finish is RequestStatus.FINISHED_STOPPED:
                pending.stop_logprob = sample.logprob  # vLLM lists it; lm-eval drops it as "the generated one"
            if update.finish is not None:
                self._requests.pop(req.request_id, None)
                pending.finish, pending.error = update.finish, update.error

    def _count_drafts(self, verified: Iterable[tuple[int, int]]) -> None:
        """vLLM's spec_decode counters: drafts, their tokens, those accepted, accepted by position."""
        m = self.metrics
        for drafted, accepted in verified:
            m.spec_drafts += 1
            m.spec_draft_tokens += drafted
            m.spec_accepted_tokens += accepted
            per = list(m.spec_accepted_per_position) + [0] * max(0, drafted - len(m.spec_accepted_per_position))
            m.spec_accepted_per_position = tuple(n + (i < accepted) for i, n in enumerate(per))

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """End a request outside a step's results (abort, shutdown); the runner frees it next step.
        Its forks that were not forked yet end with it: their prompt is its own."""
        for fork in req.live_forks:
            self._finish(fork, status, error)
        self.scheduler.finish(req, status)
        self._requests.pop(req.request_id, None)
        pending = self._pending_for(req)
        pending.finish, pending.error = status, error

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
                       self.metrics.steps, p.prompt_logprobs, *(p.req.prediction_usage if p.req else (0, 0)),
                       p.stop_logprob, p.req.num_stored_tokens if p.req else 0)
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
        m.batch_size = sum(r.encoded and r.prefill_done for r in self.scheduler.running)
        m.kv_reserved_bytes, m.kv_budget_bytes = self.scheduler.kv_reserved_bytes, self.kv.limit_bytes
        m.prefix, m.vision, m.mm_prefix = self.caches.stats()
        m.disk = self.tier.stats() if self.tier is not None else None
        m.kv_used_bytes, m.draft_bytes = batch_memory(getattr(self.runner, "batch", None))
        m.mlx_active_bytes, m.mlx_cache_bytes, m.mlx_cache_limit_bytes = mlx_memory()

    def snapshot(self) -> EngineMetrics:
        """Exact counters between steps (call on the worker); ``metrics`` may lag a step."""
        self._record(self.metrics.last_step_s, False)
        return dataclasses.replace(self.metrics)

    def fail_all(self, message: str) -> None:
        """Shutdown: every waiting and running request gets a final error item, and the runner lets go."""
        self._drain_inbox()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(req, RequestStatus.FINISHED_ERROR, message)
        self.runner.execute(SchedulerOutput(finished=self.scheduler.take_finished()))
        self._record(self.metrics.last_step_s, False)
        if self._pending:
            self._publish()
