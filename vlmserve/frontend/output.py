"""[loop] Output processing, once per step per request: token ids -> text delta, stop strings, usage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.request import StepOutput
from vlmserve.frontend.detokenizer import IncrementalDetokenizer
from vlmserve.tools.base import partial_marker_len


@dataclass(slots=True, frozen=True)
class RequestOutput:
    """What a consumer of ``AsyncEngine.generate`` sees for one step of one request."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Any, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    engine_step: int = 0
    prompt_logprobs: tuple[Any, ...] | None = None  # TokenLogprob or None per prompt position, when asked
    stop_string: str | None = None  # the stop string that ended it (vLLM's stop_reason), with the last output
    accepted_prediction_tokens: int = 0  # OpenAI's prediction: its drafted tokens the output kept so far
    rejected_prediction_tokens: int = 0  # and those it did not
    stop_logprob: Any = None  # the stop token that ended it, not output: its logprob (vLLM lists it), when asked
    num_stored_tokens: int = 0  # its prompt's first positions the engine kept in a prefix cache

    @property
    def num_cache_written_tokens(self) -> int:
        """Prompt tokens newly written to a prefix cache (Anthropic's cache_creation_input_tokens)."""
        return max(0, self.num_stored_tokens - self.num_cached_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Per request: detokenizes incrementally and cuts the text at the first stop string.

    Text that might be the start of a stop string is held back until it is certain.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._min_tokens = min_tokens  # stop strings count only once more tokens than this have come (vLLM's)
        self._held = ""
        self.num_completion_tokens = 0
        self.stopped = False  # a stop string matched: the engine must abort the request
        self.stop_string: str | None = None  # which one

    def process(self, out: StepOutput) -> RequestOutput:
        self.num_completion_tokens += len(out.token_ids)
        text = "".join(self._detok.add(t) for t in out.token_ids)
        if out.finish_reason is not None:
            text += self._detok.flush()
        text, finish = self._apply_stop(text, final=out.finish_reason is not None)
        return RequestOutput(
            out.request_id, text, out.token_ids, out.logprobs, finish or out.finish_reason,
            out.num_prompt_tokens, self.num_completion_tokens, out.num_cached_tokens, out.error, out.step,
            out.prompt_logprobs, self.stop_string if finish else None, out.accepted_prediction_tokens,
            out.rejected_prediction_tokens, out.stop_logprob, out.num_stored_tokens,
        )

    @classmethod
    def for_params(cls, tokenizer: Any, params: SamplingParams) -> OutputProcessor:
        return cls(tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)

    def _apply_stop(self, text: str, final: bool) -> tuple[str, str | None]:
        if not self._stop or self.num_completion_tokens <= self._min_tokens:
            return text, None
        buf = self._held + text
        hits = [(at, s) for s in self._stop if (at := buf.find(s)) >= 0]
        if hits:
            at, self.stop_string = min(hits)
            self._held, self.stopped = "", True
            return buf[:at], "stop"
        keep = 0 if final else partial_marker_len(buf, self._stop)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None
