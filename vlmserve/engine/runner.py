"""[worker] ModelRunner: executes one step's plan through the family's adapter, and nothing else.

``execute(plan) -> RunnerOutput`` is the one call the core makes. A prompt enters the prefill
batch (a row per prompt: its own KV cache, embedding, carried hidden state), is embedded when the
plan says (vision tower or the vision cache, then the merge), is prefilled chunk by chunk (by tokens,
or by layers where its image span attends both ways), samples its first token and joins the
decode batch's left-padded caches (mlx-lm's PromptProcessingBatch -> GenerationBatch). Prefilling
each prompt on its own is what lets prompts of any length, with or without images, join one decode
batch: mlx-vlm's own batch prefill concatenates per-prompt 4-D masks and fails on gemma3 when
lengths differ. Whole prompts the plan groups share one left-padded forward.

A runner's ``Rank`` says how it takes part in a step: ``Alone`` in one process, or as one rank of a
pipeline (pipeline_runner.py), where every rank runs this same ``execute`` on the same plan.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from vlmserve.engine import guided
from vlmserve.engine.batch import DecodeBatch
from vlmserve.engine.caches import EngineCaches
from vlmserve.engine.dflash import DFlashDrafter
from vlmserve.engine.draft_model import DraftModel, ModelRows
from vlmserve.engine.kv_quant import merge_rows
from vlmserve.engine.loader import LoadedModel
from vlmserve.engine.models import Embedded
from vlmserve.engine.models.base import tapped
from vlmserve.engine.mtp import DraftRows, MtpDrafter
from vlmserve.engine.mtp_prefix import DraftPrefix
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import (
    EncodeChunk,
    NewRequest,
    PrefillChunk,
    RunnerOutput,
    Sample,
    SchedulerOutput,
    TokenLogprob,
)
from vlmserve.engine.sampler import RowState, sample
from vlmserve.engine.verify import StepDrafts, read_drafts, verify
from vlmserve.inputs import HostArray, ImageItem, PromptInputs

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PromptRow:
    """One request's prompt on its way into its KV cache, until it joins the decode batch."""

    prompt: PromptInputs
    params: SamplingParams
    input_ids: mx.array
    cache: list[Any]
    embedded: Embedded | None = None  # after ``encode``; freed once the prompt is in the cache
    hidden: mx.array | None = None  # split by layers: the hidden state after the layers done so far
    vision_hidden: mx.array | None = None  # its image split by tower blocks: the state after those done
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked: each position's so far
    forks: dict[str, SamplingParams] = field(default_factory=dict)  # n > 1: rows copied from it at its end
    draft: DraftRows | None = None  # a drafter with a KV of its own: the prompt's positions in it so far
    drafts: bool = True  # a draft model drafts for it (NewRequest.drafts)


class Rank(Protocol):
    """How a runner takes part in each step on its rank: ``Alone``, or as rank 0 (``Leader``) or another
    rank (``Follower``) of a pipeline, pipeline_runner.py. ``execute`` asks it at fixed points."""

    samples: bool  # this rank holds the head: it samples each row's token and scores prompts

    def share(self, runner: ModelRunner, plan: SchedulerOutput, out: RunnerOutput) -> None:
        """Once the step's prompts are entered and embedded, before the language model runs: from here
        every rank runs the same parts of the step."""

    def on_fault(self, exc: Exception) -> None:
        """A part of the step raised ``exc``: return to fail just the requests it touched, raise to end
        the pipeline (the ranks' states would be apart)."""

    def done(self) -> None:
        """The step is over, or raised."""


class Alone:
    """One process, no pipeline: nothing to share, and a fault ends only its requests."""

    samples = True

    def share(self, runner: ModelRunner, plan: SchedulerOutput, out: RunnerOutput) -> None:
        pass

    def on_fault(self, exc: Exception) -> None:
        pass

    def done(self) -> None:
        pass


