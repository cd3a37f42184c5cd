"""[pool] ``tool_choice`` required or named, as a Lark grammar over the model's own tool-call syntax.

- Hermes (Qwen, and every template vlmserve writes tools for): ``<tool_call>`` a JSON object with
  ``name`` and ``arguments`` (the tool's schema, via llguidance's ``%json``) ``</tool_call>``;
- Mistral: ``[TOOL_CALLS]NAME[ARGS]{json}`` (3.2), or ``[TOOL_CALLS][{"name", "arguments"}]`` (3.1,
  whose tokenizer has no ``[ARGS]``);
- GLM-4.5V/4.6V: ``<tool_call>NAME`` then ``\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>`` per
  argument, ``\n</tool_call>``: strings as they are, other values JSON (the tool's schema, via ``%json``);
- Kimi: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>`` then
  the arguments (the tool's schema, via ``%json``) ``<|tool_call_end|><|tool_calls_section_end|>``;
- Llama 4: ``<|python_start|><|python_end|>`` then ``{"name": NAME, "parameters": {json}}`` (the tool's schema);
- Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` in Gemma's own argument syntax:
  properties in the schema's order, required ones first; strings quoted with ``<|"|>`` or, as
  quantized Gemma 4 often writes them, with ``'`` or ``"`` (the parser repairs those).

A marker that is one added token of the tokenizer is written by id (``<[id]>``): llguidance never
matches added tokens against text.
"""

from __future__ import annotations

import json
from typing import Any

from vlmserve.preprocess.json_schema import tidy_json
from vlmserve.tools import gemma4, glm, hermes, kimi, llama4, mistral
from vlmserve.tools.registry import ALIASES

_NUMBER = r"/-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][+-]?[0-9]{1,3})?/"  # bounded: no endless digits
_INTEGER = r"/-?(0|[1-9][0-9]{0,17})/"
_LARGEST = 10**18 - 1  # the unbounded integer's 18 digits
_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ANY, _NOT_SQ, _NOT_DQ = r"[^\n]", r"[^'\n]", r"[^\"\n]"  # a string's characters, in each quoting
_FORMATS = {  # JSON schema's string formats, as regular expressions
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})?",
    "date-time": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
                 r"(\.[0-9]{1,9})?(Z|[+-][0-9]{2}:[0-9]{2})?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63}){1,8}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
}


def string_regex(schema: dict[str, Any], char: str) -> str | None:
    """A string value's characters as a regular expression (``char``: any one of them), from its
    ``pattern``, its ``format`` or its length bounds; None when the schema sets none of them."""
    pattern, fmt = schema.get("pattern"), schema.get("format")
    if isinstance(pattern, str) and pattern:  # a search, as JSON schema means it, unless anchored
        anchored_start = pattern.startswith("^")
        anchored_end = pattern.endswith("$") and not pattern.endswith("\\$")
        core = pattern[1 if anchored_start else 0: len(pattern) - 1 if anchored_end else len(pattern)]
        body = ("" if anchored_start else f"{char}*") + f"({core})" + ("" if anchored_end else f"{char}*")
        return body.replace("/", "\\/")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        return f"{char}{{{max(0, low or 0)},{high if isinstance(high, int) else ''}}}"
    return None


def tool_call_lark(fmt: str, tools: list[dict[str, Any]], tokenizer: Any) -> str:
    """The grammar of exactly one call to one of ``tools`` (chat-format tool definitions)."""
    fmt = ALIASES.get(fmt, fmt)
    functions = [t["function"] for t in tools]
    writer = {"hermes": _hermes, "mistral": _mistral, "gemma4": _gemma4, "glm": _glm, "llama4": _llama4,
              "kimi": _kimi}.get(fmt)
    if writer is None:
        raise ValueError(f"no grammar for the tool-call format {fmt!r}")
    return writer(functions, _Markers(tokenizer))


def marker(tokenizer: Any, text: str) -> str:
    """``text`` in a Lark grammar: by token id if it is one special token, else as a string."""
    return _Markers(tokenizer)(text)


