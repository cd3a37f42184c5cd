"""[any] Speculative decoding's drafts and the policy that sizes them. No MLX here.

A draft is a guess at a row's next tokens; the runner verifies a row's input and its draft in one
forward and keeps the longest prefix the target itself would have produced (engine/verify.py), so
the output is the target's, token for token. Three sources:

- ``ngram`` (prompt lookup, vLLM's ``--speculative-config '{"method": "ngram", ...}'``): the tokens
  that followed the most recent earlier occurrence of the row's last ``n`` tokens, in its prompt and
  output, for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``;
- OpenAI's ``prediction`` (any server, per request): the predicted text's tokens that follow where
  the output stands in it;
- ``mtp`` (``{"method": "mtp", "model": DIR}``, mlx_vlm.server's ``--draft-model DIR --draft-kind
  mtp``): a drafter model, loaded with mlx-vlm's own drafter classes, that reads the target's last
  hidden states (and KV, or a KV of its own) and proposes the next tokens on the worker, beside the
  target: Gemma 4's assistant drafters (engine/drafter.py) and Qwen3.5's MTP (engine/mtp.py). Without
  ``model``, the MTP layers the served checkpoint carries (a Qwen3.5's), as vLLM reads them;
- ``dflash`` (``{"method": "dflash", "model": DIR}``, ``--draft-kind dflash``): a DFlash drafter
  (engine/dflash.py), a block of drafts in one forward from several target layers' hidden states;
- ``eagle3`` (``{"method": "eagle3", "model": DIR}``, ``--draft-kind eagle3``): an EAGLE-3 drafter
  (engine/eagle3.py), a decoder layer of its own fed with three target layers' hidden states;
- ``draft_model`` (``{"method": "draft_model", "model": DIR}``, mlx-lm's ``--draft-model``): a small
  model of the target's tokenizer (engine/draft_model.py), a whole model's forward per draft token.

Speculating costs a verify forward ``k + 1`` positions wide per row, and ends the decode pipeline
for the step (the next input is known only once the acceptance is read). ``DraftPolicy`` picks the
step's width from the measured costs (engine/costs.py) and each row's acceptance so far, and drafts
nothing where that does not pay.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vlmserve.engine.costs import StepCosts

METHODS = ("ngram", "mtp", "dflash", "eagle3", "draft_model")
DRAFTERS = ("mtp", "dflash", "eagle3", "draft_model")  # the methods whose drafts a drafter model makes
# Named by vLLM and mlx_vlm.server, and not run here (yet): refused at start-up, in one line.
UNSUPPORTED_METHODS = ("eagle", "medusa")
PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.0, 2.0  # a row's acceptance before it has any: 0.5, weighed as 2 tokens
_FORGET = 0.9  # each verify, a row's acceptance counts weigh this much less (recent behaviour wins)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` as vLLM spells it (ngram's fields, and mtp's and dflash's ``model``)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # draft tokens per row and step, at most
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # false: draft ``num_speculative_tokens`` whenever there is a draft, whatever it costs (tests)
    adaptive: bool = True
    # mtp: the drafter's directory (or Hub id), loaded with mlx-vlm's drafter classes; None: the MTP layers
    # the served checkpoint carries (Qwen3.5's), as vLLM reads them
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method in UNSUPPORTED_METHODS:
            raise ValueError(f"method {self.method!r} is not supported yet; this server speculates with "
                             f"{', '.join(METHODS)} and OpenAI's prediction")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; one of {', '.join(METHODS)}")
        if self.method not in DRAFTERS and self.model is not None:
            raise ValueError(f'"model" names a drafter, which method {self.method!r} has none of; use one of '
                             f'{", ".join(DRAFTERS)}')
        if self.method in ("dflash", "eagle3", "draft_model") and self.model is None:
            raise ValueError(f'"{self.method}" needs its drafter: "model" (--draft-model)')
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON; ValueError naming what is wrong."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**given)

    @property
    def drafter(self) -> bool:
        """Whether a drafter model proposes the drafts (on the worker), not a lookup the scheduler makes."""
        return self.method in DRAFTERS


def lookup(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the ``k`` tokens after the most recent earlier occurrence of the last ``n``
    tokens of ``tokens``, for the longest ``n`` in ``[min_n, max_n]`` that occurs; [] when none does."""
    if k < 1 or len(tokens) <= min_n or not _seen_before(tokens):
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(array) - 1), min_n - 1, -1):
        starts = _occurrences(array[:-1], array[-n:])  # not the tail itself
        if starts.size:
            after = int(starts[-1]) + n
            return [int(t) for t in array[after:after + k]]
    return []


def follow_prediction(prediction: Sequence[int], output: Sequence[int], k: int, max_n: int) -> list[int]:
    """The ``k`` predicted tokens after where ``output`` stands in ``prediction``: right after it while
    it is the prediction's prefix; else after the occurrence of the output's longest tail (``max_n``
    tokens at most) nearest to where the output would stand in it (an edit moves it little)."""
    if k < 1 or not prediction:
        return []
    n_out = len(output)
    if list(prediction[:n_out]) == list(output):
        return list(prediction[n_out:n_out + k])
    array = np.asarray(prediction, dtype=np.int64)
    tail = np.asarray(output[-max_n:], dtype=np.int64)
    for n in range(min(len(tail), len(array)), 0, -1):
        starts = _occurrences(array, tail[-n:])
        if starts.size:
            after = int(starts[np.argmin(np.abs(starts + n - n_out))]) + n
            return [int(t) for t in array[after:after + k]]
    return []


