"""[any] GLM-4.5V / GLM-4.6V tool calls (``<tool_call>NAME`` then ``<arg_key>``/``<arg_value>`` pairs), as tables
of (text, tools, content, calls); the template tells GLM's format from Hermes's; the forced-call grammar."""

from __future__ import annotations

import pytest
from conftest import reply_message

from tests.test_tools_gemma4 import WEATHER
from vlmserve.preprocess.tool_grammar import tool_call_lark
from vlmserve.testing.templates import published_template
from vlmserve.tools import ToolCallDelta, ToolCallStreamParser, parse_tool_calls, select_parser


def call(name: str, **args: str) -> str:
    """A call as GLM's template writes it: strings bare, anything else JSON."""
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


CASES = [
    pytest.param(call("get_weather", location="Tokyo"), WEATHER, "", [("get_weather", {"location": "Tokyo"})],
                 id="basic"),
    pytest.param("<think></think>\n" + call("get_weather", location="Tokyo"), None, "<think></think>",
                 [("get_weather", {"location": "Tokyo"})], id="after-an-empty-thought"),
    pytest.param(call("get_weather", location="Tokyo", days="3"), WEATHER, "",
                 [("get_weather", {"location": "Tokyo", "days": 3})], id="typed-by-schema"),
    pytest.param(call("f", n="3", ok="true", xs="[1, 2]", obj='{"a": "b"}'), None, "",
                 [("f", {"n": 3, "ok": True, "xs": [1, 2], "obj": {"a": "b"}})], id="json-values"),
    pytest.param(call("f", s='"quoted"', note="line one\nline two"), None, "",
                 [("f", {"s": '"quoted"', "note": "line one\nline two"})], id="strings-as-written"),
    pytest.param(call("ping"), None, "", [("ping", {})], id="no-arguments"),
    pytest.param(call("a") + "\n" + call("b", x="1"), None, "", [("a", {}), ("b", {"x": 1})], id="two-calls"),
    pytest.param("<tool_call>f\n<arg_key>q</arg_key>\n<arg_value>hi", None, "", [("f", {"q": "hi"})],
                 id="cut-off-at-the-end"),
    pytest.param(call("rm", path="/"), WEATHER, call("rm", path="/"), [], id="unknown-tool-kept"),
    pytest.param("<tool_call>\n<arg_key>a</arg_key></tool_call>", None, "<tool_call>\n<arg_key>a</arg_key></tool_call>",
                 [], id="no-name-kept"),
    pytest.param('<tool_call>{"name": "f", "arguments": {}}</tool_call>', None,
                 '<tool_call>{"name": "f", "arguments": {}}</tool_call>', [], id="hermes-json-kept"),
]


@pytest.mark.parametrize(("text", "tools", "content", "calls"), CASES)
def test_parse(text: str, tools: list[dict] | None, content: str, calls: list[tuple]) -> None:
    got_content, got_calls = parse_tool_calls(text, tools, "glm")
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_in_pieces_gives_the_same_call(size: int) -> None:
    text = "Let me check.\n" + call("get_weather", location="Tokyo", days="2")
    stream = ToolCallStreamParser("glm", WEATHER)
    events = [e for i in range(0, len(text), size) for e in stream.feed(text[i:i + size])] + stream.finish()
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert calls[0].name == "get_weather"
    assert "".join(c.arguments_json for c in calls) == '{"location": "Tokyo", "days": 2}'


def test_the_template_tells_glm_from_hermes() -> None:
    assert select_parser(published_template("glm-ocr"), "hermes") == "glm"
    assert select_parser(published_template("qwen3-vl-8b-instruct"), "glm") == "hermes"


def test_a_forced_call_is_the_templates_syntax_with_markers_by_id() -> None:
    class Tokenizer:  # the markers are added tokens of their own, as in GLM's tokenizer
        all_special_tokens = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
        added_tokens_decoder: dict = {}

        def convert_tokens_to_ids(self, text: str) -> int:
            return 100 + self.all_special_tokens.index(text)

    grammar = tool_call_lark("glm", WEATHER, Tokenizer())
    assert grammar.startswith("start: <[100]> call <[101]>")
    assert '"get_weather" "\\n" (<[102]> "location" <[103]> "\\n" <[104]> arg_0_0 <[105]> "\\n")' in grammar
    assert '(<[102]> "days" <[103]> "\\n" <[104]> arg_0_2 <[105]> "\\n")?' in grammar  # optional
    assert 'arg_0_1: "celsius" | "fahrenheit"' in grammar and "arg_0_2_json: %json" in grammar  # an integer as JSON


def test_a_reply_thinks_then_calls_through_the_real_output_path() -> None:
    """GLM's template opens no ``<think>``: the model does. Its tokens, detokenized one at a time skipping
    special tokens (the think, tool and argument tags are plain, as GLM's parsers need), give the
    reasoning apart and the call in OpenAI's shape."""
    import json

    reply = "<think>It may rain.</think>\n" + call("get_weather", location="Tokyo", days="2") + "<|observation|>"
    message = reply_message("glm4v", "glm", reply, WEATHER)
    assert message.get("reasoning_content") == "It may rain." and not message.get("content")
    (got,) = message["tool_calls"]
    assert got["function"]["name"] == "get_weather"
    assert json.loads(got["function"]["arguments"]) == {"location": "Tokyo", "days": 2}
