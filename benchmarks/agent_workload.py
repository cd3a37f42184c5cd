"""[main] A coding agent's session, replayed: system prompt, 30 tools, one tool call and result more per turn.

``build_session`` writes a deterministic session sized in the model's own tokens: the system prompt and
the tool list come to about ``first`` tokens (Claude Code's are ~25K), and each of the ``turns - 1`` tool
rounds adds about ``(last - first) / (turns - 1)``: file contents, grep hits, test logs, git output and
web pages, with three screenshots (synthetic PNG drawings of an app) in early, middle and late results.
``messages_request`` and ``responses_request`` shape turn ``t`` (1-based: the task, then ``t - 1`` rounds)
as Claude Code sends it to the Messages API and as Codex sends it to the Responses API.
"""

from __future__ import annotations

import base64
import io
import json
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageDraw

Count = Callable[[str], int]  # tokens of a text, in the model's tokenizer

_S, _I, _B, _A = "string", "integer", "boolean", "array"
# (name, description, {param: (type, description)}, required): Claude Code's and Codex's kinds of tools
TOOLS: tuple[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]], ...] = (
    ("read_file", "Reads a file from the local filesystem, with line numbers, from an offset.",
     {"file_path": (_S, "The absolute path to the file"), "offset": (_I, "The line to start at"),
      "limit": (_I, "The number of lines to read")}, ("file_path",)),
    ("write_file", "Writes a file, replacing it if it exists.", {"file_path": (_S, "The absolute path"),
     "content": (_S, "The content to write")}, ("file_path", "content")),
    ("edit", "Replaces exact text in a file; old_string must be unique unless replace_all.",
     {"file_path": (_S, "The file"), "old_string": (_S, "The text to replace"), "new_string": (_S, "The new text"),
      "replace_all": (_B, "Replace every occurrence")}, ("file_path", "old_string", "new_string")),
    ("multi_edit", "Several edits to one file, applied in order, all or none.", {"file_path": (_S, "The file"),
     "edits": (_A, "Objects with old_string and new_string")}, ("file_path", "edits")),
    ("glob", "Finds files by a glob pattern such as src/**/*.py, newest first.", {"pattern": (_S, "The pattern"),
     "path": (_S, "The directory to search")}, ("pattern",)),
    ("grep", "Searches file contents with a regular expression (ripgrep syntax).", {"pattern": (_S, "The regex"),
     "path": (_S, "File or directory"), "glob": (_S, "Only files matching"), "context": (_I, "Lines around a hit"),
     "case_insensitive": (_B, "Ignore case")}, ("pattern",)),
    ("ls", "Lists a directory.", {"path": (_S, "The absolute path"), "ignore": (_A, "Globs to leave out")}, ("path",)),
    ("bash", "Runs a shell command in a persistent shell, with a timeout; quote paths with spaces.",
     {"command": (_S, "The command"), "timeout": (_I, "Milliseconds, at most 600000"),
      "description": (_S, "What it does, in 5-10 words"), "run_in_background": (_B, "Do not wait")}, ("command",)),
    ("bash_output", "Reads new output of a background shell.", {"shell_id": (_S, "The shell"),
     "filter": (_S, "A regex the lines must match")}, ("shell_id",)),
    ("kill_shell", "Stops a background shell.", {"shell_id": (_S, "The shell")}, ("shell_id",)),
    ("notebook_read", "Reads a Jupyter notebook's cells and outputs.", {"notebook_path": (_S, "The notebook")},
     ("notebook_path",)),
    ("notebook_edit", "Replaces, inserts or deletes one notebook cell.", {"notebook_path": (_S, "The notebook"),
     "cell_id": (_S, "The cell"), "new_source": (_S, "Its new source"), "edit_mode": (_S, "replace|insert|delete")},
     ("notebook_path", "new_source")),
    ("web_fetch", "Fetches a URL and answers a prompt about its content, as markdown.", {"url": (_S, "The URL"),
     "prompt": (_S, "What to extract")}, ("url", "prompt")),
    ("web_search", "Searches the web; results with titles, links and snippets.", {"query": (_S, "The query"),
     "allowed_domains": (_A, "Only these domains")}, ("query",)),
    ("todo_write", "Writes the session's task list: content, status and active form of each item.",
     {"todos": (_A, "The whole list")}, ("todos",)),
    ("task", "Starts a sub-agent for a multi-step search or task; it answers once, at the end.",
     {"description": (_S, "3-5 words"), "prompt": (_S, "The task"), "subagent_type": (_S, "Which agent")},
     ("description", "prompt")),
    ("exit_plan_mode", "Presents the plan for approval before editing.", {"plan": (_S, "The plan, markdown")},
     ("plan",)),
    ("apply_patch", "Applies a patch in the V4A diff format to files in the workspace.",
     {"input": (_S, "The whole patch")}, ("input",)),
    ("update_plan", "Updates the plan: steps and each step's status.", {"explanation": (_S, "Why"),
     "plan": (_A, "Objects with step and status")}, ("plan",)),
    ("view_image", "Attaches a local image to the conversation.", {"path": (_S, "The image file")}, ("path",)),
    ("screenshot", "Takes a screenshot of the app under development in the browser.",
     {"url": (_S, "The page"), "full_page": (_B, "Whole page, not the viewport")}, ("url",)),
    ("browser_click", "Clicks an element of the page by its CSS selector.", {"selector": (_S, "The element")},
     ("selector",)),
    ("browser_type", "Types text into an element of the page.", {"selector": (_S, "The element"),
     "text": (_S, "The text"), "submit": (_B, "Press Enter after")}, ("selector", "text")),
    ("run_tests", "Runs the test suite or one test file and returns the log.", {"target": (_S, "A path or node id"),
     "verbose": (_B, "Show each test")}, ()),
    ("git_diff", "Shows the working tree's changes.", {"path": (_S, "Limit to a path"),
     "staged": (_B, "Only staged changes")}, ()),
    ("git_log", "Shows recent commits.", {"count": (_I, "How many"), "path": (_S, "Only commits touching it")}, ()),
    ("search_symbols", "Finds where a function, class or variable is defined and used.",
     {"name": (_S, "The symbol"), "kind": (_S, "function|class|variable")}, ("name",)),
    ("diagnostics", "Returns the language server's errors and warnings for a file.", {"file_path": (_S, "The file")},
     ("file_path",)),
    ("ask_user", "Asks the user a question and waits for the answer.", {"question": (_S, "The question"),
     "options": (_A, "Suggested answers")}, ("question",)),
    ("memory_write", "Saves a fact about the project to the agent's memory file.", {"fact": (_S, "The fact")},
     ("fact",)),
)  # fmt: skip
NOTES = ("Prefer this tool over a shell command that does the same.", "Paths are absolute; relative paths are refused.",
         "Never use it to guess at files you have not read in this session.", "Long outputs are cut to 30000 characters.",
         "Batch independent calls in one message when you can.", "It fails if the user has denied it in settings.",
         "Report its errors to the user verbatim; do not retry blindly.", "Results may be stale after an edit: read again.")  # fmt: skip