def _seen_before(tokens: Sequence[int]) -> bool:
    """Whether the last token occurred earlier: no match can exist otherwise (a C-speed scan, so that
    a row whose text does not repeat costs next to nothing a step)."""
    if not isinstance(tokens, list):
        return True
    try:
        tokens.index(tokens[-1], 0, len(tokens) - 1)
    except ValueError:
        return False
    return True


def _occurrences(array: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Where ``pattern`` starts in ``array`` (ascending)."""
    n = pattern.size
    if n == 0 or array.size < n:
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(array, n)
    return np.flatnonzero((windows == pattern).all(axis=1))


@dataclass(slots=True)
class Acceptance:
    """One request's record of its drafts: a decaying count of draft tokens offered and accepted
    (the policy's estimate of the chance its next draft token is right), and how many of its
    prediction's tokens it kept (OpenAI's usage)."""

    accepted: float = PRIOR_ACCEPTED
    drafted: float = PRIOR_DRAFTED
    prediction_accepted: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted

    def record(self, drafted: int, accepted: int, from_prediction: bool) -> None:
        """A verify offered ``drafted`` tokens and the target kept the first ``accepted``; a draft runs
        until its first miss, so a fully accepted one shows no miss."""
        if drafted <= 0:
            return
        self.accepted = _FORGET * self.accepted + accepted
        self.drafted = _FORGET * self.drafted + accepted + (accepted < drafted)
        if from_prediction:
            self.prediction_accepted += accepted


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify of a ``k``-token draft yields, on average, when each draft token is right with
    probability ``rate`` given those before it: the accepted run and the target's own next token."""
    rate = min(max(rate, 0.0), 0.999)
    return (1 - rate ** (k + 1)) / (1 - rate)


@dataclass(slots=True)
class DraftPolicy:
    """How wide this step's verify is: the width that makes the most tokens per second of step.

    A step of ``B`` rows costs a decode step, pipelined. A verify ``w`` positions wider is read at
    once (the next inputs are known only then), so it costs a step read at once plus ``B * w`` prompt
    tokens' time (every row goes the same width: ragged drafts are padded), plus a drafter model's ``w``
    tokens for each row it drafts for. A row with a draft of ``k``
    tokens yields ``expected_tokens(rate, min(k, w))``; a row without one yields 1.

    A draft model also reads each prompt first (its text through the draft model, a cost no other drafter
    has): ``pays_prefill`` lets a row draft with it only where that prefill can pay back.
    """

    config: SpeculativeConfig
    prompt_token_s: float = 0.0  # measured (engine/costs.py); 0: not yet, every draft goes
    decode_step_s: float = 0.0
    sync_step_s: float = 0.0
    draft_token_s: float = 0.0  # a drafter model's, per token it proposes
    draft_prefill_token_s: float = 0.0  # a draft model's, per prompt token it reads

    def measured(self, costs: StepCosts) -> None:
        """Take the engine's measured costs."""
        self.prompt_token_s, self.decode_step_s = costs.prompt_token_s, costs.decode_step_s
        self.sync_step_s = max(costs.sync_step_s, costs.decode_step_s)
        self.draft_token_s, self.draft_prefill_token_s = costs.draft_token_s, costs.draft_prefill_token_s

    def pays_prefill(self, prompt: int, room: int) -> bool:
        """Whether a row's draft-model prefill of ``prompt`` tokens can pay back over the ``room`` tokens it
        may make. A new row drafts at the prior acceptance (where ``width`` starts it): drafting is expected
        to save, per token, a decode step less the best verify's share; less over ``room`` than the prefill
        costs (a long prompt with a short answer, or costs at which no draft pays), and the row does not
        draft. Unmeasured costs, or forced drafts: it does."""
        if not self.config.adaptive or self.draft_prefill_token_s <= 0 or self.decode_step_s <= 0:
            return True
        proposed = max(self.draft_token_s, self.draft_prefill_token_s)  # one it proposes costs one it reads, at least
        synced, rate = max(self.sync_step_s, self.decode_step_s), PRIOR_ACCEPTED / PRIOR_DRAFTED
        per_token = min((synced + w * (self.prompt_token_s + proposed)) / expected_tokens(rate, w)
                        for w in range(1, self.config.num_speculative_tokens + 1))
        return room * (self.decode_step_s - per_token) > prompt * self.draft_prefill_token_s

    def width(self, rates: Sequence[float], drafts: Sequence[int], rows: int, modelled: int = 0) -> int:
        """The step's draft width for the ``rows`` decoding rows, of which the drafted ones have
        acceptance ``rates`` and drafts of ``drafts`` tokens, ``modelled`` of them a drafter model's
        (``w`` tokens proposed each, at ``draft_token_s``); 0: no verify this step."""
        longest = min(max(drafts, default=0), self.config.num_speculative_tokens)
        if not self.config.adaptive or longest == 0 or self.prompt_token_s <= 0 or self.decode_step_s <= 0:
            return longest
        synced = max(self.sync_step_s, self.decode_step_s)
        best, best_rate = 0, rows / self.decode_step_s
        for w in range(1, longest + 1):
            tokens = rows - len(drafts) + sum(expected_tokens(r, min(k, w)) for r, k in zip(rates, drafts))
            rate = tokens / (synced + rows * w * self.prompt_token_s + modelled * w * self.draft_token_s)
            if rate > best_rate:
                best, best_rate = w, rate
        return best
