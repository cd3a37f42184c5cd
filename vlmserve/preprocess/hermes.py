"""[pool] Tool use written as plain turns, as Qwen2.5's template writes it (Hermes style): for chat templates
that ignore ``tools`` or drop earlier calls and results."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# The system text that offers tools, as Qwen2.5's template writes it
HERMES_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tools_preamble(tools: Sequence[dict[str, Any]]) -> str:
    """The system text that offers ``tools`` to a model whose template has no tool syntax."""
    return HERMES_TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))


def hermes_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier tool calls and results as plain turns (Qwen2.5's rendering), for templates that drop them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_hermes_call(c["function"]) for c in m["tool_calls"])
            text = text_of(m.get("content"))
            out.append({"role": "assistant", "content": f"{text}\n{calls}".strip()})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{text_of(m.get('content'))}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("from_tool"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response, "from_tool": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "from_tool"} for m in out]


def _hermes_call(function: dict[str, Any]) -> str:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    return "<tool_call>\n" + json.dumps({"name": function["name"], "arguments": arguments}) + "\n</tool_call>"


def text_of(content: Any) -> str:
    """The text of a message's content, string or parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""