RULES = ("You are an interactive agent that helps users with software engineering tasks in their repository.",
         "Be concise: answer in fewer than four lines unless the user asks for detail.",
         "Follow the codebase's conventions; read surrounding code before you change it.",
         "Never commit unless the user asks; never push to a remote.", "Run the tests after every change you make.",
         "Use the task list for any work of three steps or more, and keep exactly one step in progress.",
         "Refuse to write code that could be used maliciously, even for education.",
         "When a command fails, read its output before you try another.",
         "Never introduce code that logs or exposes secrets and keys.", "Do not add comments unless asked.")  # fmt: skip
WORDS = ("config", "parser", "session", "cache", "token", "router", "worker", "request", "schema", "client",
         "handler", "queue", "buffer", "stream", "engine", "loader", "plugin", "record", "policy", "index")  # fmt: skip
SEQUENCE = ("grep", "read_file", "read_file", "search_symbols", "edit", "run_tests", "git_diff", "bash", "glob",
            "web_fetch")  # the calls a round makes, in turn; screenshots where SCREEN_AT says
SCREEN_AT = (0.1, 0.5, 0.875)  # of the rounds: early, middle, late
ROUND_MARKERS = 50  # tokens a round costs besides its words: the call's JSON keys, the turns' and results' markers


@dataclass(slots=True)
class Round:
    """One tool call and its result."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    thought: str  # the assistant's words before the call
    result: str
    screenshot: bytes | None = None  # a PNG inside the result


@dataclass(slots=True)
class Session:
    system: str
    tools: list[dict[str, Any]]  # Anthropic's shape: name, description, input_schema
    task: str
    rounds: list[Round] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.rounds) + 1


def tool_list(notes: int, compact: bool = False) -> list[dict[str, Any]]:
    """The 30 tools, each description with ``notes`` usage notes more (the scale's knob); ``compact``: no
    parameter descriptions, for prompts too short to hold the whole list (~2,100 tokens against ~2,800)."""
    out = []
    for i, (name, text, params, required) in enumerate(TOOLS):
        extra = " ".join(NOTES[(i + k) % len(NOTES)] + f" ({k + 1})" for k in range(notes))
        props = {p: {"type": t, **({} if compact else {"description": d}),
                     **({"items": {"type": "object"}} if t == _A else {})} for p, (t, d) in params.items()}
        schema = {"type": "object", "properties": props, "required": list(required)}
        if not compact:
            schema["additionalProperties"] = False
        out.append({"name": name, "description": f"{text} {extra}".strip(), "input_schema": schema})
    return out


def system_prompt(count: Count, tokens: int, intro: str) -> str:
    """``intro`` then numbered rule sections until the text holds ``tokens``."""
    parts, total, k = [intro], count(intro), 0
    while total < tokens:
        part = f"\n\n## Rule {k + 1}\n" + " ".join(RULES[(k + j) % len(RULES)] for j in range(3))
        parts.append(part)
        total += count(part)
        k += 1
    return "".join(parts)


def _lines(kind: str, rng: random.Random) -> str:
    """One line of a tool result of this kind: code, grep hits, a test log, git output, a web page."""
    w, n = rng.choice(WORDS), rng.randrange(1, 400)
    if kind in ("read_file", "edit"):
        return rng.choice((f"def load_{w}(path: str, retries: int = {n % 7}) -> dict:",
                           f"    value = settings.get('{w}_{n}', DEFAULTS['{w}'])",
                           f"    if not {w}: raise ValueError(f'missing {w}: {{path}}')",
                           f"class {w.title()}Store:  # keeps {n} entries at most", f"    return self._{w}[{n}:]"))
    if kind in ("grep", "search_symbols", "glob"):
        return f"src/app/{w}/{rng.choice(WORDS)}.py:{n}:    {w}_{rng.choice(WORDS)} = resolve({w!r}, limit={n})"
    if kind in ("run_tests", "bash"):
        status = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"))
        return f"tests/test_{w}.py::test_{rng.choice(WORDS)}_{n} {status} [{n % 100:3d}%]"
    if kind == "git_diff":
        return rng.choice((f"@@ -{n},7 +{n},9 @@ def {w}():", f"-    {w} = old_{w}({n})",
                           f"+    {w} = new_{w}({n}, strict=True)"))
    return f"The {w} option sets how many {rng.choice(WORDS)}s the {rng.choice(WORDS)} keeps ({n} by default)."


def _result(count: Count, kind: str, tokens: int, rng: random.Random) -> str:
    lines, total = [], 0
    while total < tokens:
        line = _lines(kind, rng)
        lines.append(line)
        total += count(line) + 1
    return "\n".join(lines)


def _arguments(name: str, rng: random.Random) -> dict[str, Any]:
    w, n = rng.choice(WORDS), rng.randrange(1, 400)
    return {"grep": {"pattern": f"def .*{w}", "path": "src/"}, "read_file": {"file_path": f"/repo/src/app/{w}.py"},
            "search_symbols": {"name": f"load_{w}"}, "run_tests": {"target": f"tests/test_{w}.py"},
            "edit": {"file_path": f"/repo/src/app/{w}.py", "old_string": f"retries = {n}", "new_string": f"retries = {n + 1}"},
            "git_diff": {"path": "src/"}, "bash": {"command": f"python -m pytest -x -q tests/test_{w}.py"},
            "glob": {"pattern": f"src/**/*{w}*.py"}, "web_fetch": {"url": f"https://docs.example.org/{w}", "prompt": "options"},
            "screenshot": {"url": f"http://localhost:3000/{w}"}}.get(name, {})  # fmt: skip


def screenshot(seed: int, size: tuple[int, int] = (640, 400)) -> bytes:
    """A PNG drawing of a web app: header, sidebar, cards, buttons and lines of text, distinct per seed."""
    rng = random.Random(seed)
    image = Image.new("RGB", size, (248, 248, 250))
    draw = ImageDraw.Draw(image)
    w, h = size
    draw.rectangle((0, 0, w, 48), fill=tuple(rng.randrange(40, 120) for _ in range(3)))
    draw.text((16, 16), f"Dashboard {seed}", fill="white")
    draw.rectangle((0, 48, 150, h), fill=(230, 232, 236))
    for i in range(8):
        draw.text((16, 64 + 28 * i), rng.choice(WORDS).title(), fill=(60, 60, 60))
    for i in range(rng.randrange(3, 7)):
        x, y = 170 + (i % 3) * 155, 70 + (i // 3) * 150
        draw.rounded_rectangle((x, y, x + 140, y + 130), 8, outline=(200, 200, 210), fill="white")
        draw.text((x + 10, y + 10), f"{rng.choice(WORDS)}: {rng.randrange(1000)}", fill=(30, 30, 30))
        draw.rectangle((x + 10, y + 90, x + 80, y + 115), fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _tools_for(count: Count, first: int) -> list[dict[str, Any]]:
    """Tools that take ~3/4 of the first prompt, as Claude Code's 30 do (the system prompt the rest); at
    least the compact list, whatever ``first`` says."""
    size = lambda tools: sum(count(json.dumps(t)) for t in tools)  # noqa: E731 - a local measure
    base = size(tool_list(0))
    if 0.75 * first < base:
        return tool_list(0, compact=True)
    per_note = max(1, (size(tool_list(1)) - base) // len(TOOLS))
    return tool_list(int(0.75 * first - base) // (per_note * len(TOOLS)))


def build_session(count: Count, first: int, last: int, turns: int = 40, seed: int = 0, screenshots: bool = False,
                  intro: str = RULES[0], rotate: int = 0) -> Session:
    """A session whose first prompt is ~``first`` tokens and whose ``turns``-th is ~``last``; ``rotate`` the
    tool list's order (another agent's list: its prompt shares no prefix with this one's)."""
    rng = random.Random(seed)
    tools = _tools_for(count, first)
    tools = tools[rotate:] + tools[:rotate]
    system = system_prompt(count, max(0, first - sum(count(json.dumps(t)) for t in tools)), intro)
    w = rng.choice(WORDS)
    session = Session(system, tools, f"The {w} cache drops entries too early under load; find why, fix it and add a test.")
    rounds = turns - 1
    screens = {max(1, round(f * rounds)) for f in SCREEN_AT} if screenshots else set()
    grow = max(8, (last - first) // max(1, rounds))
    for i in range(1, rounds + 1):
        name = "screenshot" if i in screens else SEQUENCE[(i - 1) % len(SEQUENCE)]
        args = _arguments(name, rng)
        thought = f"Checking the {rng.choice(WORDS)} handling."
        used = count(thought) + count(json.dumps(args)) + ROUND_MARKERS
        text = _result(count, "web_fetch" if name == "screenshot" else name, max(16, grow - used), rng)
        png = screenshot(seed * 1000 + i) if name == "screenshot" else None
        session.rounds.append(Round(f"toolu_{seed:02d}{i:03d}", name, args, thought, text, png))
    return session


def billing_header() -> str:
    """Claude Code's first system block, with a new ``cch`` every request (the server drops it)."""
    return f"x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"


def _png_b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def messages_request(s: Session, turn: int, cache_control: bool = True) -> dict[str, Any]:
    """Turn ``turn`` as Claude Code sends it: billing block, cached system block, tools, tool_use/tool_result."""
    system: list[dict[str, Any]] = [{"type": "text", "text": billing_header()}, {"type": "text", "text": s.system}]
    if cache_control:
        system[1]["cache_control"] = {"type": "ephemeral"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": s.task}]}]
    for r in s.rounds[: turn - 1]:
        use = {"type": "tool_use", "id": r.call_id, "name": r.name, "input": r.arguments}
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": r.thought}, use]})
        content: list[dict[str, Any]] = [{"type": "text", "text": r.result}]
        if r.screenshot is not None:
            content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                        "data": _png_b64(r.screenshot)}})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.call_id, "content": content}]})
    return {"system": system, "tools": s.tools, "messages": msgs}