class _Markers:
    """Added tokens, special or not (Qwen's ``<tool_call>`` is not), are referenced by id: llguidance
    reads every added token as a token of its own, never as the text it spells (measured: a grammar
    with the text ``"<tool_call>"`` allowed the token, then refused it when it came)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_tokens", None) or ())
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special |= {t.content for t in decoder.values()}

    def has(self, text: str) -> bool:
        return text in self.special

    def __call__(self, text: str) -> str:
        if text in self.special:
            return f"<[{self.tokenizer.convert_tokens_to_ids(text)}]>"
        return json.dumps(text)


def _schema(function: dict[str, Any]) -> str:
    return json.dumps(tidy_json(function.get("parameters") or {"type": "object"}))


def _choice(rules: list[str]) -> str:
    return " | ".join(rules)


def _hermes(functions: list[dict[str, Any]], mark: _Markers) -> str:
    return _json_calls(functions, f'start: {mark(hermes.START)} "\\n" call "\\n" {mark(hermes.END)}', "arguments")


def _llama4(functions: list[dict[str, Any]], mark: _Markers) -> str:
    return _json_calls(functions, f"start: {mark(llama4.START)} {mark(llama4.CONTENT_END)} call", "parameters")


def _json_calls(functions: list[dict[str, Any]], start: str, arguments: str) -> str:
    """``start``'s call: one JSON object ``{"name": NAME, "<arguments>": {...}}`` (the tool's schema)."""
    lines = [start, f"call: {_choice([f'call_{i}' for i in range(len(functions))])}"]
    for i, f in enumerate(functions):
        head = json.dumps('{"name": ' + json.dumps(f["name"]) + f', "{arguments}": ')
        lines.append(f'call_{i}: {head} args_{i} "}}"')
        lines.append(f"args_{i}: %json {_schema(f)}")
    return "\n".join(lines)


def _kimi(functions: list[dict[str, Any]], mark: _Markers) -> str:
    lines = [f"start: {mark(kimi.START)} {mark(kimi.CALL)} call {mark(kimi.END_CALL)} {mark(kimi.END)}",
             f"call: {_choice([f'call_{i}' for i in range(len(functions))])}"]
    for i, f in enumerate(functions):
        lines.append(f"call_{i}: {json.dumps(kimi.call_id(f['name'], 0))} {mark(kimi.ARGUMENTS)} args_{i}")
        lines.append(f"args_{i}: %json {_schema(f)}")
    return "\n".join(lines)


def _mistral(functions: list[dict[str, Any]], mark: _Markers) -> str:
    lines = [f"start: {mark(mistral.START)} call", f"call: {_choice([f'call_{i}' for i in range(len(functions))])}"]
    for i, f in enumerate(functions):
        if mark.has("[ARGS]"):
            lines.append(f"call_{i}: {json.dumps(f['name'])} {mark('[ARGS]')} args_{i}")
        else:
            head = json.dumps('[{"name": ' + json.dumps(f["name"]) + ', "arguments": ')
            lines.append(f'call_{i}: {head} args_{i} "}}]"')
        lines.append(f"args_{i}: %json {_schema(f)}")
    return "\n".join(lines)


def _gemma4(functions: list[dict[str, Any]], mark: _Markers) -> str:
    writer = _GemmaArgs(mark)
    calls = [f'"call:" {json.dumps(f["name"])} {writer.value(f.get("parameters") or {"type": "object"})}'
             for f in functions]
    lines = [f"start: {mark(gemma4.START)} call {mark(gemma4.END)}", f"call: {_choice([f'({c})' for c in calls])}"]
    return "\n".join(lines + writer.rules)


def _glm(functions: list[dict[str, Any]], mark: _Markers) -> str:
    """Each call's arguments as key/value pairs in the schema's order, required ones first (optional ones
    may be left out), as GLM's template writes them."""
    lines = [f"start: {mark(glm.START)} call {mark(glm.END)}", f"call: {_choice([f'call_{i}' for i in range(len(functions))])}"]
    for i, f in enumerate(functions):
        schema = f.get("parameters") or {}
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        pairs = []
        for j, key in enumerate([*(k for k in props if k in required), *(k for k in props if k not in required)]):
            lines.append(f"arg_{i}_{j}: {_glm_value(props[key], f'arg_{i}_{j}', lines)}")
            pair = f'{mark(glm.KEY)} {json.dumps(key)} {mark(glm.END_KEY)} "\\n" {mark(glm.VALUE)} arg_{i}_{j} ' \
                   f'{mark(glm.END_VALUE)} "\\n"'
            pairs.append(f"({pair})" + ("" if key in required else "?"))
        lines.append(f'call_{i}: {json.dumps(f["name"])} "\\n" {" ".join(pairs)}'.rstrip())
    return "\n".join(lines)