class ModelRunner:
    """Owns every MLX array of a request: its prompt row, then its decode-batch row."""

    def __init__(self, loaded: LoadedModel, caches: EngineCaches | None = None, rank: Rank | None = None) -> None:
        self.rank: Rank = rank if rank is not None else Alone()
        self.loaded = loaded
        self.adapter = loaded.adapter
        self.drafter = loaded.drafter  # speculative decoding's drafter model (engine/drafter.py), or None
        self.caches = caches if caches is not None else EngineCaches(None, None)
        # only where one image's features can be computed alone (the engine's cache_policy keeps none elsewhere)
        assert self.caches.vision is None or self.adapter.vision_cache, "this family's images are encoded together"
        self.prompts: dict[str, PromptRow] = {}  # the prefill batch, by request
        self.batch = DecodeBatch()
        self.held: dict[str, Callable[[], None]] = {}  # prefilled rows kept out of the batch: their join

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one step's plan: forget, enter, encode, decode, prefill. A part that raises fails just
        the requests it touched (where the rank allows it); they are in ``errors`` and the rest of the
        step goes on."""
        out = RunnerOutput()
        self.remove(plan.finished)
        for new in plan.new:
            self._guarded(out, [new.request_id], self._enter, new)
        self._encode_all(plan.encode, out)
        try:
            self.rank.share(self, plan, out)
            for request_id in plan.join:
                if (join := self.held.pop(request_id, None)) is not None:
                    self._guarded(out, [request_id], join)
            if plan.decode and (plan.drafts or plan.draft_widths):
                self._guarded(out, plan.decode, self._verify, plan, out)
            elif plan.decode:
                self._guarded(out, plan.decode, lambda: out.samples.update(self.decode(out.errors)))
                out.unread.update(plan.decode)
            self._prefill_all(plan, out)
        finally:
            self.rank.done()
        return out

    def _encode_all(self, pieces: list[EncodeChunk], out: RunnerOutput) -> None:
        whole = [c.request_id for c in pieces if c.whole and c.request_id not in out.errors]
        for group in self.embedding_groups(whole):
            self._guarded(out, group, self._encode, group, out)
        for piece in pieces:
            if not piece.whole and piece.request_id not in out.errors:
                self._guarded(out, [piece.request_id], self._encode_piece, piece, out)

    def _prefill_all(self, plan: SchedulerOutput, out: RunnerOutput) -> None:
        together: set[str] = set()
        for group in plan.prefill_groups:
            live = [r for r in group if r not in out.errors]  # a prompt whose embedding failed drops out
            if len(live) > 1:
                together.update(live)
                chunks = [c for c in plan.prefill if c.request_id in live]
                self._guarded(out, live, self._prefill_together, live, chunks, out)
        for chunk in plan.prefill:
            if chunk.request_id not in together and chunk.request_id not in out.errors:
                self._guarded(out, [chunk.request_id, *chunk.forks], self._prefill, chunk, out)

    def _guarded(self, out: RunnerOutput, request_ids: list[str], fn: Callable[..., object], *args: object) -> None:
        """Run one part of the step; if it raises (and the rank lets the fault be theirs), log it and fail
        the requests it touched."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - an engine fault ends its requests, not the engine
            self.rank.on_fault(exc)
            log.exception("engine step failed for %s", request_ids)
            out.faults += 1
            out.errors.update(dict.fromkeys(request_ids, f"{type(exc).__name__}: {exc}"))

    # -- enter and encode -----------------------------------------------------------

    def _enter(self, new: NewRequest) -> None:
        input_ids = mx.array(new.prompt.input_ids, dtype=mx.int32)[None]
        prefix = self.caches.take_prefix(new.request_id) if new.num_cached else None
        remembered = prefix.pop() if prefix is not None and isinstance(prefix[-1], DraftPrefix) else None
        cache = prefix if prefix is not None else self.adapter.make_cache()
        row = self.prompts[new.request_id] = PromptRow(new.prompt, new.params, input_ids, cache, forks=dict(new.forks),
                                                       drafts=new.drafts)
        if remembered is not None and remembered.end == new.num_cached:  # the drafter's state of the same positions
            row.draft = self.drafter.remembered(remembered) if isinstance(self.drafter, DraftModel) else \
                remembered.rows(len(self._mtp().model.layers))
        if new.params.prompt_logprobs is not None:
            assert not new.num_cached, "a scored prompt reuses no KV"
            row.prompt_logprobs = [None]  # the first token has nothing before it

    def embedding_groups(self, request_ids: list[str]) -> list[list[str]]:
        """Prompts in the groups ``_encode`` takes: image prompts whose images have one shape
        together where the adapter allows it (one vision forward), every other prompt alone."""
        groups: dict[object, list[str]] = {}
        for request_id in request_ids:
            prompt = self.prompts[request_id].prompt
            pixels = prompt.arrays.get("pixel_values")
            batched = isinstance(pixels, np.ndarray) and self.adapter.batch_embed and not self._caches(prompt) \
                and not prompt.has_videos and not prompt.has_audio  # clips' features differ in length
            key = ("images", pixels.shape[1:]) if batched and isinstance(pixels, np.ndarray) else request_id
            groups.setdefault(key, []).append(request_id)
        return list(groups.values())

    def _encode(self, request_ids: list[str], out: RunnerOutput) -> None:
        """The vision tower and the merge for one group; the embeddings wait in their rows."""
        start = time.perf_counter()
        rows = [self.prompts[r] for r in request_ids]
        arrays = [on_device(r.prompt.arrays) for r in rows]
        if len(rows) == 1:
            embedded = [self.adapter.embed(rows[0].input_ids, arrays[0], self._features(rows[0].prompt))]
        else:
            embedded = self.adapter.embed_rows([r.input_ids for r in rows], arrays)
        mx.eval([e.inputs_embeds for e in embedded])
        for request_id, row, e in zip(request_ids, rows, embedded):
            row.embedded = e
            out.prompt_lengths[request_id] = e.inputs_embeds.shape[1]
        if rows[0].prompt.has_images:
            out.vision_seconds += time.perf_counter() - start
            out.vision_batches += len(rows) > 1

    def _encode_piece(self, piece: EncodeChunk, out: RunnerOutput) -> None:
        """Blocks ``[first, last)`` of the vision tower for the prompt's one image to encode; the piece
        through the last block also merges, exactly as ``_encode`` (the tower's own forward runs)."""
        row = self.prompts[piece.request_id]
        blocks = self.adapter.vision_blocks()
        assert blocks is not None
        last = piece.last_block if piece.last_block is not None else self.adapter.num_vision_blocks
        start = time.perf_counter()
        with tapped(*blocks, piece.first_block, last, row.vision_hidden) as tap:
            if piece.final:
                self._encode([piece.request_id], out)
                row.vision_hidden = None
                return
            self._tower(row)  # lazily: only the piece's blocks run, for the tap
        mx.eval(tap.output)
        row.vision_hidden = tap.output
        out.vision_seconds += time.perf_counter() - start

    def _tower(self, row: PromptRow) -> object:
        """The graph of the vision forward ``_encode`` would run for this prompt's one uncached image."""
        if self._caches(row.prompt):
            vision = self.caches.vision
            assert vision is not None
            (item,) = [i for i in row.prompt.images if i.key not in vision]
            return self.adapter.encode_image(on_device(item.arrays))
        return self.adapter.embed(row.input_ids, on_device(row.prompt.arrays)).inputs_embeds

    def _caches(self, prompt: PromptInputs) -> bool:
        return self.caches.vision is not None and prompt.encodes_per_image

    def _features(self, prompt: PromptInputs) -> dict[str, mx.array] | None:
        """The towers' outputs ``embed`` takes instead of running them: each image's and each clip's, computed
        alone (cached by content where the vision cache is on); None where the prompt's arrays go whole."""
        features = self._image_features(prompt.images) if self._caches(prompt) else {}
        if prompt.clips and self.adapter.encodes_clips:  # clip by clip even uncached: each in its own place
            encoded = [self._cached(item, self.adapter.encode_clip) for item in prompt.clips]
            features["cached_audio_features"] = mx.concatenate(encoded, axis=1)
        return features or None

    def _image_features(self, images: tuple[ImageItem, ...]) -> dict[str, mx.array]:
        """Each image's features from the vision cache, or from the tower (alone) and then cached."""
        assert self.caches.vision is not None
        features = [self._cached(item, self.adapter.encode_image) for item in images]
        return self.adapter.join_features(images, features)

    def _cached(self, item: ImageItem, encode: Callable[[dict[str, mx.array]], mx.array]) -> mx.array:
        vision = self.caches.vision
        cached = vision.get(item.key) if vision is not None else None
        if cached is None:
            cached = encode(on_device(item.arrays))
            mx.eval(cached)
            if vision is not None:
                vision.put(item.key, cached)
        return cached

    # -- prefill --------------------------------------------------------------------

    def _prefill(self, chunk: PrefillChunk, out: RunnerOutput) -> None:
        """One chunk of one prompt; once the prompt is in its cache, its first token, and it joins."""
        row = self.prompts[chunk.request_id]
        embedded = row.embedded
        assert embedded is not None, "prefill before encode"
        with self._prompt_states() as states:
            if chunk.first_layer or not chunk.final:
                last = chunk.last_layer if chunk.last_layer is not None else self.adapter.num_layers
                logits, row.hidden = self.adapter.prefill_layers(row.input_ids, embedded, row.cache,
                                                                 chunk.first_layer, last, row.hidden)
                if not chunk.final:
                    mx.eval(row.hidden, [c.state for c in row.cache[chunk.first_layer:last]])
                    return
            elif row.prompt_logprobs is not None:
                logits = self._prefill_scored(row, embedded, chunk)
            else:
                logits = self._prefill_tokens(row, embedded, chunk)
        hidden = self._mtp().recorded(states) if states else None
        if hidden is not None:  # the drafter's own KV: these positions, each with the prompt's next token
            row.draft = self._mtp().prefill(row.draft, row.input_ids, hidden, chunk.end)
        drafted = row.draft.arrays() if row.draft is not None else []
        if chunk.end < embedded.inputs_embeds.shape[1]:
            mx.eval([c.state for c in row.cache], drafted)
            if chunk.store_prefix:  # a snapshot at the prompt's stem: the prefill goes on in the row's own
                self._store(row, copy.deepcopy(row.cache), chunk.end, hidden[:, -1:] if hidden is not None else None)
            return
        mx.eval(logits, [c.state for c in row.cache], embedded.row_state, drafted)
        forks = [row.forks[f] for f in chunk.forks]
        firsts, sampling = self._sample_first(logits, [row], forks)
        ids = [chunk.request_id, *chunk.forks]
        if firsts is not None:
            if row.prompt_logprobs is not None:
                firsts[0] = replace(firsts[0], prompt_logprobs=tuple(row.prompt_logprobs))
            out.samples.update(zip(ids, firsts))
        if chunk.store_prefix:
            self._store(row, row.cache)
        rows = 1 + len(forks)  # n > 1: the prompt's KV and state copied into a row per fork
        row_state = {k: mx.concatenate([v] * rows) if rows > 1 else v for k, v in embedded.row_state.items()}
        inputs = self._inputs(firsts, rows)
        draft = self._enter_draft([row], [inputs])
        join = partial(self._join, ids, [merge_rows(c, rows) for c in row.cache], row_state, sampling, inputs, draft)
        if chunk.hold:  # the row waits out of the decode batch until a plan joins it
            self.prompts.pop(chunk.request_id, None)
            self.held[chunk.request_id] = join
        else:
            join()

    def _prefill_scored(self, row: PromptRow, embedded: Embedded, chunk: PrefillChunk) -> mx.array:
        """A chunk whose every position's logits are kept: each next prompt token's logprob (and the
        ``prompt_logprobs`` best alternatives) joins the row's; returns the last position's logits. A rank
        that does not sample runs the same forward and scores nothing."""
        assert row.prompt_logprobs is not None
        logits = self.adapter.prefill(row.input_ids, embedded, chunk.start, chunk.end, row.cache, every_position=True)
        targets = row.input_ids[0, chunk.start + 1:chunk.end + 1]  # the token each position predicts
        if not self.rank.samples or targets.shape[0] == 0:  # rank 0 scores; nothing follows a one-token prompt
            return logits[-1:]
        scored = logits[: targets.shape[0]].astype(mx.float32)
        scored = scored - mx.logsumexp(scored, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(scored, targets[:, None], axis=-1)[:, 0]
        ranks = (scored > chosen[:, None]).sum(axis=-1) + 1
        k = row.params.prompt_logprobs or 0
        best = mx.argpartition(-scored, kth=k - 1, axis=-1)[:, :k] if k else mx.zeros((targets.shape[0], 0), mx.int32)
        best_lp = mx.take_along_axis(scored, best, axis=-1)
        rows = zip(cast(list[int], targets.tolist()), cast(list[float], chosen.tolist()),
                   cast(list[list[int]], best.tolist()), cast(list[list[float]], best_lp.tolist()),
                   cast(list[int], ranks.tolist()))
        for token, lp, ids, lps, rank in rows:
            top = tuple(sorted(zip(ids, lps), key=lambda t: -t[1]))
            row.prompt_logprobs.append(TokenLogprob(token, lp, top, rank))
        last: mx.array = logits[-1:]
        return last

    def _prefill_tokens(self, row: PromptRow, embedded: Embedded, chunk: PrefillChunk) -> mx.array:
        start, end = chunk.start, chunk.end
        if end == embedded.inputs_embeds.shape[1] and end - start > 1 and self.adapter.can_chunk(row.prompt):
            # The last token alone, as mlx-vlm's generate_step does: the rest's logits are never
            # evaluated, so MLX never computes them (a [tokens, vocab] head is most of a short prefill).
            self.adapter.prefill(row.input_ids, embedded, start, end - 1, row.cache)
            start = end - 1
        return self.adapter.prefill(row.input_ids, embedded, start, end, row.cache)

    def _prefill_together(self, request_ids: list[str], chunks: list[PrefillChunk], out: RunnerOutput) -> None:
        """Whole prompts in one left-padded forward (the adapter's), then each one's first token."""
        rows = [self.prompts[r] for r in request_ids]
        embedded = [r.embedded for r in rows]
        assert all(e is not None for e in embedded) and len(chunks) == len(rows)
        ready = [e for e in embedded if e is not None]
        split_last = all(self.adapter.can_chunk(r.prompt) for r in rows)
        with self._prompt_states() as states:
            logits, cache = self.adapter.prefill_rows([r.input_ids for r in rows], ready, split_last)
        if states:  # left-padded: each row's positions are the last of its hidden states
            mtp = self._mtp()
            hidden = mtp.recorded(states)
            for i, r in enumerate(rows):
                r.draft = mtp.prefill(None, r.input_ids, hidden[i:i + 1, hidden.shape[1] - r.input_ids.shape[1]:],
                                      r.input_ids.shape[1])
        row_state = {k: mx.concatenate([e.row_state[k] for e in ready]) for k in ready[0].row_state}
        mx.eval(logits, [c.state for c in cache], row_state, [r.draft.arrays() for r in rows if r.draft is not None])
        firsts, sampling = self._sample_first(logits, rows)
        out.samples.update(zip(request_ids, firsts or ()))
        out.prefill_batches += 1
        for i, chunk in enumerate(chunks):
            if chunk.store_prefix:  # a row of the batch serves a later prompt as if it had been alone
                self._store(rows[i], [c.extract(request_ids.index(chunk.request_id)) for c in cache])
        inputs = self._inputs(firsts, len(rows))
        draft = self._enter_draft(rows, [[t] for t in inputs])
        self._join(request_ids, cache, row_state, sampling, inputs, draft)

    def _store(self, row: PromptRow, cache: list[Any], end: int | None = None, hidden: mx.array | None = None) -> None:
        """Keep the prompt's first ``end`` positions (None: all) in its prefix store, with the MTP drafter's
        or DFlash drafter's state of them (``hidden``: the target's at ``end - 1``, inside the prompt), or a draft
        model's KV of their text (put through it now; none for a row it does not draft for)."""
        if isinstance(self.drafter, DraftModel):
            if row.drafts:
                row.draft = self.drafter.prefill(row.draft, row.input_ids, end or row.input_ids.shape[1])
            cache = [*cache, DraftPrefix.of(row.draft if row.drafts else None, end or row.input_ids.shape[1], False, None)]
        elif isinstance(self.drafter, (MtpDrafter, DFlashDrafter)):
            waits = isinstance(self.drafter, MtpDrafter)  # its pairs need the next token
            cache = [*cache, DraftPrefix.of(row.draft, end or row.input_ids.shape[1], waits, hidden)]
        self.caches.store_prefix(row.prompt, cache, end, row.params.cache_ttl_s)

    @contextmanager
    def _prompt_states(self) -> Iterator[list[mx.array]]:
        """The final hidden states of the prompt forwards run inside, recorded for a drafter with a KV of
        its own (empty for any other)."""
        if self.drafter is None or not self.drafter.reads_prompt:
            yield []
            return
        states = self._mtp().hidden_sink({})[1]
        try:
            yield states
        finally:
            self.adapter.hidden_sink = None  # read or not, the forwards after these record nothing

    def _enter_draft(self, rows: list[PromptRow], inputs: list[list[int]]) -> DraftRows | ModelRows | None:
        """The drafter's rows for prompts joining the batch (``inputs``: each one's first tokens): a draft model's,
        or the MTP's or DFlash's from the prompts' states; None for a drafter without a KV of its own."""
        if isinstance(self.drafter, DraftModel):
            return self.drafter.enter([r.input_ids for r in rows], inputs, [r.draft for r in rows],
                                      [r.drafts for r in rows])
        if any(r.draft is not None for r in rows):
            return self._mtp().first([cast(DraftRows, r.draft) for r in rows], inputs)
        return None

    def _mtp(self) -> MtpDrafter | DFlashDrafter:
        """The drafter with a KV of its own (the MTP's or DFlash's; the same calls)."""
        assert isinstance(self.drafter, (MtpDrafter, DFlashDrafter))
        return self.drafter

    def _sample_first(self, logits: mx.array, rows: list[PromptRow], forks: list[SamplingParams] | None = None
                      ) -> tuple[list[Sample] | None, list[RowState]]:
        """Each prompt's first token (None on a rank that does not sample), and the sampling row it takes
        into the decode batch; ``forks`` (one prompt, n > 1): more rows sampled from its logits, each with
        its own sampling."""
        eos = self.loaded.eos_token_ids
        sampling = [RowState.create(r.params, r.prompt.input_ids, eos) for r in rows]
        sampling += [RowState.create(p, rows[0].prompt.input_ids, eos) for p in forks or ()]
        for row in rows:
            row.embedded, row.hidden = None, None  # the vision features are in the KV now; free them
        if not self.rank.samples:
            return None, sampling
        if forks:
            logits = mx.concatenate([logits] * len(sampling))
        sampled = sample(logits, sampling, allowed=guided.allowed(sampling, logits.shape[-1]))
        return [sampled.read(i) for i in range(len(sampling))], sampling

    @staticmethod
    def _inputs(firsts: list[Sample] | None, rows: int) -> list[int]:
        """The rows' first decode inputs: their first tokens, or stand-ins on a rank that does not sample
        (rank 0 sends each decode step's inputs)."""
        return [s.token_id for s in firsts] if firsts is not None else [0] * rows

    def _join(self, request_ids: list[str], cache: list[Any], row_state: dict[str, mx.array],
              sampling: list[RowState], inputs: list[int], draft: DraftRows | ModelRows | None = None) -> None:
        """Prefilled prompts become the decode batch's last rows, each with its first input."""
        for request_id in request_ids:
            self.prompts.pop(request_id, None)  # a fork (n > 1) had no prompt row of its own
        if self.adapter.kv_quant is not None and self.batch.cache is not None:
            self.adapter.kv_quant.align(self.batch.cache, cache)  # a batch's rows share one precision per layer
        self.batch.extend(request_ids, cache, row_state, sampling, inputs, draft)

    # -- decode ---------------------------------------------------------------------

    def decode(self, errors: dict[str, str]) -> dict[str, Sample]:
        """Dispatch one decode step for every row (``mx.async_eval``), then read the step before it.

        As mlx-lm's generators do: the next step's graph is built and queued before the host waits
        for the previous one. The samples returned are the rows' tokens from the previous step; a
        row that just joined has none yet (its first token went out with its prefill). A row whose
        grammar refuses the token it is fed lands in ``errors``. A rank that does not sample runs the
        forward and returns none.
        """
        batch = self.batch
        assert batch.cache is not None and batch.tokens is not None
        if guided.guided(batch.sampling):  # the grammars need this step's inputs now: no pipelining
            refused = guided.consume(batch.sampling, cast(list[int], batch.tokens.tolist()))
            errors.update({batch.request_ids[i]: why for i, why in refused.items()})
        row_state, sink = batch.row_state, None
        if self.drafter is not None:  # the drafter's next input: each row's hidden state at this position
            row_state, sink = self.drafter.hidden_sink(row_state)
        logits = self.adapter.decode(batch.tokens[:, None], batch.cache, row_state)
        self.adapter.settle(batch.cache)
        if not self.rank.samples:  # rank 0 sends the next step's inputs
            mx.eval(logits)
            return {}
        step = sample(logits, batch.sampling, batch.tokens, guided.allowed(batch.sampling, logits.shape[-1]))
        if self.drafter is not None and sink:
            self.drafter.after_decode(batch, step.tokens, self.drafter.recorded(sink))
        mx.async_eval(*step.arrays())  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated
        return batch.advance(step)

    def _verify(self, plan: SchedulerOutput, out: RunnerOutput) -> None:
        """Decode with drafts: every row's input and draft in one forward, read at once (engine/verify.py).
        The drafter's rows draft once their inputs are read. Where no draft is left then (every guess
        was wrong, or no drafter row has a hidden state yet), a plain decode step."""
        step = read_drafts(self.batch, plan.drafts)
        if plan.draft_widths and self.drafter is not None:
            start = time.perf_counter()
            out.draft_tokens = self._draft(step, plan.draft_widths)
            out.draft_seconds = time.perf_counter() - start
        out.verified.update(dict.fromkeys(step.missed, (1, 0)))
        if not any(step.rows):
            out.samples.update(step.earlier)
            out.samples.update(self.decode(out.errors))
            out.unread.update(self.batch.request_ids)
            return
        verified = verify(self.adapter, self.batch, step, out.errors, self.drafter)
        if self.batch.cache is not None:
            self.adapter.settle(self.batch.cache)
        for request_id, picked in verified.samples.items():
            tokens = [*([step.earlier[request_id]] if request_id in step.earlier else []), *picked]
            out.samples[request_id], out.more[request_id] = tokens[0], tokens[1:]
        out.verified.update(verified.counts)

    def _draft(self, step: StepDrafts, widths: dict[str, int]) -> int:
        """The drafter's drafts for its rows (those with a width and no other draft), into ``step``;
        returns how many tokens it proposed."""
        assert self.drafter is not None
        batch = self.batch
        rows = [i for i, rid in enumerate(batch.request_ids) if widths.get(rid) and not step.rows[i]]
        if not rows:
            return 0
        k = max(widths[batch.request_ids[i]] for i in rows)
        drafts = self.drafter.draft(batch, rows, step.inputs, k)
        for i, draft in drafts.items():
            step.rows[i] = draft[:widths[batch.request_ids[i]]]
        return len(drafts) * k

    def remove(self, request_ids: Iterable[str]) -> None:
        """Drop finished or aborted requests, prefilling or decoding, and free their KV."""
        ids = list(request_ids)
        for request_id in ids:
            self.prompts.pop(request_id, None)
            self.held.pop(request_id, None)
            self.caches.drop_prefix(request_id)  # one that ended before it entered
        self.batch.remove(ids)


def on_device(arrays: Mapping[str, HostArray]) -> dict[str, Any]:
    """Phase 1's numpy arrays as ``mx.array``s (a tuple, one array per image, as a list of them)."""
    return {k: [mx.array(a) for a in v] if isinstance(v, tuple) else mx.array(v) for k, v in arrays.items()}
