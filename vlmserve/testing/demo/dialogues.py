"""[any] The chats the demo model learns: image captions and Q&A, small talk, weather tool calls.

Every chat is OpenAI-style messages, rendered by the model's own chat template exactly as the
server renders a request. The first wording in each list is the canonical one that tests and
the model card use; the others are paraphrases for training.

The tool call is the malformed single-quoted form quantized Gemma 4 really emits, so the
server's repair path runs end to end:
    <|tool_call>call:get_weather{location:'Tokyo',unit:'celsius'}<tool_call|>
and it ends with ``<|tool_response>``, where the template says a tool result comes next (one of
the model's EOS tokens). Every other answer ends with the end of turn ``<turn|>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.testing.demo.json_answers import JSON_PROMPTS, SCHEMA_SYSTEM, dumps, random_keys, scene_object, schema_for
from vlmserve.testing.demo.placements import sample_aspect, sample_free_scene
from vlmserve.testing.demo.render import render, sample_style, sample_varied_style
from vlmserve.testing.demo.scenes import COLUMN_NAMES, ROW_NAMES, Question, Scene, Split, sample_question, sample_scene

END_OF_TURN = "<turn|>"
TOOL_HANDOVER = "<|tool_response>"

CAPTION_PROMPTS = (
    "Describe this image.", "Describe the image.", "What is in this image?", "What do you see?",
    "Write a caption for this image.", "Caption this image.",
)  # fmt: skip
QUESTION_WORDINGS = {
    "count": ("How many shapes are there?", "How many shapes do you see?", "Count the shapes."),
    "colour": ("What colour is the {shape}?", "What color is the {shape}?", "Which colour is the {shape}?"),
    "exists": ("Is there a {shape}?", "Is there a {shape} in the image?", "Do you see a {shape}?"),
}
GREETING = "Hello! Show me a picture and I will describe it."
SMALL_TALK = {
    "Hello!": GREETING, "Hello": GREETING, "Hi!": GREETING, "Hi": GREETING, "Hey": GREETING,
    "Who are you?": "I am a small demo model. I describe pictures of shapes.",
    "What can you do?": "I can describe pictures of shapes and answer questions about them.",
    "Thank you!": "You are welcome!", "Thanks": "You are welcome!",
}  # fmt: skip
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You describe images.")

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    },
}
CITIES = ("Tokyo", "Paris", "London", "Berlin", "Cairo")
UNITS = ("celsius", "fahrenheit")
WEATHER_REQUESTS = (
    "What's the weather in {city} in {unit}?", "What is the weather in {city} in {unit}?",
    "How warm is it in {city} in {unit}?",
)  # fmt: skip
TOOL_DESCRIPTIONS = ("Get the current weather in a city.", "Get the weather for a location.", "Current weather.")


@dataclass(frozen=True, slots=True)
class Chat:
    """One training chat: ``prefix`` messages, then turns of (new messages, learned answer).

    Each answer carries its end token. ``images`` belong to the first turn's user message.
    ``given`` starts the first answer and is not learned: what a grammar forces (``{"``).
    """

    kind: str
    turns: tuple[tuple[tuple[dict[str, Any], ...], str], ...]
    prefix: tuple[dict[str, Any], ...] = ()
    images: tuple[Image.Image, ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    given: str = ""


def image_message(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def question_text(question: Question, wording: int = 0) -> str:
    return QUESTION_WORDINGS[question.kind][wording].format(shape=question.shape)


def weather_call(city: str, unit: str) -> str:
    return f"<|tool_call>call:get_weather{{location:'{city}',unit:'{unit}'}}<tool_call|>"


def weather_answer(city: str, degrees: int) -> str:
    return f"It is {degrees} degrees in {city}."


def demo_corpus(chats: int = 3000, seed: int = 0) -> list[str]:
    """The words of the demo's chats as plain text, for its tokenizer's BPE to learn from."""
    rng = np.random.default_rng([seed, 11])
    texts = [json.dumps(WEATHER_TOOL), *(f"{prompt} {answer}" for prompt, answer in SMALL_TALK.items())]
    texts += [" ".join(ROW_NAMES + COLUMN_NAMES)] * 200  # the words the connector starts from (warmup.py)
    for _ in range(chats):
        scene = sample_scene(rng)
        question = sample_question(rng, scene)
        texts.append(f"{_pick(rng, CAPTION_PROMPTS)} {scene.caption} {_question_wording(rng, question)} {question.answer}")
        city, unit, degrees = _pick(rng, CITIES), _pick(rng, UNITS), int(rng.integers(-5, 36))
        request = _pick(rng, WEATHER_REQUESTS).format(city=city, unit=unit)
        result = json.dumps({"temperature": degrees, "unit": unit})
        texts.append(f"{request} {weather_call(city, unit)} {result} {weather_answer(city, degrees)}")
        keys = random_keys(rng)
        texts.append(f"{_pick(rng, JSON_PROMPTS)} {dumps(schema_for(keys))} {dumps(scene_object(scene))} {dumps(scene_object(scene, keys))}")
    return texts


# -- sampling chats ----------------------------------------------------------------------

# kind -> share of training chats; weather chats are long (the declaration)
MIX = {"image": 0.42, "free_image": 0.28, "json": 0.15, "small_talk": 0.03, "weather": 0.12}
NO_IMAGE_PROMPTS = ("Describe one shape.", "Describe a shape.", "Name a shape.", "Give me a shape.", "Pick a shape.")


def sample_chat(rng: np.random.Generator, split: Split = "train") -> Chat:
    kinds = list(MIX)
    kind = kinds[int(rng.choice(len(kinds), p=list(MIX.values())))]
    if kind in ("image", "free_image"):
        return image_chat(rng, *sample_picture(rng, split, free=kind == "free_image"))
    if kind == "json":
        return json_chat(rng, split)
    if kind == "small_talk":
        return small_talk_chat(rng)
    return weather_chat(rng)


def sample_picture(
    rng: np.random.Generator, split: Split = "train", free: bool = False, shapes: int | None = None
) -> tuple[Scene, Image.Image]:
    """A grid scene in the classic look, or (``free``) a free-position one of ``shapes`` shapes
    (None: 1-3) in the varied look on a canvas of any aspect ratio."""
    if not free:
        scene = sample_scene(rng, split)
        return scene, render(scene, sample_style(rng))
    aspect = sample_aspect(rng)
    scene = sample_free_scene(rng, split, aspect, shapes)
    return scene, render(scene, sample_varied_style(rng, aspect))


def json_chat(rng: np.random.Generator, split: Split = "train") -> Chat:
    """A scene (or, without a picture, one shape the model imagines) described as JSON, asked
    for three ways: in words ("Describe the picture as JSON.": the scene object), by a schema in
    the system text, or only by the grammar of ``response_format``, which forces ``{"`` (given,
    not learned) and the keys."""
    with_image = rng.random() < 0.85
    if with_image:
        scene, image = sample_picture(rng, split, free=rng.random() < 0.35)
    else:
        scene = sample_free_scene(rng, split, shapes=1)
    keys = random_keys(rng) if with_image or rng.random() < 0.6 else ("shape", "colour")
    mode = rng.random()
    if with_image and mode < 0.4:
        keys, prompt, system, given = tuple(scene_object(scene)), _pick(rng, JSON_PROMPTS), (), ""
    else:
        prompt = _pick(rng, CAPTION_PROMPTS if with_image else NO_IMAGE_PROMPTS)
        in_system = mode < 0.7
        system = ({"role": "system", "content": SCHEMA_SYSTEM + dumps(schema_for(keys, rng))},) if in_system else ()
        given = "" if in_system else '{"'
    message = image_message(prompt) if with_image else user(prompt)
    answer = dumps(scene_object(scene, keys)) + END_OF_TURN
    return Chat("json", (((message,), answer),), prefix=system, images=(image,) if with_image else (), given=given)


def image_chat(rng: np.random.Generator, scene: Scene, image: Image.Image) -> Chat:
    """Up to three questions about one image, then (or only) its caption.

    The caption comes last: asked after it, a question could be answered by reading the
    caption's text instead of the image, and at inference questions usually come first.
    """
    asks = [(_question_wording(rng, q), q.answer) for q in (sample_question(rng, scene) for _ in range(rng.integers(4)))]
    if not asks or rng.random() < 0.5:
        asks.append((_pick(rng, CAPTION_PROMPTS), scene.caption))
    turns = tuple(
        ((image_message(text) if i == 0 else user(text),), answer + END_OF_TURN) for i, (text, answer) in enumerate(asks)
    )
    return Chat("image", turns, prefix=_maybe_system(rng), images=(image,))


def small_talk_chat(rng: np.random.Generator) -> Chat:
    prompt = _pick(rng, tuple(SMALL_TALK))
    return Chat("small_talk", (((user(prompt),), SMALL_TALK[prompt] + END_OF_TURN),), prefix=_maybe_system(rng))


def weather_chat(rng: np.random.Generator) -> Chat:
    """One or two weather rounds under one tool declaration (it is long: share it).

    Each round's answer to the tool's result is learned; the last request may instead end the
    chat, and then its (malformed) call is what is learned.
    """
    rounds = int(rng.integers(1, 3))
    call_last = rng.random() < 0.4
    turns = []
    for i in range(rounds):
        city, unit = _pick(rng, CITIES), _pick(rng, UNITS)
        request = user(_pick(rng, WEATHER_REQUESTS).format(city=city, unit=unit))
        if i == rounds - 1 and call_last:
            turns.append(((request,), weather_call(city, unit) + TOOL_HANDOVER))
            break
        degrees = int(rng.integers(-5, 36))
        call, result = weather_exchange(city, unit, degrees, int(rng.integers(3)), f"call_{i}")
        turns.append(((request, call, result), weather_answer(city, degrees) + END_OF_TURN))
    return Chat("weather", tuple(turns), tools=(_weather_tool_variant(rng),))


def weather_exchange(
    city: str, unit: str, degrees: int, result_format: int = 0, call_id: str = "call_0"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The assistant's (repaired) call as the server sends it back, and the tool's result."""
    arguments = {"location": city, "unit": unit}
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    results = (
        json.dumps({"temperature": degrees, "unit": unit}),
        json.dumps({"temperature": degrees}),
        f"{degrees} degrees {unit}",
    )
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    return assistant, {"role": "tool", "tool_call_id": call_id, "content": results[result_format]}


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    # the canonical (first) wording half the time, so what tests ask is what was seen most
    return options[0] if rng.random() < 0.5 else options[int(rng.integers(len(options)))]


def _question_wording(rng: np.random.Generator, question: Question) -> str:
    wordings = QUESTION_WORDINGS[question.kind]
    return _pick(rng, wordings).format(shape=question.shape)


def _maybe_system(rng: np.random.Generator) -> tuple[dict[str, Any], ...]:
    if rng.random() >= 0.05:
        return ()
    return ({"role": "system", "content": _pick(rng, SYSTEM_PROMPTS)},)


def _weather_tool_variant(rng: np.random.Generator) -> dict[str, Any]:
    """The canonical declaration, or one with another description or without the enum."""
    if rng.random() < 0.6:
        return WEATHER_TOOL
    function = json.loads(json.dumps(WEATHER_TOOL["function"]))
    function["description"] = _pick(rng, TOOL_DESCRIPTIONS)
    if rng.random() < 0.5:
        del function["parameters"]["properties"]["unit"]["enum"]
    return {"type": "function", "function": function}