def _glm_value(schema: dict[str, Any], name: str, lines: list[str]) -> str:
    """A string as the model writes it (one line, bounded as the schema says), an enum of strings as one
    of its words, anything else as JSON."""
    if "enum" in schema and all(isinstance(e, str) for e in schema["enum"]):
        return _choice([json.dumps(e) for e in schema["enum"]])
    if schema.get("type") == "string":
        return f"/{string_regex(schema, _ANY) or _ANY + '*'}/"
    lines.append(f"{name}_json: %json {json.dumps(tidy_json(schema))}")
    return f"{name}_json"


class _GemmaArgs:
    """JSON schema -> Gemma 4 argument grammar: bare keys, ``<|"|>``-quoted strings."""

    def __init__(self, mark: _Markers) -> None:
        q = mark(gemma4.QUOTE)
        self.rules = [f"gstr: {q} /[^\\n]*/ {q} | \"'\" /[^'\\n]*/ \"'\" | \"\\\"\" /[^\\\"\\n]*/ \"\\\"\""]
        self.quote = q

    def value(self, schema: dict[str, Any], depth: int = 0) -> str:
        kind = schema.get("type")
        if "enum" in schema and all(isinstance(e, str) for e in schema["enum"]):
            words = _choice([json.dumps(e) for e in schema["enum"]])
            return f"({self.quote} ({words}) {self.quote} | \"'\" ({words}) \"'\")"
        if kind == "object" and depth < 8:
            return self._object(schema, depth)
        if kind == "array" and depth < 8:
            item = self.value(schema.get("items") or {"type": "string"}, depth + 1)
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind in ("integer", "number"):
            return self._number(schema, kind)
        if kind == "boolean":
            return '("true" | "false")'
        return self._string(schema)

    def _number(self, schema: dict[str, Any], kind: str) -> str:
        """A bare number, as Gemma writes it and JSON does. Bounds (``minimum``, ``maximum``, their
        exclusive forms, ``multipleOf``) go through llguidance's JSON number grammar, as in
        ``response_format``, in a rule of their own. Its digits are capped as the unbounded number's
        are, so that a model cannot write digits for ever: an open side gets the 18-digit bound, and a
        number without ``multipleOf`` at most 6 decimals (``multipleOf: 1e-6``)."""
        bounds = {k: schema[k] for k in _NUMERIC_BOUNDS if isinstance(schema.get(k), (int, float))
                  and not isinstance(schema.get(k), bool)}
        if not bounds:
            return _INTEGER if kind == "integer" else _NUMBER
        if not {"minimum", "exclusiveMinimum"} & set(bounds):
            bounds["minimum"] = -_LARGEST
        if not {"maximum", "exclusiveMaximum"} & set(bounds):
            bounds["maximum"] = _LARGEST
        if kind == "number":
            bounds.setdefault("multipleOf", 1e-6)
        name = f"gnum{len(self.rules)}"
        self.rules.append(f"{name}: %json {json.dumps({'type': kind, **bounds})}")
        return name

    def _string(self, schema: dict[str, Any]) -> str:
        """``gstr``, or a rule of its own for a string the schema bounds (``minLength``/``maxLength``,
        ``pattern``, ``format``), in each of the three quotings: what ``response_format`` enforces."""
        if string_regex(schema, _ANY) is None:
            return "gstr"
        name = f"gstr{len(self.rules)}"
        q, any_, single, double = self.quote, string_regex(schema, _ANY), string_regex(schema, _NOT_SQ), \
            string_regex(schema, _NOT_DQ)
        self.rules.append(name + ": " + q + " /" + str(any_) + "/ " + q + ' | "\'" /' + str(single) + '/ "\'"'
                          + ' | "\\"" /' + str(double) + '/ "\\""')
        return name

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        props = schema.get("properties") or {}
        required = [k for k in props if k in set(schema.get("required") or ())]
        pairs = [(f"{json.dumps(k + ':')} {self.value(props[k], depth + 1)}", k in required)
                 for k in [*required, *(k for k in props if k not in required)]]
        if not pairs:
            return '"{" "}"'
        (head, head_required), rest = pairs[0], pairs[1:]
        tail = " ".join(f'("," {p})' + ("" if req else "?") for p, req in rest)
        body = f"{head} {tail}".strip()
        return f'"{{" {body if head_required else f"({body})?"} "}}"'
