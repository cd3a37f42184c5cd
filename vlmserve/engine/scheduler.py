"""[worker] The scheduler decides: who is admitted, what each request runs this step, and what the
step's results mean for each request's state.

Every step is planned and bounded, so a running stream never freezes when new prompts arrive:
- every running request that finished its prompt decodes one token;
- new prompts' images are encoded under a per-step encoder budget (vLLM v1's encoder budget), in
  admission order; an image already in the vision cache costs nothing;
- prompt tokens share a per-step token budget (vLLM's ``num_scheduled_tokens``). A prompt that
  cannot be split by tokens (an image span attending both ways) is split by layers instead: a few
  of the language model's layers per step, as many as its share of the budget pays for, its hidden
  state carried to the next step. One such prompt at a time. The budget grows with how long the
  oldest prompt has waited, up to a bound (engine/costs.py): a backlog goes in fewer, longer steps;
- the join gate: a prompt that ends while others are still in their prompts sends its first token
  and keeps its row out of the decode batch until they end (or for a bounded time), so that a burst's
  prompts are not slowed by each other's decoding: every first token comes before the burst's second
  ones, as when a server prefills them all in one step, while the streams already running decode on.
A stream is kept from freezing by the prompts that arrive after its first token. Prompts that were
ready before it (a burst that arrived together, the first of which already decodes) are its cohort:
they go at the full ``prefill_chunk``, as they would have had none of them started, so a burst
is served as one batch and its slots decode together instead of one prompt at a time.
Per-step admission: every step admits waiting requests into free batch slots while the KV budget
holds them, so a new request starts within one step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from vlmserve.engine.costs import FLOOR_TOKENS
from vlmserve.engine.memory import KVBudget
from vlmserve.engine.params import pixel_count
from vlmserve.engine.plan import EncodeChunk, NewRequest, PrefillChunk, RunnerOutput, Sample, SchedulerOutput
from vlmserve.engine.request import Request, RequestStatus
from vlmserve.engine.speculative import DraftPolicy, SpeculativeConfig, follow_prediction, lookup
from vlmserve.inputs import PromptInputs

SCORED_CHUNK = 128  # prompt tokens a step for a prompt whose logprobs are asked: its logits are [n, vocab]
# The join gate: a held row waits at most this many times its own time to first token
HOLD_LIMIT = 8.0


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_batch_size: int
    prefill_chunk: int  # prompt tokens per step, over all prefilling requests, while nothing decodes
    # While requests decode: prompt tokens per step (None: ``prefill_chunk``; the engine sizes it
    # from measured costs, engine/costs.py) and images encoded per step (the first always goes).
    stream_prefill_chunk: int | None = None
    encoder_budget: int = 1
    num_layers: int = 1  # the language model's; a prompt split by layers runs a share of them per step
    layer_starts: tuple[int, ...] | None = None  # where a layer piece may start; None: at any layer
    vision_blocks: int = 0  # the vision tower's blocks, where one image may go a few a step (0: whole)
    reuses_prefix: bool = True  # may a cached text prefix's KV serve a longer prompt (the adapter says)
    # The cache cannot be cut back (recurrent state): a prompt's prefix is stored as a snapshot at its
    # stem (before the generation prompt, what the next turn repeats), not at its end.
    snapshots: bool = False
    # Speculative decoding: ngram drafts with this config (None: off), and whether the runner verifies
    # drafts at all (a request's prediction is a draft on any server that does)
    speculative: SpeculativeConfig | None = None
    verifies: bool = True
    # The join gate: a prompt that ends while others are in their prompts keeps its row out of the decode
    # batch until they end (off across pipeline ranks, which join as rank 0's plan says)
    holds_rows: bool = True


class CacheBook(Protocol):
    """What the scheduler asks the caches (engine/caches.py): it decides, they keep the arrays."""

    def reuses(self, prompt: PromptInputs) -> bool: ...  # is its prefix stored (reserve_prefix may find one anyway)

    def reserve_prefix(self, request_id: str, prompt: PromptInputs) -> int: ...

    def drop_prefix(self, request_id: str) -> None: ...

    def uncached_images(self, prompt: PromptInputs) -> tuple[int, int]: ...

    def held_bytes(self) -> int: ...

    def release(self, n_bytes: int) -> None: ...


@dataclass(slots=True, frozen=True)
class RequestUpdate:
    """What one step did to one request: the token it kept (if any) and how it ended (if it did)."""

    request: Request
    token_id: int | None = None
    finish: RequestStatus | None = None
    error: str | None = None
    sample: Sample | None = None  # what the runner gave for the token (its logprobs)


@dataclass(slots=True)
class _Budgets:
    """What is left of one step's prompt work, in prompt tokens' time. Prompts that came with every
    decoding stream (ready before its first token) share the full budget; from the first prompt that
    arrived after some stream's first token on, the step is bounded: what is left is capped at the
    stream budget less what the step spent already, and images go ``images`` at most."""

    tokens: int
    bound: int  # the step's prompt work while a stream decodes that it must not freeze
    since: float  # the earliest first token of a decoding stream: prompts that arrived after it are bounded
    images: int
    layer_split_busy: bool = False  # a prompt is part-way through its layers
    spent: int = 0
    bounded: bool = False
    prefill: list[PrefillChunk] = field(default_factory=list)

    def bounds(self, req: Request) -> bool:
        """Before planning ``req``'s work: whether the step is bounded from here on."""
        if not self.bounded and req.arrival_time > self.since:
            self.bounded = True
            self.tokens = min(self.tokens, self.bound - self.spent)
        return self.bounded

    def spend(self, tokens: int) -> None:
        self.tokens -= tokens
        self.spent += tokens


