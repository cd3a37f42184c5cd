"""[pool] Grammars for constrained decoding, compiled once per model and schema (llguidance).

What a request asks for becomes one llguidance grammar: a JSON schema (``response_format``
json_schema, or any object for json_object), a regex or a choice list (the ``structured_outputs``
extension, as vLLM names it), a Lark grammar, or a tool call in the model's own syntax
(``tool_choice`` required or named: preprocess/tool_grammar.py). Each grammar is validated
against the model's tokenizer (an invalid one is the client's 400) and kept, as a matcher in its
start state, in a small LRU: the worker copies it for each request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vlmserve.inputs import Guide
from vlmserve.preprocess.json_schema import tidy_json
from vlmserve.preprocess.tool_grammar import marker, tool_call_lark

CACHED_GRAMMARS = 64


class GuideError(ValueError):
    """The grammar cannot be compiled (the API answers 400 naming the problem)."""


@dataclass(slots=True, frozen=True)
class GuideSpec:
    """What the client asked to constrain to: ``kind`` json_schema | json_object | regex | choice |
    grammar | tool_call, and its value (for a tool call: ``{"format", "tools"}``)."""

    kind: str
    value: Any = None

    @property
    def key(self) -> str:
        return self.kind + ":" + json.dumps(self.value, sort_keys=True, ensure_ascii=False)


class GuideCompiler:
    """One model's grammars: its llguidance tokenizer (built on first use, ~1 s for a large vocabulary)."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], opens_reasoning: bool = False) -> None:
        self._tokenizer, self._eos = tokenizer, sorted(eos_token_ids)
        # The prompt ends inside <think> (Qwen3.5): the constrained answer comes after an empty one.
        self._after_thinking = opens_reasoning
        self._lock = threading.Lock()
        self._ll: Any = None
        self._cache: OrderedDict[str, Guide] = OrderedDict()

    def compile(self, spec: GuideSpec, after_thinking: bool | None = None) -> Guide:
        """``after_thinking``: the prompt ends inside ``<think>`` (None: as the model's prompts do)."""
        thinking = self._after_thinking if after_thinking is None else after_thinking
        key = f"{int(thinking)}:{spec.key}"
        with self._lock:  # pool threads share the tokenizer and the cache
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            guide = self._compile(spec, thinking)
            self._cache[key] = guide
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return guide

    def _compile(self, spec: GuideSpec, thinking: bool) -> Guide:
        import llguidance

        grammar = self._grammar(spec, thinking)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        if error:
            raise GuideError(f"cannot constrain to this {spec.kind.replace('_', ' ')}: {error.strip()}")
        return Guide(spec.kind, llguidance.LLMatcher(self._ll_tokenizer(), grammar))

    def _grammar(self, spec: GuideSpec, thinking: bool) -> str:
        from llguidance import LLMatcher

        if spec.kind == "grammar":
            return LLMatcher.grammar_from_lark(spec.value)  # the client's own start rule, as written
        if spec.kind == "regex" and not thinking:
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "tool_call":
            lark = tool_call_lark(spec.value["format"], spec.value["tools"], self._tokenizer)
        else:
            lark = "start: answer\nanswer: " + self._body(spec)
        if thinking:
            lark = lark.replace("start:", f'start: {marker(self._tokenizer, "</think>")} "\\n\\n" body\nbody:', 1)
        return LLMatcher.grammar_from_lark(lark)

    @staticmethod
    def _body(spec: GuideSpec) -> str:
        if spec.kind == "json_schema":
            return "%json " + json.dumps(tidy_json(spec.value))
        if spec.kind == "json_object":
            return "%json " + json.dumps(tidy_json({"type": "object"}))
        if spec.kind == "regex":
            return "/" + str(spec.value).replace("/", "\\/") + "/"
        if spec.kind == "choice":
            return " | ".join(json.dumps(c) for c in spec.value)
        raise GuideError(f"unknown constraint {spec.kind!r}")

    def _ll_tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=self._eos)
        return self._ll
