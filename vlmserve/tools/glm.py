"""[any] GLM-4.5 / GLM-4.5V / GLM-4.6V tool calls: the name, then one key and value per argument.

    <tool_call>get_weather
    <arg_key>location</arg_key>
    <arg_value>Tokyo</arg_value>
    </tool_call>

The template writes a string value as it is and any other value as JSON (``tojson``); so a value is
read back as JSON where it is JSON and as text otherwise, and the tool's schema types it after that.
The markers are Hermes's, so a template is told from Hermes's by ``<arg_key>`` (``SIGNATURE``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from vlmserve.tools.base import RawCall, ToolFormat, ToolParseError

START = "<tool_call>"
END = "</tool_call>"
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
SIGNATURE = KEY

_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|\Z)", re.S)


def parse_body(body: str) -> list[RawCall]:
    """One call: its name up to the first ``<arg_key>`` (or the end), then its key/value pairs."""
    name, _, rest = body.partition(KEY)
    name = name.strip()
    if not name or "\n" in name or "{" in name:
        raise ToolParseError("a GLM tool call is NAME, then <arg_key>K</arg_key><arg_value>V</arg_value> pairs")
    pairs = _ARGUMENT.findall(KEY + rest) if rest else []
    if rest and not pairs:
        raise ToolParseError("a GLM argument is <arg_key>K</arg_key> then <arg_value>V</arg_value>")
    return [(name, {key.strip(): _value(value) for key, value in pairs})]


def _value(text: str) -> Any:
    """JSON where the template wrote JSON (numbers, booleans, objects, lists), else the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if not isinstance(value, str) else text


FORMAT = ToolFormat(name="glm", start=START, end=END, parse_body=parse_body, signature=SIGNATURE)