def kv_need(req: Request) -> int:
    """The positions a request may fill: its prompt and every token it may generate."""
    return min(req.num_prompt_tokens + req.params.max_tokens, req.max_context)


class Scheduler:
    def __init__(self, config: SchedulerConfig, budget: KVBudget | None = None, caches: CacheBook | None = None) -> None:
        self.config = config
        self.budget = budget or KVBudget(None)
        self.caches = caches
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: encoding, prefilling or decoding, in admission order
        self._by_id: dict[str, Request] = {}  # the running ones, by id (a step looks each of them up)
        self._finished: list[str] = []  # ended since the last plan: the runner frees them next step
        self.stream_tokens = config.stream_prefill_chunk or config.prefill_chunk
        self.pixel_tokens = 0.0  # what the tower costs per pixel value, in prompt tokens' time (measured)
        # How wide each step's verify goes (measured costs, set by the engine); None: drafts are never verified
        self.drafts = DraftPolicy(config.speculative or SpeculativeConfig()) if config.verifies else None

    def add(self, req: Request) -> None:
        assert req.status is RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished(self) -> bool:
        """Whether requests ended that the runner still holds (the next plan frees them)."""
        return bool(self._finished)

    def take_finished(self) -> list[str]:
        finished, self._finished = self._finished, []
        return finished

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id) or next((r for r in self.waiting if r.request_id == request_id), None)

    @property
    def kv_reserved_bytes(self) -> int:
        return self.budget.batch_bytes([kv_need(r) for r in self.running])

    # -- planning -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Admit, then plan the step: text prompts embed and prefill at once; prompts already embedded
        prefill in admission order; image prompts encode with what is left. A stream is kept from
        freezing only by the prompts that arrived after its first token: its work fits the stream
        budget, so the step stays short. Prompts that arrived with it (before any decoding stream's
        first token: a burst, or an idle engine) go as fast as ``prefill_chunk`` allows, as they would
        have had none of them started yet."""
        out = SchedulerOutput(finished=self.take_finished())
        out.new = self._admit()
        out.join = self._release_held()
        decoding = [r for r in self.running if r.encoded and r.prefill_done and not r.held]
        out.decode = [r.request_id for r in decoding]
        out.drafts, out.draft_widths = self._plan_drafts(decoding)
        since = min((r.first_token_time or math.inf for r in decoding), default=math.inf)
        text = [EncodeChunk(r.request_id) for r in self.running
                if not r.encoded and not r.num_images and r.fork_of is None]
        budgets = _Budgets(self.config.prefill_chunk, min(self.stream_tokens, self.config.prefill_chunk), since,
                           self.config.encoder_budget, any(r.num_computed_layers for r in self.running))
        self._plan_prefill(budgets, {c.request_id for c in text})
        images, out.encode_pixels = self._plan_encode(budgets)
        out.prefill_groups = self._groups(budgets.prefill)
        grouped = {r for g in out.prefill_groups for r in g}  # a shared forward's rows join together
        out.encode = text + images
        out.prefill = [replace(c, hold=False) if c.request_id in grouped else c for c in budgets.prefill]
        return out

    def _prompting(self, req: Request) -> bool:
        """Whether ``req`` is admitted and still in its prompt (a fork waits with its parent)."""
        return not req.prefill_done and req.fork_of is None

    def _release_held(self) -> list[str]:
        """The join gate. A prompt that ended while others were in their prompts sent its first token, and
        its row waits out of the decode batch: every step it would decode makes theirs longer. It joins once
        no prompt that arrived before its first token is still in its prompt, or once it has waited
        ``HOLD_LIMIT`` times its own time to first token (a long prompt behind it does not hold it long).
        So a burst's prompts get their first tokens first (as a server that prefills them all in one step
        gives them), while the streams that were running go on decoding."""
        now = time.monotonic()
        joined = []
        for req in self.running:
            if not req.held or req.first_token_time is None:
                continue
            waited = now - req.first_token_time
            ahead = any(self._prompting(r) and r.arrival_time <= req.first_token_time for r in self.running)
            if not ahead or waited > HOLD_LIMIT * max(req.first_token_time - req.arrival_time, 0.0):
                req.held = False
                joined.append(req.request_id)
        return joined

    def _holds(self, req: Request) -> bool:
        """Whether ``req``'s row is held when its prompt ends this step: others are still in their prompts."""
        return self.config.holds_rows and not req.live_forks and \
            any(self._prompting(r) and r is not req for r in self.running)

    def longest_wait(self, now: float) -> float:
        """How long the oldest admitted prompt still in its prompt has waited since it arrived (0: none)."""
        return max((now - r.arrival_time for r in self.running if self._prompting(r)), default=0.0)

    def _plan_drafts(self, decoding: list[Request]) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """Each decoding row's draft this step, all cut to the width the policy finds pays (maybe none):
        the drafts the scheduler knows, and how many tokens the drafter model proposes for its rows."""
        if self.drafts is None:
            return {}, {}
        # Without a method only predictions draft: most steps have none to look at
        drafting = decoding if self.config.speculative is not None else [r for r in decoding if r.params.prediction]
        proposed = {r.request_id: (r, d) for r in drafting if (d := self._propose(r))}
        if not proposed:
            return {}, {}
        lengths = [d if isinstance(d, int) else len(d) - r.unread for r, d in proposed.values()]
        modelled = sum(isinstance(d, int) for _, d in proposed.values())
        width = self.drafts.width([r.acceptance.rate for r, _ in proposed.values()], lengths, len(decoding), modelled)
        if width == 0:
            return {}, {}
        drafts = {rid: tuple(d[:width + r.unread]) for rid, (r, d) in proposed.items()
                  if isinstance(d, list) and len(d) > r.unread}
        return drafts, {rid: min(d, width) for rid, (_, d) in proposed.items() if isinstance(d, int)}

    def _propose(self, req: Request) -> list[int] | int:
        """``req``'s draft: its prediction's next tokens, else (ngram on) a prompt lookup, else (a
        drafter model) how many tokens the drafter is to propose. Where its newest token is still
        computing, a known draft has one more token first: the guess at that one (the drafter drafts
        once the runner has read it)."""
        assert self.drafts is not None
        p, config = req.params, self.config.speculative
        k = self.drafts.config.num_speculative_tokens  # the server's, or the default for predictions
        done = len(req.output_token_ids) + req.unread
        room = min(p.max_tokens - done, req.max_context - req.num_prompt_tokens - done) - 1
        k = min(k, room) + req.unread
        # Penalties look at each token before it, and a row under min_tokens rules its stop tokens out
        # by its count of tokens made (sampler.RowState.made): no drafts for either
        if k <= req.unread or p.needs_history or done < p.min_tokens:
            return []
        req.drafts_from_prediction = bool(p.prediction)
        if p.prediction:
            draft = follow_prediction(p.prediction, req.output_token_ids, k, 8)
            if draft or config is None:
                return draft
            req.drafts_from_prediction = False
        if config is None:
            return []
        if config.drafter:
            return k - req.unread if req.modelled else []
        known = [*req.prompt.input_ids, *req.output_token_ids]
        return lookup(known, k, config.prompt_lookup_min, config.prompt_lookup_max)

    def _plan_prefill(self, budgets: _Budgets, embedding_now: set[str]) -> None:
        """Prompt pieces in admission order while the budget lasts: of the prompts already embedded,
        and of the text prompts embedded in this same step."""
        for req in self.running:
            if req.prefill_done or not (req.encoded or req.request_id in embedding_now):
                continue
            chunk = self._chunk(req, budgets)
            if chunk is None:
                break  # first come, first served: nobody overtakes a prompt that did not fit
            budgets.prefill.append(chunk)
            if budgets.tokens <= 0:
                break

    def _admit(self) -> list[NewRequest]:
        """Move waiting requests into free batch slots while the KV budget holds them; a request with
        forks (n > 1) comes in with them, a slot each. Each looks up its cached prefix as it is admitted,
        before a later admission may make room by dropping cached prefixes."""
        admitted = []
        while self.waiting:
            group = [self.waiting[0], *self.waiting[0].live_forks]
            if len(self.running) + len(group) > self.config.max_batch_size:
                break
            if not self._make_room([kv_need(r) for r in (*self.running, *group)]):
                break  # first come, first served: the head waits for memory, nobody overtakes it
            self.waiting.popleft()
            for req in group:
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._by_id[req.request_id] = req
            admitted.append(self._enter(group[0]))
        return admitted

    def _make_room(self, needs: list[int]) -> bool:
        """Whether a batch with these needs fits the KV budget; the prefix stores count against it too,
        and give way (least recently used first) to a batch that fits without them."""
        if not self.budget.fits(needs):
            return False
        self._within_budget(self.budget.batch_bytes(needs))
        return True

    def _within_budget(self, reserved: int) -> None:
        """Shrink the prefix stores until they and ``reserved`` fit the KV budget."""
        limit = self.budget.limit_bytes
        if limit is not None and self.caches is not None:
            over = reserved + self.caches.held_bytes() - limit
            if over > 0:
                self.caches.release(over)

    def _enter(self, req: Request) -> NewRequest:
        cached = 0
        if self._may_reuse(req) and self.caches is not None:
            cached = self.caches.reserve_prefix(req.request_id, req.prompt)
            if cached and self._rules_out_layers(req, cached):
                self.caches.drop_prefix(req.request_id)
                cached = 0
        req.num_computed_tokens = req.num_cached_tokens = cached
        if cached and req.text_tail is not None and cached >= req.text_tail:
            req.chunkable = True  # what is left is causal text (Gemma's new turn): it goes by tokens
        forks = tuple((f.request_id, f.params) for f in req.forks)
        req.modelled = self._pays_prefill(req, cached)
        for fork in req.forks:
            fork.modelled = req.modelled
        return NewRequest(req.request_id, req.prompt, req.params, cached, forks, req.modelled)

    def _pays_prefill(self, req: Request, cached: int) -> bool:
        """Whether a draft model is to draft for ``req``: the prompt tokens it would prefill (those no prefix
        holds) can pay back over the tokens ``req`` may make (engine/speculative.py)."""
        spec = self.config.speculative
        if self.drafts is None or spec is None or spec.method != "draft_model":
            return True
        room = min(req.params.max_tokens, req.max_context - req.num_prompt_tokens)
        return self.drafts.pays_prefill(req.num_prompt_tokens - cached, room)

    def _rules_out_layers(self, req: Request, cached: int) -> bool:
        """Whether a reused prefix of ``cached`` tokens costs more than it saves. A prompt that cannot be split
        by tokens goes by layers only from position 0; after a prefix, the rest runs whole in one step however
        long, and the streams decoding freeze for it. A prefix within a step's prompt floor (a chat template's
        opening before an image) is cheaper to compute again than that step, where a stream decodes and the
        rest is over its step's budget."""
        causal_rest = req.text_tail is not None and cached >= req.text_tail  # then it goes by tokens
        decoding = any(r.prefill_done for r in self.running if r is not req)
        over = req.num_prompt_tokens - cached > min(self.stream_tokens, self.config.prefill_chunk)
        return not req.chunkable and not causal_rest and self.config.num_layers > 1 and cached <= FLOOR_TOKENS \
            and decoding and over

    def _may_reuse(self, req: Request) -> bool:
        """May a cached prefix serve ``req``? The caches say which and how much (a prompt with images: the
        text before its first image, or more only through the image-keyed cache, caches.py)."""
        scored = req.params.prompt_logprobs is not None  # every position's logits are computed: none reused
        return self.caches is not None and self.config.reuses_prefix and not scored

    def _prefix_cacheable(self, req: Request) -> bool:
        """Is ``req``'s prefix stored? A prompt with pixel_values only in the opt-in image-keyed cache, whose
        key holds every image's content hash: same tokens, different image, no match (caches.py)."""
        return self._may_reuse(req) and self.caches is not None and self.caches.reuses(req.prompt)

    def _plan_encode(self, budgets: _Budgets) -> tuple[list[EncodeChunk], float]:
        """Image prompts to embed this step, in admission order: all of those the step is not bounded
        for, then, bounded, while its images and tokens (their time, in prompt tokens) last. The step's
        first work always goes, whatever it costs; one image may go a few tower blocks a step where the
        family allows it. Cached images cost nothing. Returns the chunks and the pixel values they put
        through the tower (a piece: its share of the blocks), for the engine's cost average."""
        planned: list[EncodeChunk] = []
        through = 0.0
        for req in self.running:
            if req.encoded or not req.num_images or req.fork_of is not None:
                continue
            images, pixels = self._encode_need(req)
            first = not (planned or budgets.prefill)
            if not budgets.bounds(req):
                chunk = EncodeChunk(req.request_id)
            else:
                tokens = budgets.tokens if not first else max(budgets.tokens, 1)
                chunk = self._encode_chunk(req, images, pixels, tokens)
                if images and not first and (images > budgets.images or self._chunk_cost(chunk, pixels) > tokens):
                    break  # nobody overtakes it
            planned.append(chunk)
            through += pixels * self._block_share(chunk)
            budgets.spend(self._chunk_cost(chunk, pixels))
            budgets.images -= images
            if not chunk.whole:
                budgets.images = budgets.tokens = 0  # a piece takes the rest of the step
        return planned, through

    def _encode_chunk(self, req: Request, images: int, pixels: int, tokens: int) -> EncodeChunk:
        """A whole encode, or the next tower blocks of a prompt's one uncached image that ``tokens`` pay for."""
        blocks = self.config.vision_blocks
        if images != 1 or blocks < 2:
            return EncodeChunk(req.request_id)
        first = req.num_encoded_blocks
        cost = pixels * self.pixel_tokens
        pays = int(max(tokens, 0) * blocks // cost) if cost > 0 else 1  # unmeasured: a block a step
        last = min(blocks, first + max(1, pays))
        return EncodeChunk(req.request_id, first, None if last >= blocks else last)

    def _chunk_cost(self, chunk: EncodeChunk, pixels: int) -> int:
        """An encode's time in prompt tokens: its pixels' share of the blocks it runs."""
        return math.ceil(pixels * self.pixel_tokens * self._block_share(chunk))

    def _block_share(self, chunk: EncodeChunk) -> float:
        blocks = max(self.config.vision_blocks, 1)
        return 1.0 if chunk.whole else ((chunk.last_block or blocks) - chunk.first_block) / blocks

    def _encode_need(self, req: Request) -> tuple[int, int]:
        """Images of ``req`` that need the tower, and their pixel values."""
        if not req.num_images:
            return 0, 0
        if self.caches is not None:
            return self.caches.uncached_images(req.prompt)
        return req.num_images, pixel_count(req.prompt.arrays)

    def _chunk(self, req: Request, budgets: _Budgets) -> PrefillChunk | None:
        """What of ``req``'s prompt runs this step within what is left of the token budget."""
        start, end = req.num_computed_tokens, req.num_prompt_tokens
        first = not budgets.prefill
        budgets.bounds(req)
        if req.chunkable:
            n = min(end - start, max(budgets.tokens, 0))
            if req.params.prompt_logprobs is not None:  # logits for every position: [n, vocab] floats
                n = min(n, SCORED_CHUNK)
            stem = self._stem(req)
            if stem is not None and start + n > stem:
                n = stem - start  # the chunk ends where the snapshot is taken
            budgets.spend(n)
            return self._tokens_chunk(req, start, start + n) if n > 0 else None
        scored = req.params.prompt_logprobs is not None  # every position's logits: no layer pieces
        if not req.num_computed_layers and (end - start <= budgets.tokens or ((start or scored) and first)):
            budgets.spend(end - start)  # whole; after a reused prefix, layer pieces cannot start
            return self._tokens_chunk(req, start, end)  # (no snapshot: a whole prompt's end is not its stem)
        if start:
            return None
        if budgets.layer_split_busy and not req.num_computed_layers:
            return None  # one prompt goes by layers at a time
        layers = self._layers(req, end - start, budgets.tokens, first)
        if layers is None:
            return None
        budgets.layer_split_busy = True
        budgets.spend(-(-(end - start) * (layers[1] - layers[0]) // self.config.num_layers))
        last = None if layers[1] >= self.config.num_layers else layers[1]
        stores = self._stores(req, end, last is None and self._prefix_cacheable(req) and not self.config.snapshots)
        return PrefillChunk(req.request_id, start, end, layers[0], last, store_prefix=stores,
                            forks=self._forks(req) if last is None else (), hold=last is None and self._holds(req))

    def _tokens_chunk(self, req: Request, start: int, end: int) -> PrefillChunk:
        ends = end == req.num_prompt_tokens
        stores = end == self._stem(req) if self.config.snapshots else ends and self._prefix_cacheable(req)
        return PrefillChunk(req.request_id, start, end, store_prefix=self._stores(req, end, stores),
                            forks=self._forks(req) if ends else (), hold=ends and self._holds(req))

    @staticmethod
    def _stores(req: Request, end: int, stores: bool) -> bool:
        """Whether the chunk ending at ``end`` stores ``req``'s prefix; if so, how far, on the request (what
        it newly wrote to the cache is reported: Anthropic's cache_creation_input_tokens)."""
        if stores:
            req.num_stored_tokens = min(end, len(req.prompt))
        return stores

    def _stem(self, req: Request) -> int | None:
        """Where the snapshot of ``req``'s cache is taken, if one is still to be (``snapshots``): its
        stem (its end, at most), when the prompt may reuse and keep prefixes and the stem lies ahead of
        what is computed."""
        stem = req.prompt.stem
        if not self.config.snapshots or stem is None or req.num_prompt_tokens != len(req.prompt):
            return None
        return stem if req.num_computed_tokens < stem <= req.num_prompt_tokens and self._prefix_cacheable(req) else None

    @staticmethod
    def _forks(req: Request) -> tuple[str, ...]:
        return tuple(f.request_id for f in req.live_forks)

    def _layers(self, req: Request, length: int, tokens: int, first: bool) -> tuple[int, int] | None:
        """The layers ``[a, b)`` a prompt of ``length`` positions runs for ``tokens`` of budget: each
        layer costs ``length / num_layers``. None if not even one layer fits and others ran first."""
        n = self.config.num_layers
        a = req.num_computed_layers
        b = min(n, a + max(tokens, 0) * n // max(length, 1))
        starts = [s for s in (self.config.layer_starts or range(n)) if s > a] + [n]
        fits = [s for s in starts if s <= b]
        if fits:
            return a, fits[-1]
        return (a, starts[0]) if first else None  # a piece must end where the next one may start

    def _groups(self, chunks: list[PrefillChunk]) -> list[list[str]]:
        """Whole prompts starting this step that may share one left-padded forward."""
        whole = []
        for chunk in chunks:
            req = self._by_id.get(chunk.request_id)
            if req is not None and req.batchable and chunk.start == 0 and chunk.final and chunk.first_layer == 0 \
                    and chunk.end == req.num_prompt_tokens and not chunk.forks:
                whole.append(chunk.request_id)
        return [whole] if len(whole) > 1 else []

    # -- results --------------------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, output: RunnerOutput) -> list[RequestUpdate]:
        """Apply one step: embeddings made, prompt progress, each sampled token, failures."""
        updates = []
        for piece in plan.encode:
            req = self._by_id.get(piece.request_id)
            if req is not None and piece.request_id not in output.errors:
                req.encoded, req.num_encoded_blocks = piece.final, piece.last_block or 0
                req.num_prompt_tokens = output.prompt_lengths.get(piece.request_id, req.num_prompt_tokens)
        for chunk in plan.prefill:
            req = self._by_id.get(chunk.request_id)
            if req is not None and chunk.request_id not in output.errors:
                req.num_computed_layers = 0 if chunk.final else chunk.last_layer or 0
                req.num_computed_tokens = chunk.end if chunk.final else req.num_computed_tokens
                for fork in (self._by_id.get(f) for f in chunk.forks):
                    if fork is not None and fork.request_id in output.samples:  # a row of its own now
                        fork.encoded, fork.num_prompt_tokens = True, req.num_prompt_tokens
                        fork.num_computed_tokens, fork.num_cached_tokens = req.num_prompt_tokens, req.num_cached_tokens
        touched = [*plan.encode_ids, *plan.decode, *(r for c in plan.prefill for r in (c.request_id, *c.forks))]
        held = {c.request_id for c in plan.prefill if c.hold}
        now = time.monotonic()
        for request_id in dict.fromkeys(touched):
            req = self._by_id.get(request_id)
            if req is None:
                continue
            if request_id in output.errors:
                for fork in [req, *req.live_forks]:  # forks not forked yet: their prompt failed too
                    self.finish(fork, RequestStatus.FINISHED_ERROR)
                    updates.append(RequestUpdate(fork, finish=fork.status, error=output.errors[request_id]))
            elif (sample := output.samples.get(request_id)) is not None:
                req.first_token_time = req.first_token_time or now
                updates += self._take_all(req, [sample, *output.more.get(request_id, ())])
                req.held = request_id in held and not req.status.finished
            if request_id in output.verified:
                req.acceptance.record(*output.verified[request_id], req.drafts_from_prediction)
            req.unread = request_id in output.unread
        if any(c.store_prefix for c in plan.prefill):
            self._within_budget(self.kv_reserved_bytes)  # a prefix was stored: the stores grew
        return updates

    def _take_all(self, req: Request, samples: list[Sample]) -> list[RequestUpdate]:
        """The step's tokens for ``req``, in order, up to the one that ends it (a verified draft may
        run past its end: the rest is dropped)."""
        updates = []
        for sample in samples:
            updates.append(self._take(req, sample))
            if req.status.finished:
                break
        return updates

    def _take(self, req: Request, sample: Sample) -> RequestUpdate:
        token = sample.token_id
        status = req.append_token(token)
        if status is not None:
            self.finish(req, status)
        kept = None if status is RequestStatus.FINISHED_STOPPED else token  # a stop token is not output
        return RequestUpdate(req, kept, status, sample=sample)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of the scheduler for good (done, aborted or failed); the runner frees
        what it holds of it at the next step."""
        assert status.finished
        if req.status is RequestStatus.WAITING and req.fork_of is None:  # a fork waits with its parent
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            del self._by_id[req.request_id]
            self._finished.append(req.request_id)
        req.status = status

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
