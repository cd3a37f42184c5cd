"""[any] ToolCallStreamParser: any split of the text gives what parse_tool_calls gives on the whole."""

from __future__ import annotations

import json
import random

import pytest

from tests.test_tools_gemma4 import ALL_CASES as GEMMA4_CASES
from tests.test_tools_hermes import CASES as HERMES_CASES
from vlmserve.tools import ContentDelta, StreamEvent, ToolCallDelta, ToolCallStreamParser, parse_tool_calls

MARKERS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<tool_call>", "</tool_call>")
TABLE = [
    pytest.param(parser, *case.values, id=f"{parser}-{case.id}")
    for parser, cases in (("gemma4", GEMMA4_CASES), ("hermes", HERMES_CASES))
    for case in cases
]


def random_split(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    count = min(max(len(text) - 1, 0), rng.randint(1, 12))
    cuts = sorted(rng.sample(range(1, len(text)), count))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(parser: str, tools: list[dict] | None, deltas: list[str]) -> list[StreamEvent]:
    splitter = ToolCallStreamParser(parser, tools)
    events = [event for delta in deltas for event in splitter.feed(delta)]
    return events + splitter.finish()


def collect(events: list[StreamEvent]) -> tuple[str, list[tuple[str, dict]]]:
    """Content and calls the way an OpenAI client assembles them from the deltas."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            name, args = calls.setdefault(e.index, ["", ""])
            calls[e.index] = [name + (e.name or ""), args + e.arguments_json]
    return content, [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.parametrize(("parser", "text", "tools", "content", "calls"), TABLE)
def test_any_split_matches_whole_text(
    parser: str, text: str, tools: list[dict] | None, content: str, calls: list[tuple]
) -> None:
    whole_content, whole_calls = parse_tool_calls(text, tools, parser)
    whole = (whole_content, [(c.name, c.arguments) for c in whole_calls])
    assert whole == (content, calls)
    splits = [random_split(text, seed) for seed in range(8)] + [list(text)]
    for deltas in splits:
        events = stream(parser, tools, deltas)
        assert collect(events) == whole, deltas
        for event in events:
            if isinstance(event, ContentDelta):
                # Markup reaches the content only as part of a call that could not be read.
                assert not [m for m in MARKERS if m in event.text and m not in content], deltas


def test_content_streams_before_a_possible_marker() -> None:
    splitter = ToolCallStreamParser("gemma4", None)
    assert splitter.feed("Hello world") == [ContentDelta("Hello world")]
    assert splitter.feed(", checking <|tool") == [ContentDelta(", checking")]
    assert splitter.feed("_call>call:f{a:1}") == []
    assert not splitter.has_tool_calls
    first, second, tail = splitter.feed("<tool_call|> ok ")
    assert (first.index, first.name, first.type, first.arguments_json) == (0, "f", "function", "")
    assert first.id is not None and first.id.startswith("call_")
    assert second == ToolCallDelta(0, '{"a": 1}')
    assert tail == ContentDelta(" ok")  # the space before the call stays, the one after goes
    assert splitter.has_tool_calls
    assert splitter.finish() == []


def test_held_text_that_was_no_marker_is_released() -> None:
    splitter = ToolCallStreamParser("hermes", None)
    assert splitter.feed("a <tool_ca") == [ContentDelta("a")]
    assert splitter.feed("t> b") == [ContentDelta(" <tool_cat> b")]
    assert splitter.feed(" <") == []
    assert splitter.finish() == [ContentDelta(" <")]


def test_unclosed_call_is_emitted_at_finish() -> None:
    splitter = ToolCallStreamParser("gemma4", None)
    assert splitter.feed("<|tool_call>call:a{x:'1'") == []
    events = splitter.finish()
    assert [e.index for e in events] == [0, 0]
    assert events[1].arguments_json == '{"x": "1"}'


def test_indices_count_calls_and_openai_shape() -> None:
    text = "<tool_call>" + '[{"name": "a"}, {"name": "b", "arguments": {"n": 2}}]' + "</tool_call>"
    events = stream("qwen", None, [text])
    assert [e.to_openai() for e in events][2:] == [
        {"index": 1, "id": events[2].id, "type": "function", "function": {"name": "b", "arguments": ""}},
        {"index": 1, "function": {"arguments": '{"n": 2}'}},
    ]


def test_unknown_parser_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown tool parser"):
        ToolCallStreamParser("pythonic", None)
