"""Kimi tool calls (``<|tool_calls_section_begin|>`` ... ``functions.NAME:IDX`` ... JSON), as tables of (text, tools,
content, calls); ids as Kimi's templates write them; the forced-call grammar; ``◁think▷`` reasoning through the
real output path."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from conftest import reply_message

from tests.test_tools_gemma4 import WEATHER
from vlmserve.frontend.reasoning import ReasoningSplitter
from vlmserve.preprocess.prompt import PromptBuilder, tokenizer_of
from vlmserve.preprocess.tool_grammar import tool_call_lark
from vlmserve.testing import build_model
from vlmserve.testing.templates import published_template
from vlmserve.testing.tool_tuning import WEATHER_TOOL
from vlmserve.tools import ToolCallDelta, ToolCallStreamParser, parse_tool_calls, select_parser

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
WEATHER_TOOLS = [WEATHER_TOOL, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def one(call_id: str, arguments: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


def section(*calls: str) -> str:
    return BEGIN + "".join(calls) + END


WEATHER_CALL = one("functions.get_weather:0", '{"location": "Tokyo"}')
CASES = [
    pytest.param(section(WEATHER_CALL), WEATHER, "", [("get_weather", {"location": "Tokyo"})], id="basic"),
    pytest.param("Let me check." + section(WEATHER_CALL), WEATHER, "Let me check.",
                 [("get_weather", {"location": "Tokyo"})], id="after-text"),
    pytest.param(section(one("functions.get_weather:3", '{"location": "Oslo", "days": "2"}')), WEATHER, "",
                 [("get_weather", {"location": "Oslo", "days": 2})], id="typed-by-schema"),
    pytest.param(section(one("functions.a:0", "{}"), one("functions.b:1", '{"x": 1}')), None, "",
                 [("a", {}), ("b", {"x": 1})], id="two-calls-one-section"),
    pytest.param(section(one("get_weather:0", '{"location": "Tokyo"}')), WEATHER, "",
                 [("get_weather", {"location": "Tokyo"})], id="id-without-namespace"),
    pytest.param(BEGIN + one("functions.f:0", '{"q": "hi"}'), None, "", [("f", {"q": "hi"})], id="unclosed-at-the-end"),
    pytest.param(section(one("functions.rm:0", '{"path": "/"}')), WEATHER, section(one("functions.rm:0", '{"path": "/"}')),
                 [], id="unknown-tool-kept"),
    pytest.param(section(one("functions.f:0", "not json")), None, section(one("functions.f:0", "not json")), [],
                 id="bad-json-kept"),
    pytest.param(BEGIN + "chatter" + END, None, BEGIN + "chatter" + END, [], id="no-call-kept"),
]


@pytest.mark.parametrize(("text", "tools", "content", "calls"), CASES)
def test_parse(text: str, tools: list[dict] | None, content: str, calls: list[tuple]) -> None:
    got_content, got_calls = parse_tool_calls(text, tools, "kimi")
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


def test_calls_carry_the_ids_kimis_template_writes_back() -> None:
    _, calls = parse_tool_calls(section(one("functions.a:0", "{}"), one("functions.b:1", "{}")), None, "kimi")
    assert [c.id for c in calls] == ["functions.a:0", "functions.b:1"]


def test_the_ids_the_model_wrote_are_kept() -> None:
    """Kimi counts the conversation's calls: a third turn's call is ``:3``, and the history sent back must say
    so; a call the model wrote without the form gets one by its place in the reply."""
    _, calls = parse_tool_calls(section(one("functions.a:3", "{}"), one("b", "{}")), None, "kimi")
    assert [c.id for c in calls] == ["functions.a:3", "functions.b:1"]


@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_in_pieces_gives_the_same_call(size: int) -> None:
    text = "Let me check." + section(one("functions.get_weather:0", '{"location": "Tokyo", "days": 2}'))
    stream = ToolCallStreamParser("kimi", WEATHER)
    events = [e for i in range(0, len(text), size) for e in stream.feed(text[i:i + size])] + stream.finish()
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert calls[0].name == "get_weather" and calls[0].id == "functions.get_weather:0"
    assert "".join(c.arguments_json for c in calls) == '{"location": "Tokyo", "days": 2}'


def test_the_template_tells_kimi() -> None:
    assert select_parser(published_template("kimi-k2-instruct-0905"), "hermes") == "kimi"
    # Kimi-VL-A3B's own template writes no tools: the family's default
    assert select_parser(published_template("kimi-vl-a3b-instruct"), "kimi") == "kimi"


def test_a_forced_call_is_the_templates_syntax_with_markers_by_id() -> None:
    markers = [BEGIN, END, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]

    class Tokenizer:  # the markers are added tokens of their own, as in Kimi's tokenizer
        all_special_tokens = markers
        added_tokens_decoder: dict = {}

        def convert_tokens_to_ids(self, text: str) -> int:
            return 100 + markers.index(text)

    grammar = tool_call_lark("kimi", WEATHER, Tokenizer())
    assert grammar.startswith("start: <[100]> <[102]> call <[104]> <[101]>")
    assert 'call_0: "functions.get_weather:0" <[103]> args_0' in grammar and "args_0: %json" in grammar


@pytest.mark.parametrize("opened", [False, True])
def test_kimi_thinking_markers_split_at_every_place(opened: bool) -> None:
    reply = "◁think▷It may rain.◁/think▷\n\nTake an umbrella." if not opened else "hmm</think>ok"
    want = ("It may rain.", "Take an umbrella.") if not opened else ("hmm", "ok")
    for cut in range(len(reply) + 1):
        splitter = ReasoningSplitter(opened)
        parts = [splitter.feed(reply[:cut]), splitter.feed(reply[cut:], final=True)]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want, cut


def test_a_reply_thinks_then_calls_through_the_real_output_path() -> None:
    """Kimi-VL-Thinking writes ``◁think▷`` as text, then a call: detokenized one token at a time skipping special
    tokens (the tool markers are plain, so the parser sees them), the reasoning comes apart and the call whole."""
    message = reply_message("kimi_vl", "kimi", "◁think▷It may rain.◁/think▷" + section(WEATHER_CALL) + "[EOS]", WEATHER)
    assert message.get("reasoning_content") == "It may rain." and not message.get("content")
    (got,) = message["tool_calls"]
    assert got["id"] == "functions.get_weather:0" and got["function"]["name"] == "get_weather"
    assert json.loads(got["function"]["arguments"]) == {"location": "Tokyo"}


@pytest.fixture(scope="module")
def kimi_prompter() -> Any:
    from mlx_vlm.utils import load_processor

    importlib.import_module("mlx_vlm.models.kimi_vl")  # registers mlx-vlm's KimiVLProcessor
    return PromptBuilder.for_processor(load_processor(build_model("kimi_vl", "micro"), add_detokenizer=False))


def _prompt(prompter: Any, messages: list[dict[str, Any]]) -> str:
    ids = prompter.build(messages, [], WEATHER_TOOLS).input_ids
    return str(tokenizer_of(prompter.processor).decode(ids, skip_special_tokens=False))


def _turn(call_id: str, city: str, name: str = "get_weather") -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"location": city})}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": f"Sunny in {city}."}]


def test_a_clients_call_ids_become_kimis_in_the_prompt(kimi_prompter: Any) -> None:
    """Kimi's template writes a call's id where the model reads its name: Claude Code's ``toolu_...`` and OpenAI's
    ``call_...`` (here reused, as some clients do) were written there, the name lost. IDX counts the conversation's
    calls, as Moonshot's own ids do."""
    history = [{"role": "user", "content": "Weather?"}, *_turn("toolu_01XyZ", "Tokyo"), *_turn("call_0", "Paris"),
               *_turn("call_0", "Oslo", "get_time")]
    text = _prompt(kimi_prompter, history)
    for index, (name, city) in enumerate([("get_weather", "Tokyo"), ("get_weather", "Paris"), ("get_time", "Oslo")]):
        call_id = f"functions.{name}:{index}"
        assert f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>" in text
        assert f"## Return of {call_id}\n    Sunny in {city}." in text
    assert "toolu_" not in text and "call_0" not in text


def test_the_calls_this_server_returns_come_back_byte_identical(kimi_prompter: Any) -> None:
    """A reply's calls through the real output path, sent back as the client's history: the prompt writes the
    section exactly as the model did."""
    reply = section(one("functions.get_weather:0", '{"location": "Tokyo"}'),
                    one("functions.get_weather:1", '{"location": "Paris"}'))
    message = reply_message("kimi_vl", "kimi", reply + "[EOS]", WEATHER)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "Sunny."} for c in message["tool_calls"]]
    text = _prompt(kimi_prompter, [{"role": "user", "content": "Weather?"}, {**message, "content": ""}, *results])
    assert reply in text and "## Return of functions.get_weather:1" in text
