"""[pool] Tool-call ids in a conversation's history as a chat template needs them: Mistral's nine characters,
Kimi's ``functions.NAME:IDX`` (written where the model reads the call's name); each result's ``tool_call_id``
follows its call's."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

from vlmserve.tools.kimi import call_id as kimi_call_id

_KIMI_ID = re.compile(r"functions\.(.+):\d+")


def renumbered_calls(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call ids as the k-th call of the conversation (``c00000001``...): nine alphanumerics
    whatever the client sent, and the same prompt for the same conversation."""
    ids: dict[str, str] = {}

    def renamed(call_id: str | None) -> str:
        return ids.setdefault(call_id or f"missing-{len(ids)}", f"c{len(ids) + 1:08d}")

    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": renamed(c.get("id"))} for c in m["tool_calls"]]}
        elif m["role"] == "tool":
            m = {**m, "tool_call_id": renamed(m.get("tool_call_id"))}
        out.append(m)
    return out


def named_call_ids(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call ids as Kimi's templates write them in the name's place: ``functions.NAME:IDX``, IDX the call's
    place in the conversation (Moonshot's global counter). An id that already names its call's function (as
    this server returns them) stays as sent, byte for byte; a client's own (``toolu_...``, ``call_...``) is
    replaced: written there, the model would read it as the name."""
    ids: dict[str, str] = {}  # the client's id -> the one written; a reused id means its latest call
    places = itertools.count()

    def named(call: dict[str, Any]) -> dict[str, Any]:
        given, name, place = call.get("id") or "", call["function"]["name"], next(places)
        kept = _KIMI_ID.fullmatch(given)
        written = given if kept and kept.group(1) == name else kimi_call_id(name, place)
        ids[given or written] = written
        return {**call, "id": written}

    return [_with_ids(m, named, ids) for m in messages]


def _with_ids(message: dict[str, Any], named: Callable[[dict[str, Any]], dict[str, Any]],
              ids: dict[str, str]) -> dict[str, Any]:
    if message.get("tool_calls"):
        return {**message, "tool_calls": [named(c) for c in message["tool_calls"]]}
    if message["role"] == "tool" and message.get("tool_call_id") in ids:
        return {**message, "tool_call_id": ids[message["tool_call_id"]]}
    return message
