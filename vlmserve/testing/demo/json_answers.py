"""[any] The demo model's JSON: a scene described as an object, as a constrained decoder writes it.

Asked for JSON ("Describe the picture as JSON."), the model writes the scene object, shapes in
reading order:

    {"count": 2, "shapes": [{"shape": "circle", "colour": "red"}, {"shape": "square", "colour":
    "blue"}], "caption": "A red circle above a blue square."}

Given a schema instead (in the system text, or only through ``response_format``'s grammar, which
forces ``{"`` and the keys and leaves the values to the model), it fills the schema's fields from
the same scene: ``shape``/``kind``/``type`` and ``colour``/``color`` name the first shape,
``count``/``number`` count them, ``caption``/``description``/``text``/``answer``/``summary`` hold the
caption, ``shapes`` lists them. Without a picture it describes a shape it imagines (the docs'
"Describe one shape." asks for one). Every value is short and every string is closed, so a
grammar with unbounded ``str`` fields still ends.

JSON is written as the server's grammar writes it: ``", "`` and ``": "``, no other whitespace.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from vlmserve.testing.demo.scenes import COLOURS, NUMBERS, SHAPES, Scene

JSON_PROMPTS = (
    "Describe the picture as JSON.", "Describe this image as JSON.", "Describe the image in JSON.",
    "Answer in JSON.", "Reply with JSON.", "Return the shapes as JSON.",
)  # fmt: skip
SCHEMA_SYSTEM = "Reply with JSON that matches this schema: "
# keys a schema may ask for -> (JSON type, what they hold)
FIELDS: dict[str, tuple[str, str]] = {
    "shape": ("string", "kind"), "kind": ("string", "kind"), "type": ("string", "kind"),
    "colour": ("string", "colour"), "color": ("string", "colour"),
    "count": ("integer", "count"), "number": ("integer", "count"),
    "caption": ("string", "caption"), "description": ("string", "caption"), "text": ("string", "caption"),
    "answer": ("string", "caption"), "summary": ("string", "caption"),
    "shapes": ("array", "shapes"),
}  # fmt: skip
SHAPE_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {"shape": {"type": "string"}, "colour": {"type": "string"}},
    "required": ["shape", "colour"],
}
# the scene object's schema, its strings unbounded (set 4 of eval-demo constrains to it)
SCENE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"count": {"type": "integer"}, "shapes": {"type": "array", "items": SHAPE_ITEM}, "caption": {"type": "string"}},
    "required": ["count", "shapes", "caption"],
}
# the docs' structured-output example (docs/structured-output-and-tools.md): one shape, plain strings
SHAPE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"shape": {"type": "string"}, "colour": {"type": "string"}},
    "required": ["shape", "colour"],
}


def dumps(value: Any) -> str:
    """JSON as the grammar writes it."""
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


def field_value(scene: Scene, holds: str) -> Any:
    first = scene.ordered[0]
    if holds == "kind":
        return first.kind
    if holds == "colour":
        return first.colour
    if holds == "count":
        return len(scene.shapes)
    if holds == "caption":
        return scene.caption
    return [{"shape": s.kind, "colour": s.colour} for s in scene.ordered]


def scene_object(scene: Scene, keys: tuple[str, ...] = tuple(SCENE_SCHEMA["properties"])) -> dict[str, Any]:
    """The object describing ``scene`` with ``keys`` (the scene object's by default), in that order."""
    return {key: field_value(scene, FIELDS[key][1]) for key in keys}


def schema_for(keys: tuple[str, ...], rng: np.random.Generator | None = None) -> dict[str, Any]:
    """A JSON schema asking for ``keys``, sometimes written as pydantic writes one (titles)."""
    properties: dict[str, Any] = {}
    for key in keys:
        kind = FIELDS[key][0]
        spec: dict[str, Any] = {"type": kind, "items": SHAPE_ITEM} if kind == "array" else {"type": kind}
        if rng is not None and rng.random() < 0.5:
            spec = {"title": key.capitalize(), **spec}
        properties[key] = spec
    return {"type": "object", "properties": properties, "required": list(keys)}


def random_keys(rng: np.random.Generator) -> tuple[str, ...]:
    """One to three fields, at most one of each meaning."""
    by_meaning: dict[str, list[str]] = {}
    for key, (_, holds) in FIELDS.items():
        by_meaning.setdefault(holds, []).append(key)
    meanings = list(by_meaning)
    chosen = [meanings[i] for i in rng.permutation(len(meanings))[: int(rng.integers(1, 4))]]
    return tuple(by_meaning[m][0] if rng.random() < 0.5 else by_meaning[m][int(rng.integers(len(by_meaning[m])))] for m in chosen)


def parse_object(text: str) -> dict[str, Any] | None:
    """The reply as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def sensible(value: dict[str, Any], schema: dict[str, Any]) -> bool:
    """Whether an object with no picture to describe still fits ``schema`` with words the model
    knows: shape and colour fields name one, counts are 1-3, strings are short and closed."""
    if list(value) != list(schema["properties"]):
        return False
    for key, item in value.items():
        holds = FIELDS.get(key, ("", ""))[1]
        if holds == "kind" and item not in SHAPES or holds == "colour" and item not in COLOURS:
            return False
        if holds == "count" and item not in range(1, len(NUMBERS)):
            return False
        if isinstance(item, str) and not 0 < len(item) <= 80:
            return False
    return True
