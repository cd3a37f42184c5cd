"""[loop] One request's outputs in OpenAI's shapes: chunks for streams, a message for the rest."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlmserve.frontend.output import RequestOutput
from vlmserve.frontend.reasoning import ReasoningSplitter
from vlmserve.frontend.token_bytes import token_text_and_bytes
from vlmserve.tools import ContentDelta, ToolCallDelta, ToolCallStreamParser


@dataclass(slots=True)
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)


class DeltaEvents(Protocol):
    """An API's stream events for each part of a delta (Anthropic's content blocks, the Responses API's items)."""

    def reasoning(self, text: str) -> list[str]: ...

    def content(self, text: str) -> list[str]: ...

    def call_started(self, call_id: str, name: str) -> list[str]: ...

    def arguments(self, text: str) -> list[str]: ...


def delta_events(delta: Delta, sink: DeltaEvents) -> list[str]:
    """A step's delta as ``sink``'s events, in order: reasoning, content, then each tool call's start (its id
    and name, in the entry that opens it) and its arguments as they come."""
    events = sink.reasoning(delta.reasoning) if delta.reasoning else []
    if delta.content:
        events += sink.content(delta.content)
    for entry in delta.tool_calls:
        function = entry.get("function", {})
        if entry.get("id"):
            events += sink.call_started(entry["id"], function.get("name", ""))
        if function.get("arguments"):
            events += sink.arguments(function["arguments"])
    return events


class ChoiceBuilder:
    """Turns each step's output into content, tool-call deltas and logprobs, exactly once."""

    def __init__(self, request_id: str, model: str, tokenizer: Any, parser: str | None,
                 tools: list[dict[str, Any]] | None, reasoning_opened: bool = False, index: int = 0,
                 one_call: bool = False) -> None:
        self.id, self.model, self.created, self.index = request_id, model, int(time.time()), index
        self._one_call = one_call  # parallel_tool_calls false: a reply's first call only (vLLM's rule)
        self._tokenizer = tokenizer
        self._parser = ToolCallStreamParser(parser, tools) if parser and tools else None
        self._reasoning = ReasoningSplitter(reasoning_opened)
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked
        self.usage: dict[str, Any] = {}

    def step(self, out: RequestOutput) -> Delta:
        delta = Delta(logprobs=[self._logprob(lp) for lp in out.logprobs if lp is not None])
        delta.reasoning, text = self._reasoning.feed(out.text, final=out.finished)
        events = self._parser.feed(text) if self._parser else [ContentDelta(text)]
        if out.finished and self._parser:
            events += self._parser.finish(cut=out.finish_reason == "length")
        for event in events:
            if isinstance(event, ContentDelta):
                delta.content += event.text
            elif isinstance(event, ToolCallDelta) and not (self._one_call and event.index > 0):
                delta.tool_calls.append(event.to_openai())
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.logprobs += delta.logprobs
        self.usage = _usage(out)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [self._prompt_logprob(lp) for lp in out.prompt_logprobs]
        return delta

    @property
    def calls(self) -> list[Any]:
        """The tool calls parsed so far (``ToolCall``: name, arguments_json, id)."""
        calls = self._parser.calls if self._parser else []
        return calls[:1] if self._one_call else calls

    def finish_reason(self, engine_reason: str | None) -> str:
        """``length`` whenever the token limit ended it, calls or not (a cut call is not one)."""
        if engine_reason == "length":
            return "length"
        return "tool_calls" if self._parser is not None and self._parser.has_tool_calls else "stop"

    # -- shapes ------------------------------------------------------------------------

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        choice = {"index": self.index, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                  "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", choices=[choice])

    def usage_chunk(self, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", choices=[], usage=usage or self.usage)

    def response(self, finish_reason: str, want_logprobs: bool, others: Sequence[dict[str, Any]] = (),
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole reply; ``others``: more choices (n > 1), ``usage``: theirs and this one's."""
        scored = {} if self.prompt_logprobs is None else {"prompt_logprobs": self.prompt_logprobs}
        return self._envelope("chat.completion", choices=[self.choice(finish_reason, want_logprobs), *others],
                              usage=usage or self.usage, **scored)

    def choice(self, finish_reason: str, want_logprobs: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        calls = self.calls
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        else:
            message["content"] = self.content
        return {"index": self.index, "message": message, "finish_reason": finish_reason,
                "logprobs": {"content": self.logprobs} if want_logprobs else None}

    def _envelope(self, obj: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, **fields}

    def _logprob(self, lp: Any) -> dict[str, Any]:
        entry = self._token_entry(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._token_entry(t, p) for t, p in lp.top]
        return entry

    def _prompt_logprob(self, lp: Any) -> dict[str, Any] | None:
        """A prompt position as vLLM lists it: by token id, the prompt's token and the best others,
        each with its logprob, rank and text (the first position: None, nothing comes before it)."""
        if lp is None:
            return None
        entries = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._text(lp.token_id)}}
        for rank, (t, p) in enumerate(lp.top, 1):
            entries.setdefault(str(t), {"logprob": p, "rank": rank, "decoded_token": self._text(t)})
        return entries

    def _text(self, token_id: int) -> str:
        return token_text_and_bytes(self._tokenizer, token_id)[0]

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text_and_bytes(self._tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}


def choices_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The usage of n > 1 choices of one prompt: its tokens once (prefilled once), every choice's completion."""
    first = usages[0]
    completion = sum(u.get("completion_tokens", 0) for u in usages)
    details = {k: sum(u.get("completion_tokens_details", {}).get(k, 0) for u in usages) for k in PREDICTION_USAGE}
    return {**first, "completion_tokens": completion, "total_tokens": first.get("prompt_tokens", 0) + completion,
            "completion_tokens_details": details}


PREDICTION_USAGE = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_completion_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "completion_tokens_details": {"accepted_prediction_tokens": out.accepted_prediction_tokens,
                                      "rejected_prediction_tokens": out.rejected_prediction_tokens},
    }