def responses_request(s: Session, turn: int, key: str) -> dict[str, Any]:
    """Turn ``turn`` as Codex sends it: instructions, function tools, reasoning items before each call,
    function_call / function_call_output items, ``prompt_cache_key``, ``store: false``."""
    tools = [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"],
              "strict": False} for t in s.tools]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": s.task}]}]
    for r in s.rounds[: turn - 1]:
        items.append({"type": "reasoning", "id": f"rs_{r.call_id}", "summary": [{"type": "summary_text", "text": r.thought}],
                      "encrypted_content": base64.b64encode(r.call_id.encode() * 8).decode()})
        items.append({"type": "function_call", "call_id": r.call_id, "name": r.name, "arguments": json.dumps(r.arguments)})
        output: Any = r.result
        if r.screenshot is not None:
            output = [{"type": "input_text", "text": r.result},
                      {"type": "input_image", "image_url": "data:image/png;base64," + _png_b64(r.screenshot)}]
        items.append({"type": "function_call_output", "call_id": r.call_id, "output": output})
    return {"instructions": s.system, "tools": tools, "input": items, "prompt_cache_key": key, "store": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "parallel_tool_calls": False}


def chat_tools(s: Session) -> list[dict[str, Any]]:
    """The tools in the chat API's shape (what tool grammars are compiled from)."""
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in s.tools]
