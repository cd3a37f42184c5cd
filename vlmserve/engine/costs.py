"""[worker] What a step costs on this machine, measured, and the prompt share of a step it allows.

A stream decoding one token a step freezes for as long as one step runs. While requests decode,
the scheduler gives each step only as many prompt tokens as take ``share`` times a decode step, and
more the longer the oldest prompt has waited, up to ``max_share`` (a backlog goes in fewer, longer
steps, each bounded). The seconds a prompt token and a decode step cost are probed once at start-up
(a text prompt prefilled whole), then kept as running averages: a decode step over the steps that
only decoded, a prompt token over the steps with prompt work. On a compute-bound CPU a prompt token
costs a third of a decode step; on a Mac's GPU a fiftieth: one rule gives each its own token budget.
While nothing decodes there is nobody to freeze, and prompts get the full ``prefill_chunk``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import EncodeChunk, NewRequest, PrefillChunk, SchedulerOutput
from vlmserve.inputs import PromptInputs

FLOOR_TOKENS = 16  # prompt tokens per step while requests decode, at least: every prompt moves on
OBSERVED_TOKENS = 8  # a step's prompt work measures a prompt token's cost from this many tokens on
AGING_STEPS = 8  # a prompt that has waited this many decode steps' time doubles the prompt share, and so on
PROBE_TOKENS = 128  # the cost probe's prompt length: long enough that per-token cost dominates
_AVERAGE = 0.2  # weight of the newest decode step in the running average


@dataclass(slots=True)
class StepCosts:
    share: float  # a step's prompt work may take this many decode steps' time
    floor: int  # prompt tokens per step, at least
    ceiling: int  # and at most (the idle budget)
    max_share: float = 0.0  # the share grows with the oldest prompt's wait up to this (``share`` if less)
    prompt_token_s: float = 0.0
    decode_step_s: float = 0.0
    sync_step_s: float = 0.0  # a decode step read at once (not pipelined), as a verify step is: probed once
    pixel_s: float = 0.0  # the vision tower's seconds per pixel value (running average)
    draft_token_s: float = 0.0  # a drafter model's seconds per draft token proposed (running average)
    draft_prefill_token_s: float = 0.0  # a draft model's seconds per prompt token it reads (its own measure)

    def observe(self, seconds: float, prompt_tokens: float, vision_s: float, decoded: bool = True) -> None:
        """One step, its vision work taken off. A step that only decoded measures a decode step; one with
        prompt work (``OBSERVED_TOKENS`` or more), a prompt token, less the decode step where it decoded
        too. Each from the steps it dominates: taking the prompt's share off a decode step by an estimate
        would turn an underestimated prompt token into a longer decode step, hence a larger budget, and
        longer steps again."""
        rest = seconds - vision_s
        if prompt_tokens <= 0:
            if decoded and rest > 0:
                self.decode_step_s = _average(self.decode_step_s, rest)
        elif prompt_tokens >= OBSERVED_TOKENS:
            prompt = rest - (self.decode_step_s if decoded else 0.0)
            if prompt > 0:
                self.prompt_token_s = _average(self.prompt_token_s, prompt / prompt_tokens)

    def observe_vision(self, pixels: float, vision_s: float) -> None:
        """A step's vision work: per pixel value, as images of any size go through the tower."""
        if pixels > 0 and vision_s > 0:
            self.pixel_s = _average(self.pixel_s, vision_s / pixels)

    def observe_drafts(self, seconds: float, tokens: int) -> None:
        """A step's drafter work: per draft token (a row's ``k`` tokens are ``k`` small forwards)."""
        if tokens > 0 and seconds > 0:
            self.draft_token_s = _average(self.draft_token_s, seconds / tokens)

    def pixel_tokens(self) -> float:
        """The tower's cost per pixel value, in prompt tokens' time: encodes come out of a step's budget."""
        return self.pixel_s / self.prompt_token_s if self.prompt_token_s > 0 else 0.0

    def stream_tokens(self, waited: float = 0.0) -> int:
        """Prompt tokens per step while requests decode: ``share`` decode steps' time (the floor at least),
        grown by one ``share`` for every ``AGING_STEPS`` decode steps the oldest prompt has waited
        (``waited`` seconds), up to ``max_share``: a backlog is served in fewer, longer steps, each bounded."""
        if self.prompt_token_s <= 0 or self.decode_step_s <= 0:
            return self.floor
        growth = min(max(self.max_share, self.share) / self.share, 1 + waited / (AGING_STEPS * self.decode_step_s))
        tokens = max(self.floor, self.share * self.decode_step_s / self.prompt_token_s) * growth
        return int(min(self.ceiling, tokens))


def _average(mean: float, value: float) -> float:
    return value if not mean else (1 - _AVERAGE) * mean + _AVERAGE * value


def measure_costs(runner: Any, prompt: PromptInputs, decode_steps: int = 6) -> tuple[float, float, float]:
    """Seconds per prompt token, per decode step and per decode step read at once (batch 1) on an idle
    runner (a ModelRunner): ``prompt``'s tokens repeated to ``PROBE_TOKENS``, prefilled whole, then a
    few decode steps pipelined, then as many read as they end (what a step that verifies drafts pays)."""
    assert not runner.batch, "measure costs on an idle runner"
    ids = (prompt.input_ids * (PROBE_TOKENS // max(1, len(prompt.input_ids)) + 1))[:PROBE_TOKENS]
    probe = "cost-probe"
    new = NewRequest(probe, PromptInputs(ids), SamplingParams(max_tokens=2 * decode_steps + 1, ignore_eos=True))
    try:
        _checked(runner.execute(SchedulerOutput(new=[new], encode=[EncodeChunk(probe)])))
        start = time.perf_counter()
        _checked(runner.execute(SchedulerOutput(prefill=[PrefillChunk(probe, 0, len(ids))])))
        prompt_token_s = (time.perf_counter() - start) / len(ids)
        steps: list[float] = []
        synced: list[float] = []
        for i in range(2 * decode_steps):
            start = time.perf_counter()
            _checked(runner.execute(SchedulerOutput(decode=[probe])))
            if i >= decode_steps:
                runner.batch.read_unread()
            (steps if i < decode_steps else synced).append(time.perf_counter() - start)
        # the first only dispatches (pipelined decode)
        return prompt_token_s, statistics.median(steps[1:]), statistics.median(synced[1:])
    finally:
        runner.execute(SchedulerOutput(finished=[probe]))


def _checked(out: Any) -> None:
    if out.errors:
        raise RuntimeError(f"could not measure the step costs: {next(iter(out.errors.values()))}")
