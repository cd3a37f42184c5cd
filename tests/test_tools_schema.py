"""[any] Schema-guided coercion of tool-call arguments, as a table of (value, schema, expected)."""

from __future__ import annotations

from typing import Any

import pytest

from vlmserve.tools import ToolParseError
from vlmserve.tools.schema import check_call, coerce, find_parameters

INT, NUM, BOOL, STR = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"}

COERCE = [
    pytest.param("3", INT, 3, id="int-from-string"),
    pytest.param(" -12 ", INT, -12, id="int-from-padded-string"),
    pytest.param("3.0", INT, 3, id="int-from-integral-float-string"),
    pytest.param(4.0, INT, 4, id="int-from-integral-float"),
    pytest.param("3.5", INT, "3.5", id="int-rejects-fraction"),
    pytest.param(True, INT, True, id="int-rejects-bool"),
    pytest.param("2.5", NUM, 2.5, id="number-from-string"),
    pytest.param("1e3", NUM, 1000.0, id="number-exponent"),
    pytest.param("7", NUM, 7, id="number-keeps-int"),
    pytest.param("seven", NUM, "seven", id="number-rejects-word"),
    pytest.param("true", BOOL, True, id="bool-true"),
    pytest.param("False", BOOL, False, id="bool-false-capital"),
    pytest.param("yes", BOOL, "yes", id="bool-rejects-yes"),
    pytest.param(3, STR, "3", id="string-from-int"),
    pytest.param(2.5, STR, "2.5", id="string-from-float"),
    pytest.param(True, STR, "true", id="string-from-bool"),
    pytest.param({"a": 1}, STR, {"a": 1}, id="string-leaves-object"),
    pytest.param("[1,2]", {"type": "array"}, [1, 2], id="array-from-string"),
    pytest.param("[1,2", {"type": "array"}, "[1,2", id="array-rejects-bad-json"),
    pytest.param(["1", "2"], {"type": "array", "items": INT}, [1, 2], id="array-items"),
    pytest.param('["1"]', {"type": "array", "items": INT}, [1], id="array-from-string-items"),
    pytest.param('{"a":1}', {"type": "object"}, {"a": 1}, id="object-from-string"),
    pytest.param('{"n": "2"}', {"type": "object", "properties": {"n": INT}}, {"n": 2}, id="object-from-string-props"),
    pytest.param({"o": {"n": "2", "s": 5}}, {"properties": {"o": {"properties": {"n": INT, "s": STR}}}},
                 {"o": {"n": 2, "s": "5"}}, id="nested-objects-untyped"),
    pytest.param(3, {"type": ["string", "integer"]}, 3, id="type-list-keeps-own-type"),
    pytest.param("3", {"type": ["integer", "string"]}, "3", id="type-list-string-already-fits"),
    pytest.param("4", {"type": ["integer", "null"]}, 4, id="type-list-converts"),
    pytest.param("5", {"anyOf": [INT, {"type": "null"}]}, 5, id="anyof-optional-int"),
    pytest.param(None, {"anyOf": [INT, {"type": "null"}]}, None, id="anyof-null"),
    pytest.param("x", {}, "x", id="no-type"),
    pytest.param("3", {"type": "nonsense"}, "3", id="unknown-type"),
]


@pytest.mark.parametrize(("value", "schema", "expected"), COERCE)
def test_coerce(value: Any, schema: dict, expected: Any) -> None:
    got = coerce(value, schema)
    assert got == expected
    assert type(got) is type(expected)


TOOLS = [
    {"type": "function", "function": {"name": "ping"}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": INT, "b": NUM, "tags": {"type": "array", "items": STR}}}}},
]


@pytest.mark.parametrize(
    ("name", "arguments", "tools", "expected"),
    [
        ("add", {"a": "1", "b": "2.5", "tags": [1, True], "extra": "7"}, TOOLS,
         {"a": 1, "b": 2.5, "tags": ["1", "true"], "extra": "7"}),
        ("ping", {"x": "1"}, TOOLS, {"x": "1"}),
        ("anything", {"a": "1"}, None, {"a": "1"}),
    ],
)
def test_check_call(name: str, arguments: dict, tools: list[dict] | None, expected: dict) -> None:
    assert check_call(name, arguments, tools) == expected


@pytest.mark.parametrize("tools", [TOOLS, [], [{"function": "junk"}, "junk"]])
def test_unknown_tool_raises_parse_error(tools: list) -> None:
    with pytest.raises(ToolParseError, match="unknown tool 'nope'"):
        check_call("nope", {}, tools)


def test_find_parameters() -> None:
    assert find_parameters(TOOLS, "ping") == {}
    assert find_parameters(TOOLS, "add")["properties"]["a"] == INT
    assert find_parameters(TOOLS, "nope") is None
