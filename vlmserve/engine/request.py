"""[worker] A request as the scheduler sees it, and the typed messages that cross the thread boundary.

No MLX here: the scheduler and request code are tested with plain fakes.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import Acceptance
from vlmserve.inputs import PromptInputs

if TYPE_CHECKING:  # no MLX here: the prefix cache module imports mlx-lm
    from vlmserve.engine.disk_store import DiskStoreStats
    from vlmserve.engine.prefix_cache import PrefixCacheStats
    from vlmserve.engine.vision_cache import VisionCacheStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True, frozen=True)
class StepOutput:
    """What one step produced for one request; the last one carries ``finish_reason``."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Any, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    step: int = 0  # the engine step that produced it (admission delay, tests)
    prompt_logprobs: tuple[Any, ...] | None = None  # with the first token, when the request asked
    # OpenAI's prediction, so far: its tokens the output kept, and those it did not (verified, rejected)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    stop_logprob: Any = None  # the stop token that ended it (not among ``token_ids``): its logprob, when asked
    num_stored_tokens: int = 0  # its prompt's first positions kept in a prefix cache (0: none)


@dataclass(slots=True)
class EngineMetrics:
    """The engine's counters after a step (a copy travels with each ``StepOutputs``)."""

    steps: int = 0
    last_step_s: float = 0.0
    running: int = 0
    waiting: int = 0
    batch_size: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    step_errors: int = 0
    prefill_batches: int = 0  # forwards that prefilled several whole prompts together
    vision_batches: int = 0  # vision forwards shared by several image prompts
    vision_seconds: float = 0.0  # spent embedding image prompts: vision tower (or vision cache) and merge
    kv_reserved_bytes: int = 0  # what the running requests may fill (engine/memory.py)
    kv_budget_bytes: int | None = None
    prefix: PrefixCacheStats | None = None
    vision: VisionCacheStats | None = None
    mm_prefix: PrefixCacheStats | None = None  # the image-keyed prefix cache (opt-in)
    disk: DiskStoreStats | None = None  # the prefix stores' disk tier (--prefix-cache-dir)
    # Speculative decoding (vLLM's spec_decode counters): drafts verified, their tokens, those accepted,
    # and accepted by position in the draft
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Memory by owner (engine/memory.py), read with the counters: the batch's KV as allocated now (bounded by
    # ``kv_reserved_bytes``), its drafter's own state, and MLX's active and cached bytes (the process's)
    kv_used_bytes: int = 0
    draft_bytes: int = 0
    mlx_active_bytes: int = 0
    mlx_cache_bytes: int = 0
    mlx_cache_limit_bytes: int = 0


@dataclass(slots=True, frozen=True)
class StepOutputs:
    """Worker -> loop, once per step: every request's output of the step and the counters after it."""

    outputs: tuple[StepOutput, ...]
    metrics: EngineMetrics


Publisher = Callable[[StepOutputs], None]


@dataclass(slots=True, frozen=True)
class AddRequest:
    """Loop -> worker: a preprocessed request ready to be scheduled."""

    request_id: str
    prompt: PromptInputs
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)  # posted: its prompt was ready for the engine
    # n > 1: more requests of the same prompt, each with its own sampling; they share this one's
    # prefill and become rows of their own when it ends (its KV copied, its last logits sampled again)
    forks: tuple[tuple[str, SamplingParams], ...] = ()


@dataclass(slots=True, frozen=True)
class AbortRequest:
    """Any thread -> worker: stop this request at the next iteration and free its slot."""

    request_id: str


@dataclass(slots=True)
class Request:
    """One request's state on the worker. Only its own methods and the scheduler change it."""

    request_id: str
    prompt: PromptInputs
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_context: int = 1 << 30
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_stored_tokens: int = 0  # how much of its prompt it keeps in a prefix cache (0: none, or not yet)
    # A prompt that cannot be split by tokens is split by layers: the language model's layers its
    # prompt has been through (0 when none, or when it goes by tokens).
    num_computed_layers: int = 0
    encoded: bool = False  # its embedding (vision tower and merge) is made and waits in the runner
    num_encoded_blocks: int = 0  # its image split by vision tower blocks: the blocks done so far
    chunkable: bool = True  # may its prompt be prefilled over several steps by tokens (the model adapter says)
    # where its prompt may go by tokens after all, once a reused prefix reaches this far (None: never)
    text_tail: int | None = None
    batchable: bool = True  # may its whole prompt share a left-padded forward with others (the adapter says)
    # Positions the prompt fills: its token count, unless the model's embedding says otherwise
    # (mlx-vlm's LLaVA-NeXT merges more image features than the processor wrote image tokens).
    num_prompt_tokens: int = -1
    arrival_time: float = field(default_factory=time.monotonic)  # when its prompt was ready (AddRequest's)
    first_token_time: float | None = None  # when the step that sampled its first token ended
    held: bool = False  # prefilled, its first token out, its row kept out of the decode batch (the join gate)
    # n > 1: the requests forked from this one when its prefill ends (admitted with it), or the one
    # this request is forked from (it is never encoded or prefilled itself)
    forks: list[Request] = field(default_factory=list)
    fork_of: str | None = None
    unread: bool = False  # its newest token is still computing (pipelined decode): not in output_token_ids yet
    acceptance: Acceptance = field(default_factory=Acceptance)  # its drafts so far (speculative decoding)
    drafts_from_prediction: bool = False  # the draft planned last came from its prediction
    modelled: bool = True  # a drafter model may draft for it (a draft model only where its prefill pays)

    @property
    def prediction_usage(self) -> tuple[int, int]:
        """OpenAI's accepted and rejected prediction tokens: its prediction's tokens the output kept (as
        verified drafts), and the rest of them (0, 0 without a prediction)."""
        kept = min(self.acceptance.prediction_accepted, len(self.params.prediction))
        return kept, len(self.params.prediction) - kept

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.prompt.input_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def waits_for_fork(self) -> bool:
        """A fork whose prompt is still its parent's to prefill."""
        return self.fork_of is not None and not self.encoded

    @property
    def live_forks(self) -> list[Request]:
        """Forks not forked yet and not ended (an aborted fork is not copied)."""
        return [f for f in self.forks if f.waits_for_fork and not f.status.finished]

    @property
    def num_images(self) -> int:
        return self.prompt.num_images if self.prompt.has_images else 0

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1]

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; returns the finished status if this token ends the request."""
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED  # the stop token itself is not output
        self.output_token_ids.append(token_id)
        if len(self.output_token_ids) >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_prompt_tokens + len(self.output_token_ids) >= self.max_context:
            return RequestStatus.FINISHED_LENGTH
        return None
