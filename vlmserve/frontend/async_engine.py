"""[loop] AsyncEngine: submit, stream and abort requests of one model from asyncio.

Phase 1 (template, tokenization, images) runs on a thread pool; phase 2 on the model's
MLX worker thread. The event loop only moves messages: it never runs or waits on MLX.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from PIL import Image

from vlmserve.engine.assembly import Assembled, load_for_serving
from vlmserve.engine.core import EngineCore
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.loader import LoadedModel
from vlmserve.engine.memory import KVBudget
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.pooling import PoolingRunner, kind_of, load_pooling
from vlmserve.engine.request import AbortRequest, AddRequest, EngineMetrics, StepOutput, StepOutputs
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.frontend import self_check
from vlmserve.frontend.output import OutputProcessor, RequestOutput
from vlmserve.frontend.pooling import Pooler
from vlmserve.inputs import Guide, PromptInputs
from vlmserve.preprocess.guided import GuideCompiler, GuideSpec
from vlmserve.preprocess.prompt import PromptBuilder, PromptError

if TYPE_CHECKING:
    from vlmserve.engine.pipeline import Stage

log = logging.getLogger(__name__)
_ids = itertools.count()
PromptFactory = Callable[[PromptBuilder], PromptInputs]  # run on the pool
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class ImagePrompt:
    """A phase 1 that decodes images: it runs in the image lane (its own pool), so a text prompt never
    queues behind a large image's decoding."""

    build: PromptFactory


class EngineError(RuntimeError):
    """Base of the engine's own errors."""


class EngineOverloadedError(EngineError):
    """Too many requests in flight; retry in ``retry_after_s`` (the API answers 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineNotReadyError(EngineError):
    """The engine is starting (``retry_after_s`` set), shut down, or its worker died (the API answers 503)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the API reads of a model once it serves: fixed from then on (``AsyncEngine.info``)."""

    name: str
    model_type: str
    created: int  # when it loaded (Unix seconds)
    max_context: int  # prompt and output tokens at most (--max-model-len caps the model's own)
    max_batch_size: int  # rows decoded together: a request's choices (n) fit in it
    tool_format: str | None  # the tool-call syntax the model speaks
    media_token_ids: frozenset[int]  # the image placeholder ids a token prompt may not hold
    max_pixels: int | None  # the image processor's own pixel budget where it resizes to one (Qwen's)
    weights_bytes: int
    adapter: str  # the adapter that serves it (engine/models/)
    untested: tuple[str, ...] = ()  # for a family no adapter names: what is off, and why
    kind: str = "generate"  # generate (chat), embed or score (rerank): engine/pooling.py


AUDIO_FAMILIES = ("gemma4",)  # those whose audio tower's path is tested (tests/test_audio.py)
STARTING_RETRY_S = 5  # Retry-After while a model loads: its load time is not known until it is done
_AVERAGE = 0.2  # weight of the newest request in the running average of request durations
# Outputs handed to their consumers per pass of the loop. A step of a 256-row batch wakes 256 consumers, and a pass
# runs every ready one before the loop reads its sockets again: 256 in one pass held /health for ~50-130 ms (issue 60)
DISPATCH_SLICE = 32


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context (the API answers 400)."""


class OverBudgetError(ValueError):
    """The request's KV cache could never fit the KV budget, even alone (the API answers 400)."""


