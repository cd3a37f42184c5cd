"""[worker] A model as the engine serves it: the one place that turns a model path and an ``EngineConfig``
into a ``LoadedModel`` (and, across ranks, this rank's ``Stage``), then into the ``EngineCore`` that serves it.

``AsyncEngine`` (rank 0, or the only rank) and ``vlmserve serve``'s other ranks (``load_follower``) both
load through here: the process's BLAS and thread settings, the model (whole, or this rank's slice), its
drafter for speculative decoding, the context cap, and the KV quantization the family allows (or why
not). ``Assembled.core`` builds the engine over it, rank 0's runner leading the pipeline where there is
one; ``Assembled.notes`` says at start-up what was decided and why. The client side (frontend/) only
submits, streams and aborts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from vlmserve.engine.caches import cache_policy
from vlmserve.engine.core import EngineCore
from vlmserve.engine.drafter import Drafter
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.kv_quant import kv_quant_for
from vlmserve.engine.loader import (
    LoadedModel,
    ModelLoadError,
    configure_process,
    load_drafter,
    load_model,
    settle_random_key,
)
from vlmserve.engine.models import SUPPORTED_FAMILIES, UNTESTED_OFF
from vlmserve.engine.pipeline import Stage, load_stage
from vlmserve.engine.pipeline_runner import Follower, Leader, Watch
from vlmserve.engine.request import Publisher
from vlmserve.engine.runner import ModelRunner
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.preprocess.prompt import CacheHints, PromptBuilder, templater_of
from vlmserve.tools import select_parser


@dataclass(slots=True)
class Assembled:
    loaded: LoadedModel
    stage: Stage | None = None  # this rank's layers, when served across ranks
    kv_quant_off: str | None = None  # why --kv-bits is off for this model, where it was asked for
    leader: Leader | None = None  # rank 0's part in the pipeline, once ``core`` has built it

    def core(self, worker: MLXWorkerThread, publish: Publisher, config: EngineConfig,
             on_hang: Callable[[str], None], on_stuck: Callable[[], None] | None) -> EngineCore:
        """The engine over this model: alone, or rank 0 leading the other ranks under a watchdog that calls
        ``on_hang`` (from its thread) when a rank stops answering, and ``on_stuck`` once a hung rank has left
        the worker stuck for good."""
        if self.stage is None:
            return EngineCore(self.loaded, worker, publish, config)
        watch = Watch(self.stage, config.pipeline_timeout_s)
        watch.on_hang, watch.on_stuck = on_hang, on_stuck
        leader = self.leader = Leader(self.stage, watch)
        return EngineCore(self.loaded, worker, publish, config,
                          runner_for=lambda loaded, caches: ModelRunner(loaded, caches, leader))

    def prompt_builder(self, config: EngineConfig) -> PromptBuilder:
        """Phase 1's builder for this model (on the pool: it inspects the template and copies the processor for
        each pool thread), with the family's image limit and what the prefix caches need of phase 1: snapshot
        points where the cache cannot be cut back, picture keys where the image-keyed cache is on."""
        adapter, processor = self.loaded.adapter, self.loaded.processor
        policy = cache_policy(config, adapter)
        hints = CacheHints(stems=policy.stems, picture_keys=policy.mm_prefix)
        return PromptBuilder.for_processor(processor, config.preprocess_threads, hints,
                                           adapter.processor_limit(processor), adapter.video_as_frames)

    def tool_format(self, prompter: PromptBuilder) -> str | None:
        """The tool-call syntax this model speaks: its template's, else its family's (Hermes where the prompt
        builder writes the tools itself)."""
        if not prompter.template.renders_tools:
            return "hermes"
        template = getattr(templater_of(self.loaded.processor), "chat_template", None)
        return select_parser(template if isinstance(template, str) else None, self.loaded.adapter.tool_format)

    def warmup_failed(self, name: str, reason: str | None) -> ModelLoadError:
        """A load whose warm-up failed; for a family no adapter names, the ones that are tested."""
        if not self.loaded.adapter.tested:
            return self.untested_refused(name, f"its warm-up failed: {reason}")
        return ModelLoadError(f"model {name!r} ({self.loaded.model_type}) failed its warm-up: {reason}")

    def untested_refused(self, name: str, reason: str) -> ModelLoadError:
        """The one line that refuses a family no adapter names, where it does not answer as mlx-vlm does."""
        return ModelLoadError(f"model {name!r}: model type {self.loaded.model_type!r} is not served: it is untested "
                              f"here and {reason}; tested families: {', '.join(SUPPORTED_FAMILIES)}")

    def untested(self, config: EngineConfig) -> tuple[str, ...]:
        """For a family no adapter names, what is off and why (nothing for a tested one)."""
        if self.loaded.adapter.tested:
            return ()
        batching = () if config.max_batch_size > 1 else ("decode batching is off: its probes decoded together "
                                                         "left mlx-vlm's greedy choices",)
        return (*UNTESTED_OFF, *batching)

    def heartbeat(self) -> None:
        """On the worker, between steps: ping every rank (nothing alone), so that a rank that hangs while
        nothing runs is noticed too."""
        if self.leader is not None:
            self.leader.heartbeat()

    def close(self) -> None:
        """On the worker, after the last step: every other rank stops (nothing alone)."""
        if self.leader is not None:
            self.leader.close()

    def notes(self, name: str, core: EngineCore, config: EngineConfig) -> list[tuple[int, str]]:
        """What start-up says about this engine's choices (log level, line): speculative decoding, quantized
        KV (a warning where it was asked for and is off), the disk tier, and each cache asked for that is
        off, with why."""
        loaded = self.loaded
        adapter = type(loaded.adapter).__name__
        lines = [(logging.INFO, f"model {name} ({loaded.model_type}): served by {adapter}")] if loaded.adapter.tested else \
            [(logging.WARNING, f"model {name} ({loaded.model_type}): no adapter names this family, so it is served by "
              f"{adapter}: {'; '.join(self.untested(config))}")]
        said = _speculation(name, loaded, core, config)
        lines += [(logging.INFO, said)] if said is not None else []
        quant = loaded.adapter.kv_quant
        if quant is not None:
            lines.append((logging.INFO, f"model {name}: KV quantized to {quant.bits} bits (groups of {quant.group_size}) from "
                         f"{quant.start} positions, sliding-window and recurrent layers excepted"))
        elif self.kv_quant_off is not None:
            lines.append((logging.WARNING, f"model {name} ({loaded.model_type}): --kv-bits is off: {self.kv_quant_off}"))
        if core.tier is not None:
            disk = core.tier.stats()
            lines.append((logging.INFO, f"model {name}: prefix caches spill to {config.prefix_cache_dir} ({disk.entries} "
                          f"files, {disk.bytes / 1e6:.1f} MB found; at most {config.prefix_cache_disk_bytes / 2**30:.1f} GB)"))
        lines += [(logging.INFO, f"model {name} ({loaded.model_type}): {why}") for why in core.policy.off]
        return lines


def _speculation(name: str, loaded: LoadedModel, core: EngineCore, config: EngineConfig) -> str | None:
    """Whether drafts are verified here, and why not where they are not (None: only requests' predictions
    would draft, as they may)."""
    spec = config.speculative
    if core.scheduler.drafts is None:
        why = "across pipeline ranks" if config.pipeline else f"for this family ({loaded.model_type})"
        return f"model {name}: speculative decoding is off {why}: ngram drafts and requests' predictions are unused"
    adaptive = "" if spec is None or spec.adaptive else ", drafting whatever it costs"
    if spec is not None and spec.drafter:
        return (f"model {name}: speculative decoding with the drafter {spec.model or 'the checkpoint carries'} ({spec.method}, "
                f"up to {spec.num_speculative_tokens} tokens){adaptive}")
    if spec is not None:
        return (f"model {name}: speculative decoding with ngram drafts (up to {spec.num_speculative_tokens} tokens, "
                f"lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max}){adaptive}")
    return None


def load_for_serving(spec: str, name: str | None, config: EngineConfig) -> Assembled:
    """Load ``spec`` on the calling thread (the worker: its weights become that thread's arrays) as ``config``
    serves it. ModelLoadError when it cannot be."""
    configure_process()
    stage = None
    try:
        if config.pipeline:
            loaded, stage = load_stage(spec, name, config.dtype, config.trust_remote_code)
        else:
            loaded = load_model(spec, name, config.dtype, config.trust_remote_code)
        if config.speculative is not None and config.speculative.drafter:
            loaded.drafter = load_drafter(config.speculative, loaded, config.pipeline)
    finally:
        settle_random_key()
    if config.max_model_len:
        loaded.max_context = min(loaded.max_context, config.max_model_len)
    if config.chat_template is not None:  # before the template is inspected and the processor copied
        for owner in {id(o): o for o in (loaded.processor, loaded.tokenizer)}.values():
            owner.chat_template = config.chat_template
    adapter = loaded.adapter
    reads_target = isinstance(loaded.drafter, Drafter)  # Gemma 4's assistant reads the target's KV
    adapter.kv_quant, off = kv_quant_for(adapter.make_cache(), config.kv_bits, config.kv_group_size,
                                         config.quantized_kv_start, adapter.packs_kv, reads_target, config.pipeline)
    return Assembled(loaded, stage, off)


def load_follower(spec: str, name: str | None, config: EngineConfig) -> tuple[ModelRunner, Follower]:
    """A rank other than 0: its slice loaded on the calling thread (its worker), and the runner that runs
    the steps rank 0 sends (``Follower.follow``)."""
    assembled = load_for_serving(spec, name, dataclasses.replace(config, pipeline=True))
    assert assembled.stage is not None
    follower = Follower(assembled.stage)
    return ModelRunner(assembled.loaded, rank=follower), follower
