"""[any] Llama 4 tool calls (``<|python_start|>`` content ``<|python_end|>`` then ``{"name", "parameters"}`` per
call), as tables of (text, tools, content, calls), streamed in any split; the template tells the format; the
forced-call grammar."""

from __future__ import annotations

import random

import pytest

from tests.test_tools_gemma4 import WEATHER
from vlmserve.preprocess.tool_grammar import tool_call_lark
from vlmserve.testing.templates import published_template
from vlmserve.tools import ContentDelta, ToolCallDelta, ToolCallStreamParser, parse_tool_calls, select_parser

TOKYO = '{"name": "get_weather", "parameters": {"location": "Tokyo"}}'


def call(*bodies: str, content: str = "") -> str:
    """A tool-call turn as the published template writes it (the end of turn included)."""
    return f"<|python_start|>{content}<|python_end|>{''.join(bodies)}<|eot|>"


CASES = [
    pytest.param(call(TOKYO), None, "", [("get_weather", {"location": "Tokyo"})], id="template"),
    pytest.param(call(TOKYO)[: -len("<|eot|>")], None, "", [("get_weather", {"location": "Tokyo"})],
                 id="stopped-at-eot"),
    pytest.param(call(TOKYO, '{"name": "ping", "parameters": {}}'), None, "",
                 [("get_weather", {"location": "Tokyo"}), ("ping", {})], id="two-calls-back-to-back"),
    pytest.param("Let me check. " + call(TOKYO), None, "Let me check.", [("get_weather", {"location": "Tokyo"})],
                 id="content-before"),
    pytest.param(call('{"name": "get_weather", "parameters": {"location": 7, "days": "3"}}'), WEATHER, "",
                 [("get_weather", {"location": "7", "days": 3})], id="schema-coerce"),
    pytest.param(call('{"name": "f", "arguments": {"a": 1}}'), None, "", [("f", {"a": 1})], id="arguments-key"),
    pytest.param("<|python_start|>" + TOKYO, None, "", [("get_weather", {"location": "Tokyo"})],
                 id="no-content-slot"),
    pytest.param(call('{"name": "rm", "parameters": {}}'), WEATHER,
                 '<|python_start|><|python_end|>{"name": "rm", "parameters": {}}<|eot|>', [], id="unknown-tool-kept"),
    pytest.param(call('{"name": "f", "parameters": {"a": }}'), None,
                 '<|python_start|><|python_end|>{"name": "f", "parameters": {"a": }}<|eot|>', [],
                 id="malformed-kept"),
    pytest.param(call(""), None, "<|python_start|><|python_end|><|eot|>", [], id="empty-kept"),
    pytest.param("Plain answer, no call.", None, "Plain answer, no call.", [], id="no-call"),
]


@pytest.mark.parametrize(("text", "tools", "content", "calls"), CASES)
def test_parse(text: str, tools: list[dict] | None, content: str, calls: list[tuple]) -> None:
    got_content, got_calls = parse_tool_calls(text, tools, "llama4")
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


@pytest.mark.parametrize(("text", "tools", "content", "calls"), CASES)
def test_any_split_streams_as_the_whole(text: str, tools: list[dict] | None, content: str, calls: list[tuple]) -> None:
    for seed in range(6):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        parser = ToolCallStreamParser("llama4", tools)
        events = [e for a, b in zip([0, *cuts], [*cuts, len(text)]) for e in parser.feed(text[a:b])]
        events += parser.finish()
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == content
        assert [(c.name, c.arguments) for c in parser.calls] == calls
        assert len([e for e in events if isinstance(e, ToolCallDelta) and e.name]) == len(calls)


def test_the_published_template_selects_llama4() -> None:
    assert select_parser(published_template("llama-4-scout-17b-16e-instruct"), "hermes") == "llama4"


def test_a_forced_call_is_the_templates_syntax_with_markers_by_id() -> None:
    class Tokenizer:  # the markers are special tokens of their own, as in Llama 4's tokenizer
        all_special_tokens = ["<|python_start|>", "<|python_end|>", "<|eot|>"]
        added_tokens_decoder: dict = {}

        def convert_tokens_to_ids(self, text: str) -> int:
            return 100 + self.all_special_tokens.index(text)

    grammar = tool_call_lark("llama4", WEATHER, Tokenizer())
    assert grammar.startswith("start: <[100]> <[101]> call")
    assert 'call_0: "{\\"name\\": \\"get_weather\\", \\"parameters\\": " args_0 "}"' in grammar
    assert "args_0: %json" in grammar
