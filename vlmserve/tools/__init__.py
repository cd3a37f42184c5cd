"""[any] Tool-call parsers, one module per format, and the streaming splitter the frontend uses.

    content, calls = parse_tool_calls(text, tools, "gemma4")
    stream = ToolCallStreamParser("hermes", tools); stream.feed(delta) ... stream.finish()
"""

from vlmserve.tools.base import (
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolFormat,
    ToolParseError,
)
from vlmserve.tools.registry import ALIASES, PARSERS, get_format, select_parser
from vlmserve.tools.streaming import ToolCallStreamParser, parse_tool_calls

__all__ = [
    "ALIASES",
    "PARSERS",
    "ContentDelta",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamParser",
    "ToolFormat",
    "ToolParseError",
    "get_format",
    "parse_tool_calls",
    "select_parser",
]
