"""[worker] The contract between the scheduler and the runner: one step's plan and what running it gave.

The scheduler writes a ``SchedulerOutput`` naming everything the step does (vLLM v1's shape): the
requests that enter the runner, the images to encode, the prompt chunks to prefill (and which share
a forward), the rows that decode, and the requests to forget. ``ModelRunner.execute`` runs exactly
that and answers with a ``RunnerOutput``: sampled tokens, and an error for each request a part of
the step failed (a fault, a grammar refusal). No MLX here: the scheduler and its tests use it as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmserve.engine.params import SamplingParams
from vlmserve.inputs import PromptInputs


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + the tokens more likely than it (prompt positions, as vLLM reports them)


@dataclass(slots=True, frozen=True)
class Sample:
    """One row's sampled token, with its logprobs when the request asked for them."""

    token_id: int
    logprob: TokenLogprob | None = None
    # With a prompt's first token, when it asked: each prompt position's logprob (the first None)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(slots=True, frozen=True)
class NewRequest:
    """A request entering the runner. Where ``num_cached`` > 0, a cached prefix covers its first
    ``num_cached`` prompt tokens: the caches hold its private copy under the request's id until the runner
    takes it (``EngineCaches.take_prefix``); the plan carries ids and counts, never arrays."""

    request_id: str
    prompt: PromptInputs
    params: SamplingParams
    num_cached: int = 0
    forks: tuple[tuple[str, SamplingParams], ...] = ()  # n > 1: rows forked from it when its prefill ends
    drafts: bool = True  # a draft model drafts for its rows (False: its prefill would not pay, DraftPolicy)


@dataclass(slots=True, frozen=True)
class EncodeChunk:
    """Embed one prompt: its images through the vision tower, then the merge into its embeddings.
    One image may go a few of the tower's blocks per step, ``[first_block, last_block)``; the
    piece that reaches the last block also merges."""

    request_id: str
    first_block: int = 0
    last_block: int | None = None  # None: through the last block, then the merge

    @property
    def final(self) -> bool:
        return self.last_block is None

    @property
    def whole(self) -> bool:
        return self.first_block == 0 and self.last_block is None


@dataclass(slots=True, frozen=True)
class PrefillChunk:
    """Prompt positions ``[start, end)`` of one request through the language model's layers
    ``[first_layer, last_layer)``. A prompt split by tokens runs every layer per chunk; one that
    cannot be (an image span attending both ways) runs whole, a few layers per step."""

    request_id: str
    start: int
    end: int
    first_layer: int = 0
    last_layer: int | None = None  # None: through the last layer
    # The cache as it is after this chunk goes into the prefix cache: at the prompt's end, or at its
    # stem (a snapshot, for caches that cannot be cut back: SchedulerConfig.snapshots)
    store_prefix: bool = False
    forks: tuple[str, ...] = ()  # the prompt ends here: these requests fork from it (n > 1)
    # The prompt ends here while others are still in their prompts: its first token goes out, and its
    # row waits out of the decode batch until a plan's ``join`` names it (the scheduler's join gate)
    hold: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def final(self) -> bool:
        """Whether the chunk leaves these positions in the KV cache (through the last layer)."""
        return self.last_layer is None


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. Lists keep admission order; the runner executes them in the order
    forget -> enter -> encode -> join -> decode -> prefill."""

    new: list[NewRequest] = field(default_factory=list)
    encode: list[EncodeChunk] = field(default_factory=list)  # vision tower (or the vision cache) and merge
    decode: list[str] = field(default_factory=list)  # one token each, more where a draft is verified
    # Speculative decoding: decode rows' draft tokens, verified in the step's one forward. They continue
    # the tokens the scheduler knows; where a row's newest token was still computing when the step was
    # planned (pipelined decode), the first draft token is a guess at it (engine/speculative.py).
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Decode rows whose draft the drafter model proposes on the worker (engine/drafter.py): how many tokens
    draft_widths: dict[str, int] = field(default_factory=dict)
    prefill: list[PrefillChunk] = field(default_factory=list)
    # Whole prompts that share one left-padded forward (two or more each); other chunks run alone.
    prefill_groups: list[list[str]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # ended since the last step: free their state
    join: list[str] = field(default_factory=list)  # held rows (a chunk's ``hold``) that join the decode batch now
    encode_pixels: float = 0.0  # pixel values the encodes put through the tower (a piece: its blocks' share)

    @property
    def empty(self) -> bool:
        return not (self.encode or self.decode or self.prefill)

    @property
    def encode_ids(self) -> list[str]:
        return [c.request_id for c in self.encode]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Tokens per request this step (vLLM's name): one per decode row, its chunk per prompt."""
        decode = {r: 1 + len(self.drafts.get(r, ())) + self.draft_widths.get(r, 0) for r in self.decode}
        return {**decode, **{c.request_id: c.num_tokens for c in self.prefill}}


@dataclass(slots=True)
class RunnerOutput:
    """What running one plan gave: a token for each decode row whose token is ready and each prompt
    that ended; the positions each newly embedded prompt fills; and, per request, the error a part
    of the step ended it with. A failed request has no token."""

    samples: dict[str, Sample] = field(default_factory=dict)
    prompt_lengths: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    vision_seconds: float = 0.0  # spent embedding image prompts: vision tower (or the vision cache) and merge
    vision_batches: int = 0  # vision forwards shared by several image prompts
    prefill_batches: int = 0  # forwards that prefilled several whole prompts together
    faults: int = 0  # parts of the step that raised
    # A verified draft's further tokens, after ``samples``' one: the accepted drafts and the target's next
    more: dict[str, list[Sample]] = field(default_factory=dict)
    verified: dict[str, tuple[int, int]] = field(default_factory=dict)  # per row: draft tokens verified, accepted
    unread: set[str] = field(default_factory=set)  # decode rows whose newest token is still computing
    draft_seconds: float = 0.0  # spent by the drafter model proposing ``draft_tokens`` tokens
    draft_tokens: int = 0
