"""[any] Gemma 4 tool calls: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`.

Quantized Gemma 4 often drifts from its own syntax: single- or double-quoted
strings, bare words, quoted keys, trailing commas, a missing final delimiter.
A small recursive-descent reader accepts those and returns what the model meant;
text between correct `<|"|>` delimiters is always kept to the letter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vlmserve.tools.base import JSONObject, RawCall, ToolFormat, ToolParseError, parse_number

START = "<|tool_call>"
END = "<tool_call|>"
QUOTE = '<|"|>'

# MCP and agent frameworks namespace their tools: mcp__server__tool, a.b:c, my-tool.
_NAME = re.compile(r"[\w.:/-]+")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None}
_LITERALS |= {"True": True, "False": False, "None": None}  # Python's spelling, seen in the wild
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}
_VALUE_END = ",}]"
_MAX_DEPTH = 64  # deeper than any real call; keeps garbage from reaching RecursionError


def parse_body(body: str) -> list[RawCall]:
    """Every `call:NAME{...}` between one pair of markers; ToolParseError if any is unreadable."""
    calls: list[RawCall] = []
    pos = _skip_space(body, 0)
    while pos < len(body):
        name, pos = _read_name(body, pos)
        reader = _ArgsReader(body, pos)
        calls.append((name, reader.read_object()))
        pos = _skip_space(body, reader.pos)
    if not calls:
        raise ToolParseError("empty tool call")
    return calls


def _read_name(text: str, pos: int) -> tuple[str, int]:
    brace = text.find("{", pos)
    name = text[pos:brace].strip().removeprefix("call:").strip()
    if brace < 0 or not _NAME.fullmatch(name):
        raise ToolParseError(f"no call:NAME{{ at {text[pos:pos + 40]!r}")
    return name, brace


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


@dataclass(slots=True)
class _ArgsReader:
    """Reads one `{...}` argument object at `pos`; every branch consumes text or raises."""

    text: str
    pos: int
    # The closing characters of the containers now open, innermost last.
    closers: list[str] = field(default_factory=list)

    def read_object(self) -> JSONObject:
        self._open("}")
        out: JSONObject = {}
        while self._peek() not in ("}", ""):
            key = self._key()
            if self._peek() != ":":
                raise ToolParseError(f"expected ':' after key {key!r}")
            self.pos += 1
            out[key] = self._value()
            self._separator("}")
        self._close()
        return out

    def _array(self) -> list[Any]:
        self._open("]")
        out: list[Any] = []
        while self._peek() not in ("]", ""):
            out.append(self._value())
            self._separator("]")
        self._close()
        return out

    def _key(self) -> str:
        key = self._string(":")
        return key if key is not None else self._bare(":,{}[]")

    def _value(self) -> Any:
        if (text := self._string(_VALUE_END)) is not None:
            return text
        ch = self._peek()
        if ch == "{":
            return self.read_object()
        if ch == "[":
            return self._array()
        word = self._bare(_VALUE_END)
        number = parse_number(word)
        return number if number is not None else _LITERALS.get(word, word)

    def _string(self, closers: str) -> str | None:
        """The string at `pos` in any of the three quotings, or None if none starts here."""
        ch = self._peek()
        if self.text.startswith(QUOTE, self.pos):
            return self._delimited()
        return self._quoted(ch, closers) if ch in ("'", '"') else None

    def _delimited(self) -> str:
        start = self.pos + len(QUOTE)
        end = self.text.find(QUOTE, start)
        if end < 0:
            return self._unclosed(self.text[start:])
        self.pos = end + len(QUOTE)
        return self.text[start:end]

    def _quoted(self, quote: str, closers: str) -> str:
        """A '...' or "..." string; a quote closes it only where a closer follows, so it's stays whole."""
        chars: list[str] = []
        self.pos += 1
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            if ch == "\\" and self.pos < len(self.text):
                chars.append(self._escape())
            elif ch == quote and self._closes(closers):
                return "".join(chars)
            else:
                chars.append(ch)
        return self._unclosed("".join(chars))

    def _escape(self) -> str:
        ch = self.text[self.pos]
        self.pos += 1
        hex4 = self.text[self.pos : self.pos + 4]
        if ch == "u" and len(hex4) == 4 and all(c in "0123456789abcdefABCDEF" for c in hex4):
            self.pos += 4
            return chr(int(hex4, 16))
        # An unknown escape keeps its backslash: C:\Users stays C:\Users.
        return _ESCAPES.get(ch, ch if ch in "\\/'\"" else "\\" + ch)

    def _unclosed(self, rest: str) -> str:
        """A string missing its closing delimiter runs to the end, less the containers' closers."""
        self.pos = len(self.text)
        for closer in self.closers:  # outermost first: its closer stands last
            rest = rest.rstrip().removesuffix(closer)
        return rest.rstrip()

    def _bare(self, stops: str) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in stops:
            self.pos += 1
        word = self.text[start : self.pos].strip()
        if not word:
            raise ToolParseError(f"empty key or value at offset {start}")
        return word

    def _closes(self, closers: str) -> bool:
        after = _skip_space(self.text, self.pos)
        return after == len(self.text) or self.text[after] in closers

    def _separator(self, closer: str) -> None:
        ch = self._peek()
        if ch == ",":
            self.pos += 1
        elif ch not in (closer, ""):
            raise ToolParseError(f"expected ',' or {closer!r}, got {ch!r}")

    def _open(self, closer: str) -> None:
        if len(self.closers) >= _MAX_DEPTH:
            raise ToolParseError("arguments nested too deep")
        self.closers.append(closer)
        self.pos += 1

    def _close(self) -> None:
        # At the end of the text the container closes anyway: the model forgot its brace.
        if self._peek() == self.closers.pop():
            self.pos += 1

    def _peek(self) -> str:
        self.pos = _skip_space(self.text, self.pos)
        return self.text[self.pos] if self.pos < len(self.text) else ""


FORMAT = ToolFormat(name="gemma4", start=START, end=END, parse_body=parse_body)
