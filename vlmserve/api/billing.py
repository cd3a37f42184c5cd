"""[loop] Claude Code's billing block, dropped from system messages before the prompt is built.

Claude Code (>= 2.1.36) sends as its first system block ``x-anthropic-billing-header: cc_version=<v>;
cc_entrypoint=cli; cch=<5 hex>;``, and ``cch`` changes on every request: kept, it would sit at the
head of every prompt and the prefix cache would miss on every turn. It carries nothing for the model
(Anthropic's servers read it for billing), so a system or developer message, or its first text part,
that begins with it loses that line; a message that held only it is dropped. Nothing else is rewritten.
"""

from __future__ import annotations

import logging
import re

from vlmserve.api.schemas import Message, TextPart

log = logging.getLogger(__name__)

PREFIX = "x-anthropic-billing-header:"  # as Claude Code sends it
_LINE = re.compile(re.escape(PREFIX) + r"[^\n]*\n*")  # the line, and the blank lines before the rest
_ENTRYPOINT = re.compile(r"cc_entrypoint=([^;\s]*)")
MAX_CLIENTS_LOGGED = 64  # distinct entrypoints logged; a client that makes up new ones is not logged forever


def strip_billing_header(text: str) -> tuple[str, str | None]:
    """``text`` without the billing line it begins with (and the line breaks after it), and that line;
    ``text`` and None when it does not begin with one."""
    match = _LINE.match(text)
    if match is None:
        return text, None
    return text[match.end():], match.group().rstrip("\n")


def without_billing_header(m: Message) -> tuple[Message | None, str | None]:
    """A system or developer message without the billing line its text (or first text part) begins
    with, and that line; None for the message when the line was all it held."""
    if m.role not in ("system", "developer") or not m.content:
        return m, None
    if isinstance(m.content, str):
        rest, header = strip_billing_header(m.content)
        if header is None:
            return m, None
        return (m.model_copy(update={"content": rest}) if rest else None), header
    first = m.content[0]
    if not isinstance(first, TextPart):
        return m, None
    rest, header = strip_billing_header(first.text)
    if header is None:
        return m, None
    parts = ([first.model_copy(update={"text": rest})] if rest else []) + m.content[1:]
    return (m.model_copy(update={"content": parts}) if parts else None), header


class BillingHeaderLog:
    """One log line per client (its ``cc_entrypoint``) whose billing block was dropped, not one per request."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def dropped(self, header: str, model: str) -> None:
        found = _ENTRYPOINT.search(header)
        client = found.group(1) if found else ""
        if client in self._seen or len(self._seen) >= MAX_CLIENTS_LOGGED:
            return
        self._seen.add(client)
        log.warning("model %s: dropped the system block %r from requests of client cc_entrypoint=%s (this line is "
                    "logged once per client): its cch changes on every request, and kept it would make every prompt "
                    "miss the prefix cache; it carries nothing for the model. Counted in "
                    "vlmserve_billing_header_dropped_total.", model, _shown(header), client or "?")


def _shown(header: str) -> str:
    """The header as logged: its ``cch`` (a per-request hash) left out."""
    return re.sub(r"cch=[^;\s]*", "cch=...", header)[:200]