class AsyncEngine:
    """One model: its worker thread, its EngineCore, and the asyncio side of every request."""

    def __init__(self, model: str, name: str | None = None, config: EngineConfig = EngineConfig(),
                 pool: Executor | None = None, image_pool: Executor | None = None) -> None:
        self.model_spec = model
        self.name = name or model
        self.config = config
        self._pool = pool or ThreadPoolExecutor(max_workers=config.preprocess_threads, thread_name_prefix="preprocess")
        self._image_pool = image_pool or ThreadPoolExecutor(max_workers=config.image_threads,
                                                            thread_name_prefix="preprocess-images")
        self.worker = MLXWorkerThread(name=f"mlx-{self.name}")
        self.kind = kind_of(model, config.task)  # generate, embed or score: known before it loads (/v1/models)
        self.pooler: Pooler | None = None  # an embed or score model's requests (frontend/pooling.py)
        self.loaded: LoadedModel | None = None
        self.prompter: PromptBuilder | None = None
        # The loop's own copy of the tokenizer (detokenizing, logprobs): the pool's threads have theirs.
        self.tokenizer: Any = None
        self.tool_format: str | None = None  # the tool-call syntax this model speaks
        self.max_images: int | None = None  # images one prompt may carry: the family's, or its start-up check's
        self._info: ModelInfo | None = None  # what the API reads of it, once it has loaded (``info``)
        self.guides: GuideCompiler | None = None  # constrained decoding's grammars, compiled per model
        self.core: EngineCore | None = None
        self.kv: KVBudget | None = None  # measured after the warm-up
        self.ready = False
        self.created = 0  # when it loaded, for /v1/models (Unix seconds)
        self.dead_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[StepOutput]] = {}
        self._undelivered: deque[StepOutput] = deque()  # steps' outputs not yet handed over, in order (``_deliver``)
        self._busy_since: dict[str, float] = {}  # when each consumer last took an output (absent: waiting for one)
        self._request_s = 0.0  # running average of a served request's duration, admission to end
        self._watchdog: asyncio.Task[None] | None = None  # releases consumers that stopped taking outputs
        self._start_ids: set[str] = set()  # the warm-up's own requests: the only ones served before ready
        self.stalled = 0  # requests aborted because their consumer stopped reading
        self.on_step: Callable[[EngineMetrics], None] | None = None  # on the loop, once per engine step
        # On the loop when the engine can never serve again (its worker died, a pipeline rank was lost):
        self.on_dead: Callable[[str], None] | None = None
        # On the pipeline watchdog's thread, once a hung rank has left the worker stuck for good (server.py ends
        # the process):
        self.on_stuck: Callable[[], None] | None = None
        self._assembled: Assembled | None = None  # the model as the engine serves it (engine/assembly.py)
        self._heartbeat: asyncio.Task[None] | None = None
        self._metrics = EngineMetrics()

    # -- life cycle ------------------------------------------------------------------

    async def start(self, warmup: bool = True) -> None:
        """Load on the worker, warm up through the real step, then become ready."""
        self._loop = asyncio.get_running_loop()
        self.worker.on_exit = self._on_worker_exit_threadsafe
        self.worker.start()
        if self.kind != "generate":
            return await self._start_pooling()
        began = time.perf_counter()
        self.loaded = await self.worker.run(self._load)
        assembled = self._assembled
        assert assembled is not None
        self.created = int(time.time())
        loaded = time.perf_counter()
        self.prompter = await asyncio.get_running_loop().run_in_executor(
            self._pool, assembled.prompt_builder, self.config)
        self.tokenizer = await asyncio.get_running_loop().run_in_executor(
            self._pool, copy.deepcopy, self.loaded.tokenizer)
        self.tool_format = assembled.tool_format(self.prompter)
        self.max_images = self.loaded.adapter.max_images
        self.guides = GuideCompiler(self.loaded.tokenizer, self.loaded.eos_token_ids, self.opens_reasoning)
        self.core = assembled.core(self.worker, self._publish_threadsafe, self.config, self._lost_threadsafe,
                                         self.on_stuck)
        self.worker.set_stepper(self.core)
        if warmup:
            await self._warmup()
            await self.worker.run(self.core.reset_caches)
        if not self.loaded.adapter.tested:
            await self._check_untested(assembled)
        probe = await asyncio.get_running_loop().run_in_executor(
            self._pool, self.prompter.build, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        kv, costs, self._metrics = await self.worker.run(self.core.calibrate, probe)
        self.kv = kv
        self._info = ModelInfo(self.name, self.loaded.model_type, self.created, self.loaded.max_context,
                               self.config.max_batch_size, self.tool_format, self.prompter.media_token_ids,
                               self._max_pixels(), self.loaded.weights_bytes, type(self.loaded.adapter).__name__,
                               assembled.untested(self.config))
        self.ready = True
        self._watchdog = asyncio.create_task(self._watch_consumers())
        if self.stage is not None:
            self._heartbeat = asyncio.create_task(self._beat())
        log.info("model %s (%s): loaded in %.2f s, warmed up in %.2f s; KV cache %.1f KiB per position, budget %.2f GiB",
                 self.name, self.loaded.model_type, loaded - began, time.perf_counter() - loaded,
                 kv.footprint.per_position / 1024, (kv.limit_bytes or 0) / 2**30)
        log.info("model %s: a prompt token costs %.2f ms, a decode step %.1f ms: %d prompt tokens per step while "
                 "requests decode", self.name, costs.prompt_token_s * 1e3, costs.decode_step_s * 1e3,
                 costs.stream_tokens())
        for level, note in assembled.notes(self.name, self.core, self.config):
            log.log(level, "%s", note)

    async def _start_pooling(self) -> None:
        """An embedding model or reranker: loaded by mlx-vlm's own loaders, served by a pooling runner (no
        scheduler, no KV cache)."""
        began = time.perf_counter()
        loaded = await self.worker.run(load_pooling, self.model_spec, self.kind, self.config.max_model_len)
        runner = PoolingRunner(loaded)
        self.worker.set_stepper(runner)
        facts = loaded.facts
        self.pooler = Pooler(self.name, facts, loaded.processor, self.worker, runner, self._pool)
        self.created = int(time.time())
        self._info = ModelInfo(self.name, facts.model_type, self.created, facts.max_tokens, 1, None, frozenset(),
                               None, facts.weights_bytes, "pooling", (), self.kind)
        self.ready = True
        log.info("model %s (%s): %s model loaded in %.2f s (%d tokens per input%s)", self.name, facts.model_type,
                 self.kind, time.perf_counter() - began, facts.max_tokens,
                 f", {facts.dimensions} dimensions" if facts.dimensions else "")

    def _load(self) -> LoadedModel:
        self.worker.assert_on_worker()
        self._assembled = load_for_serving(self.model_spec, self.name, self.config)
        return self._assembled.loaded

    @property
    def stage(self) -> Stage | None:
        """This rank's layers, when served across ranks."""
        return self._assembled.stage if self._assembled is not None else None

    # -- across ranks ----------------------------------------------------------------------

    async def _beat(self) -> None:
        """Ping every rank now and then, so a rank that hangs while nothing runs is noticed too."""
        assert self._assembled is not None
        while self.worker.alive:
            await asyncio.sleep(min(2.0, self.config.pipeline_timeout_s / 4))
            try:
                await self.worker.run(self._assembled.heartbeat)
            except Exception:  # noqa: BLE001 - the worker died: _on_worker_exit says why
                return

    def _lost_threadsafe(self, message: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
                self._loop.call_soon_threadsafe(self._die, message)

    def _die(self, reason: str, fault: bool = True) -> None:
        """The engine can never serve again: unready, every request ends with ``reason``; a fault (not
        a shutdown) is reported to ``on_dead``."""
        self.ready = False
        self.dead_reason = self.dead_reason or reason
        self._fail_streams(self.dead_reason)
        if fault:
            self.worker.retire()
        if fault and self.on_dead is not None:
            self.on_dead(self.dead_reason)

    @property
    def opens_reasoning(self) -> bool:
        """Whether this model's prompts end inside an open ``<think>`` block (Qwen3.5)."""
        return self.prompter is not None and self.prompter.template.opens_reasoning

    def _max_pixels(self) -> int | None:
        """The image processor's own pixel budget where it resizes to one (Qwen's), else None."""
        limit = self.prompter.image_limit if self.prompter is not None else None
        return limit.area if limit is not None and limit.takes_pixel_kwargs else None

    @property
    def info(self) -> ModelInfo:
        """The model's description, once it has loaded (EngineNotReadyError before)."""
        if self._info is None:
            self.check_ready()
        assert self._info is not None, "a model that serves has its description"
        return self._info

    def check_ready(self) -> None:
        """EngineNotReadyError unless it serves: while it loads (with when to retry), or why it cannot."""
        if self.ready:
            return
        if self.starting:
            raise EngineNotReadyError(f"model {self.name!r} is loading", STARTING_RETRY_S)
        self._check_alive()  # says why it is not available
        raise EngineNotReadyError(f"model {self.name!r} is not available")

    def media_refusal(self, images: int, videos: int, audio: int = 0) -> str | None:
        """Why this model cannot take a prompt with these images, videos and audio clips, or None (also
        before it is loaded: the request is refused as not ready)."""
        if self.loaded is None or self.prompter is None:
            return None
        family = f"model {self.name!r} ({self.loaded.model_type})"
        if audio:
            return self._audio_refusal(family)
        if videos and self.prompter.video_sampling is None:
            return f"{family} does not take video: its processor has no video processor"
        if videos and images and not self.loaded.adapter.mixes_media:
            return f"{family} takes images or a video in one prompt, not both (mlx-vlm's merge fills one kind)"
        return None

    def _audio_refusal(self, family: str) -> str | None:
        assert self.loaded is not None and self.prompter is not None
        if self.loaded.model_type not in AUDIO_FAMILIES:
            return f"{family} does not take audio: only Gemma 4 checkpoints with an audio tower do here"
        if getattr(self.loaded.model, "audio_tower", None) is None:
            return f"{family} does not take audio: the checkpoint has no audio tower (no audio_config)"
        if self.prompter.audio_rate is None:
            return (f"{family} does not take audio: its processor has no feature extractor (processor_config.json "
                    "lacks feature_extractor)")
        return None

    def opens_reasoning_with(self, template_kwargs: Mapping[str, Any]) -> bool:
        """The same, for prompts rendered with these template variables (``enable_thinking: false``)."""
        return self.prompter is not None and self.prompter.opens_reasoning_with(template_kwargs)

    async def _warmup(self) -> None:
        """An image request and a text request through the real path, prefill and decode (EOS ignored);
        either failing fails the load."""
        assembled = self._assembled
        assert assembled is not None
        image = Image.new("RGB", (64, 64), (128, 64, 32))
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        for images in ([image], []):
            parts = [*({"type": "image"} for _ in images), {"type": "text", "text": "Hi"}]
            request_id = f"warmup-{next(_ids)}"
            chat = [{"role": "user", "content": parts}]
            try:
                factory: PromptFactory = lambda p: p.build(chat, images)  # noqa: B023, E731 - used in this pass only
                outputs = [o async for o in self._before_ready(request_id, factory, params)]
            except Exception as exc:  # noqa: BLE001 - phase 1 or admission: the model cannot serve
                raise assembled.warmup_failed(self.name, f"{type(exc).__name__}: {exc}") from exc
            if not outputs or outputs[-1].error is not None:
                raise assembled.warmup_failed(self.name, outputs[-1].error if outputs else "no output")

    async def _before_ready(self, request_id: str, prompt: PromptInputs | PromptFactory, params: SamplingParams
                            ) -> AsyncGenerator[RequestOutput, None]:
        """A start-up request (the warm-up's, the self-check's): served before the engine is ready, and
        whatever happens, nothing of it left behind."""
        self._start_ids.add(request_id)
        try:
            async for out in self.generate(request_id, prompt, params):
                yield out
        finally:
            self._start_ids.discard(request_id)
            self.abort(request_id)

    async def _check_untested(self, assembled: Assembled) -> None:
        """A family no adapter names serves only where it answers as mlx-vlm does (frontend/self_check.py);
        its decode batching only where the probes decoded together gave their tokens alone."""
        assert self.loaded is not None and self.prompter is not None and self.core is not None
        try:
            verdict = await self_check.check(self.loaded, self.prompter, self._pool, self.worker, self._before_ready)
        except Exception as exc:  # noqa: BLE001 - a probe mlx-vlm ran that this server could not
            raise assembled.untested_refused(self.name, f"a probe failed here: {type(exc).__name__}: {exc}") from exc
        if verdict.refusal is not None:
            raise assembled.untested_refused(self.name, verdict.refusal)
        self.max_images = verdict.max_images
        if not verdict.batches:  # one request at a time, as mlx-vlm's own decode
            self.config = dataclasses.replace(self.config, max_batch_size=1)
            await self.worker.run(self.core.limit_batch, 1)
        log.warning("model %s (%s): an untested family: %d probes gave mlx-vlm's own prompt ids and greedy choices "
                    "(up to rounding); decode batching %s", self.name, self.loaded.model_type, verdict.probes,
                    "on (so did the probes decoded together)" if verdict.batches else
                    "off (the probes decoded together did not): one request at a time")
        if verdict.max_images is not None:
            log.warning("model %s (%s): at most %d image(s) a prompt: mlx-vlm's own path ran no probe with more",
                        self.name, self.loaded.model_type, verdict.max_images)

    async def shutdown(self, message: str = "engine is shutting down") -> None:
        """Wake every waiting request with an error, stop the worker and join it."""
        for task in (self._watchdog, self._heartbeat):
            if task is not None:
                task.cancel()
        self.ready = False
        self.dead_reason = self.dead_reason or message
        self._fail_streams(message)
        if self.core is not None and self.worker.alive:
            try:
                await asyncio.wait_for(self.worker.run(self.core.fail_all, message), timeout=10)
            except Exception:  # noqa: BLE001 - a dying worker is being stopped anyway
                log.warning("engine %s: could not fail requests on the worker", self.name)
            try:  # what the prefix stores hold goes to the disk tier (--prefix-cache-dir)
                await asyncio.wait_for(self.worker.run(self.core.close_caches), timeout=120)
            except Exception:  # noqa: BLE001 - a dying worker is being stopped anyway
                log.warning("engine %s: could not write the prefix caches to disk", self.name)
            if self._assembled is not None and self.stage is not None:  # then every other rank stops
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.worker.run(self._assembled.close), timeout=10)
        await asyncio.get_running_loop().run_in_executor(None, self.worker.shutdown)

    def _on_worker_exit_threadsafe(self, error: BaseException | None) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._on_worker_exit, error)
            except RuntimeError:
                pass  # the loop closed between the check and the call

    def _on_worker_exit(self, error: BaseException | None) -> None:
        reason = f"MLX worker died: {error!r}" if error else "MLX worker stopped"
        if error is not None and self.stage is not None:
            # MLX's backends say "[ring] connection to a peer was lost" and the like
            lost = isinstance(error, ConnectionError) or any(w in str(error) for w in ("peer", "connection", "socket"))
            what = f"lost {self.stage.peers}" if lost else "a step failed after it went to every rank"
            reason = f"pipeline: {what} ({error}); ending every request and stopping"
        self._die(reason, fault=error is not None)

    def _fail_streams(self, message: str) -> None:
        if self.pooler is not None:
            self.pooler.fail_all(message)
        for request_id, q in self._streams.items():
            q.put_nowait(StepOutput(request_id, finish_reason="error", error=message))

    # -- requests ------------------------------------------------------------------------

    def generate_chat(self, request_id: str, messages: Sequence[dict[str, Any]], images: Sequence[Image.Image],
                      tools: Sequence[dict[str, Any]] | None, params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Chat messages (images as ``{"type": "image"}`` parts) -> a stream of outputs."""
        return self.generate(request_id, lambda p: p.build(messages, images, tools, request_id=request_id), params)

    async def generate(self, request_id: str, prompt: PromptInputs | PromptFactory | ImagePrompt,
                       params: SamplingParams, forks: Sequence[tuple[str, SamplingParams]] = ()
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs for one request; cancelling the consumer aborts the request. ``forks`` (n > 1):
        more requests of this prompt, each with its own sampling, that share its prefill and become
        rows of their own when it ends; read each with ``follow`` once this one has its first output."""
        if 1 + len(forks) > self.config.max_batch_size:
            raise ValueError(f"{1 + len(forks)} rows of one prompt cannot fit a batch of {self.config.max_batch_size}")
        self._admit(request_id, len(forks))
        admitted = time.monotonic()
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._streams[request_id] = q
        try:
            prompt = await self._phase1(prompt)
            self._check_fits(prompt, params, 1 + len(forks))
            for fork_id, _ in forks:  # before the post: their outputs may come with the prompt's first
                self._streams[fork_id] = asyncio.Queue()
            self._check_alive().post(AddRequest(request_id, prompt, params, forks=tuple(forks)))
        except BaseException:
            for stream_id in (request_id, *(f for f, _ in forks)):
                self._streams.pop(stream_id, None)
            raise
        outputs = self.follow(request_id, params, admitted)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def follow(self, request_id: str, params: SamplingParams, admitted: float | None = None
                     ) -> AsyncGenerator[RequestOutput, None]:
        """A submitted request's outputs until it ends (a fork's: ``generate``'s ``forks``; nothing if
        its prompt never reached the engine); closed early, it aborts the request."""
        q = self._streams.get(request_id)
        if q is None:
            return
        admitted = admitted if admitted is not None else time.monotonic()
        engine_done = False
        try:
            output = OutputProcessor.for_params(self.tokenizer, params)
            while True:
                self._busy_since.pop(request_id, None)
                step = await q.get()
                self._busy_since[request_id] = time.monotonic()
                engine_done = step.finish_reason is not None
                result = output.process(step)
                yield result
                if result.finished:
                    return
        finally:
            if self._streams.get(request_id) is q:
                del self._streams[request_id]
            self._busy_since.pop(request_id, None)
            if not engine_done:
                self.abort(request_id)  # disconnect, break or stop string: the worker frees the slot
            else:
                took = time.monotonic() - admitted
                self._request_s = took if not self._request_s else (1 - _AVERAGE) * self._request_s + _AVERAGE * took

    async def guide(self, spec: GuideSpec, after_thinking: bool | None = None) -> Guide:
        """The compiled grammar for ``spec`` (on the pool; cached per model); GuideError if invalid.
        ``after_thinking``: the prompt ends inside ``<think>`` (None: as this model's prompts do)."""
        self._check_alive()
        assert self.guides is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.guides.compile, spec, after_thinking)

    def abort(self, request_id: str) -> None:
        """Non-blocking, from any thread: the worker applies it at its next iteration."""
        if self.core is not None:
            self.core.post(AbortRequest(request_id))

    def _admit(self, request_id: str, forks: int = 0) -> None:
        self._check_alive()
        if not self.ready and request_id not in self._start_ids:  # warm-up and start-up measures need it alone
            raise EngineNotReadyError(f"model {self.name!r} is loading", STARTING_RETRY_S)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if len(self._streams) + forks >= self.config.max_batch_size + self.config.max_queue:
            raise EngineOverloadedError(
                f"model {self.name!r} is overloaded: {len(self._streams)} requests in flight; retry later",
                self.retry_after_s())

    def retry_after_s(self) -> int:
        """When a full queue will likely have room: one of the batch's requests ends about every
        (mean request duration / batch size) seconds. At least 1, at most 60."""
        return max(1, min(60, math.ceil(self._request_s / self.config.max_batch_size)))

    @property
    def starting(self) -> bool:
        """Loading or warming up: it will be ready (unlike a shut-down or dead engine)."""
        return not self.ready and self.dead_reason is None

    def _check_alive(self) -> EngineCore:
        if self.core is None or self.dead_reason is not None or not self.worker.alive:
            retry = STARTING_RETRY_S if self.starting else None
            raise EngineNotReadyError(f"model {self.name!r} is not available: {self.dead_reason or 'not started'}",
                                      retry)
        return self.core

    async def preprocess(self, prompt: PromptFactory | ImagePrompt) -> PromptInputs:
        """Phase 1 alone, on the pool (its image lane for images), without generating (/tokenize)."""
        self._check_alive()
        return await self._phase1(prompt)

    async def on_pool(self, work: Callable[[PromptBuilder], T]) -> T:
        """``work`` with this model's prompt builder, on the preprocessing pool."""
        self._check_alive()
        prompter = self.prompter
        assert prompter is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, prompter)

    async def _phase1(self, prompt: PromptInputs | PromptFactory | ImagePrompt) -> PromptInputs:
        if isinstance(prompt, PromptInputs):
            return prompt
        prompter = self.prompter
        assert prompter is not None
        if isinstance(prompt, ImagePrompt):
            return await asyncio.get_running_loop().run_in_executor(self._image_pool, prompt.build, prompter)
        return await asyncio.get_running_loop().run_in_executor(self._pool, prompt, prompter)

    def _check_fits(self, prompt: PromptInputs, params: SamplingParams, rows: int = 1) -> None:
        assert self.loaded is not None
        most = self.max_images
        if most is not None and prompt.num_images > most:
            raise PromptError(f"model {self.name!r} ({self.loaded.model_type}) takes at most {most} image(s) "
                              f"per request; this one has {prompt.num_images}")
        if prompt.has_videos and not self.loaded.adapter.tested:
            raise PromptError(f"model {self.name!r} ({self.loaded.model_type}) takes no video: its family is untested "
                              "here and its start-up check sends none")
        limit = self.loaded.max_context
        if len(prompt) + 1 > limit:
            raise PromptTooLongError(f"prompt is {len(prompt)} tokens; model {self.name!r} allows at most {limit - 1}")
        need = min(len(prompt) + params.max_tokens, limit)
        refusal = self.kv.refusal(need, rows) if self.kv is not None else None
        if refusal is not None:
            raise OverBudgetError(f"model {self.name!r} cannot take this request: {refusal}")

    def _publish_threadsafe(self, step: StepOutputs) -> None:
        """On the worker, once per step: one hop to the loop for all of the step's outputs."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, step)

    def _dispatch(self, step: StepOutputs) -> None:
        if self.on_step is not None and step.metrics.steps != self._metrics.steps:
            self.on_step(step.metrics)
        self._metrics = step.metrics
        if step.outputs and not self._undelivered:
            self._loop_call_soon(self._deliver)
        self._undelivered.extend(step.outputs)

    def _deliver(self) -> None:
        """Hand over up to ``DISPATCH_SLICE`` outputs, oldest first, and the rest on later passes of the loop, so
        that a large batch's step never holds the loop (its probes, its arrivals) for a whole pass."""
        now = time.monotonic()
        for _ in range(min(DISPATCH_SLICE, len(self._undelivered))):
            out = self._undelivered.popleft()
            q = self._streams.get(out.request_id)
            if q is None:  # gone: its consumer stopped listening (the abort is on its way)
                continue
            busy = self._busy_since.get(out.request_id)
            if not q.empty() and busy is not None and now - busy > self.config.stall_timeout_s:
                self._abort_stalled(out.request_id, q, now - busy)
            else:
                q.put_nowait(out)
        if self._undelivered:
            self._loop_call_soon(self._deliver)

    def _loop_call_soon(self, callback: Callable[[], None]) -> None:
        assert self._loop is not None
        self._loop.call_soon(callback)

    async def _watch_consumers(self) -> None:
        """On a timer, not on token arrival: a consumer that has held an output for longer than the
        stall timeout (its client reads nothing, so its stream cannot be written) is released, the
        last token's output included, when nothing more would arrive to notice it."""
        every = min(1.0, self.config.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for request_id, busy in list(self._busy_since.items()):
                q = self._streams.get(request_id)
                if q is not None and now - busy > self.config.stall_timeout_s:
                    self._abort_stalled(request_id, q, now - busy)

    def _abort_stalled(self, request_id: str, q: asyncio.Queue[StepOutput], idle_s: float) -> None:
        """A consumer (a client that stopped reading its stream) holds its batch slot and its place in
        flight no longer: the request is aborted and forgotten; the consumer finds an error after what
        it has not read."""
        self.stalled += 1
        log.warning("request %s: stalled: its client read nothing for %.1f s; aborted and released", request_id,
                    idle_s)
        self._busy_since.pop(request_id, None)
        self.abort(request_id)
        q.put_nowait(StepOutput(request_id, finish_reason="error",
                                error=f"the client read nothing for {idle_s:.0f} s; the request was aborted"))
        del self._streams[request_id]

    # -- introspection -------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + (self.pooler.in_flight if self.pooler is not None else 0)

    @property
    def weights_bytes(self) -> int:
        if self.pooler is not None:
            return self.pooler.facts.weights_bytes
        return self.loaded.weights_bytes if self.loaded is not None else 0

    def forget(self) -> None:
        """After ``shutdown``: drop the model, its processor and tokenizers, so that nothing here keeps its
        arrays alive (a model unloaded on demand gives its memory back)."""
        assert not self.worker.alive, "forget a stopped engine only"
        self.loaded = self.core = self.prompter = self.tokenizer = self.guides = self.kv = self.pooler = None
        self._assembled = None
        self._streams.clear()
        # the cycles through callbacks too: an engine made before the server froze its heap (gc.freeze, at
        # ready) is never collected, so nothing it holds may keep the model
        self.worker.on_exit = self.on_step = self.on_dead = self.on_stuck = None
        self.worker.set_stepper(None)

    async def stats(self) -> EngineMetrics:
        """Exact engine counters, read on the worker between two steps."""
        return await self.worker.run(self._check_alive().snapshot)

    @property
    def metrics(self) -> EngineMetrics | None:
        """The counters after the last step the loop has seen (None before the engine starts)."""
        return self._metrics if self.core is not None else None
