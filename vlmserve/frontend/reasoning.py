"""[loop] Split a generation, delta by delta, into reasoning (``<think>...</think>``) and content.

Qwen3.5's template opens ``<think>`` at the end of the prompt, so the model's reply starts inside
its reasoning and the first ``</think>`` ends it; other models open the block themselves. Text
before the end marker goes to ``reasoning_content`` (as DeepSeek's and vLLM's APIs name it), the
rest is the answer that tool-call parsing and clients see. A reply that never opens a block is
all content. Kimi-VL-Thinking opens and closes its block with ``◁think▷`` and ``◁/think▷`` (plain text):
a block the model opens ends with its own pair's end marker.
"""

from __future__ import annotations

from vlmserve.tools.base import partial_marker_len

START, END = "<think>", "</think>"
MARKERS = ((START, END), ("◁think▷", "◁/think▷"))  # a block's start and its end, for the blocks a model opens


class ReasoningSplitter:
    """States: ``before`` (a block may open), ``inside``, ``gap`` (whitespace after ``</think>``), ``content``."""

    def __init__(self, opened_by_prompt: bool) -> None:
        self._state = "inside" if opened_by_prompt else "before"
        self._held = ""
        self._end = END  # the open block's end marker

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` of this delta; a possible marker start waits for the next one."""
        buf, self._held = self._held + text, ""
        if self._state == "before":
            opening = buf.lstrip()
            pair = next((p for p in MARKERS if opening.startswith(p[0])), None)
            if pair is not None:
                self._state, self._end, buf = "inside", pair[1], opening[len(pair[0]):]
            elif any(start.startswith(opening) for start, _ in MARKERS) and not final:
                self._held = buf  # only whitespace or the start of a start marker so far
                return "", ""
            else:
                self._state = "content"
        reasoning = ""
        if self._state == "inside":
            at = buf.find(self._end)
            if at < 0:
                keep = 0 if final else partial_marker_len(buf, (self._end,))
                self._held = buf[len(buf) - keep:]
                return buf[: len(buf) - keep], ""
            reasoning, buf, self._state = buf[:at], buf[at + len(self._end):], "gap"
        if self._state == "gap":
            buf = buf.lstrip()
            if not buf:
                return reasoning, ""
            self._state = "content"
        return reasoning, buf
