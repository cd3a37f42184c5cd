"""[any] Teach a micro model one tool round trip, in its family's own tool syntax.

A random model never emits a tool call, so the API's tool path could only be tested with
hand-fed tokens. A few seconds of full fine-tuning make a micro model answer two exact chats:
the weather question with a ``get_weather`` call, and the tool's result with a sentence. The
targets are what the family's own chat template writes for those assistant turns (the chats as the
server's message conversion hands them to the template, through the prompt builder the server uses), so the model speaks Gemma 4's
``call:NAME{...}``, Hermes JSON, Qwen3.5's XML or Mistral's ``[TOOL_CALLS]``, whichever its
template does, and stops with the template's own end of turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}},
                   "required": ["location"]}}}
# A system message of our own: some templates (Mistral Small 3.2) write a dated default one without it.
ASK: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": "What is the weather in Tokyo?"}]
CALL_ID = "a1b2c3d4e"  # nine alphanumerics: what Mistral's templates accept
CALL: dict[str, Any] = {"id": CALL_ID, "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"location": "Tokyo"})}}
RESULT = "21 degrees and sunny"
ANSWER = "It is 21 degrees and sunny in Tokyo."
AFTER_CALL: list[dict[str, Any]] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                    {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT}]
# The same chats as the API's message conversion gives them to the template (``api.messages.to_chat_input``;
# tests/test_testing_builders.py checks that they agree): arguments as an object, the tool's result named.
# Written out so that the model builders stay below the API.
TEMPLATE_CALL_TURN: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
    {**CALL, "function": {"name": "get_weather", "arguments": {"location": "Tokyo"}}}]}
TEMPLATE_AFTER_CALL: list[dict[str, Any]] = [*ASK, TEMPLATE_CALL_TURN, {
    "role": "tool", "content": RESULT, "tool_call_id": CALL_ID, "name": "get_weather"}]
CHECK_EVERY = 20  # steps between greedy checks; training stops once both answers come out exactly
MAX_STEPS = 400
LEARNING_RATE = 2e-3


@dataclass(frozen=True, slots=True)
class Example:
    prompt: list[int]
    target: list[int]  # the assistant turn, up to and including its end-of-turn token


def examples(processor: Any, eos_ids: frozenset[int]) -> list[Example]:
    """The two chats as the server tokenizes them, and the family's rendering of each answer."""
    from vlmserve.preprocess.prompt import PromptBuilder

    prompter = PromptBuilder.for_processor(processor)
    call_turn, after_call = _with_format_ids(prompter, [TEMPLATE_CALL_TURN]), _with_format_ids(prompter, TEMPLATE_AFTER_CALL)
    chats = [(ASK, call_turn[0]), (after_call, {"role": "assistant", "content": ANSWER})]
    return [_example(prompter, history, answer, eos_ids) for history, answer in chats]


def _with_format_ids(prompter: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat with the call's id as the template's own format writes ids the model reads back (Kimi's
    ``functions.NAME:IDX``, as the server returns them), else as it is."""
    from vlmserve.preprocess.prompt import templater_of
    from vlmserve.tools import get_format, select_parser

    template = getattr(templater_of(prompter.processor), "chat_template", None)
    name = select_parser(template if isinstance(template, str) else None, None)
    make_id = get_format(name).call_id if name else None
    if make_id is None:
        return messages
    call_id = make_id("get_weather", 0)
    return [{**m, "tool_calls": [{**c, "id": call_id} for c in m["tool_calls"]]} if m.get("tool_calls") else
            {**m, "tool_call_id": call_id} if m.get("tool_call_id") else m for m in messages]


def _example(prompter: Any, history: list[dict[str, Any]], answer: dict[str, Any], eos_ids: frozenset[int]) -> Example:
    from vlmserve.preprocess.hermes import text_of
    from vlmserve.preprocess.prompt import tokenizer_of

    prompt, prompt_text = _render(prompter, history, generation_prompt=True)
    answered, answered_text = _render(prompter, [*history, answer], generation_prompt=False)
    tokenizer = tokenizer_of(prompter.processor)
    if answered_text.startswith(prompt_text):  # the template's own words for the answer, end of turn included
        completion = answered_text[len(prompt_text):]
    else:  # a template that renders history differently (Pixtral drops the system; PaliGemma keeps one turn)
        completion = text_of(answered[-1]["content"])
    target = tokenizer(completion, add_special_tokens=False)["input_ids"]
    ends = [i for i, t in enumerate(target) if t in eos_ids]
    target = target[: ends[0] + 1] if ends else [*target, tokenizer.eos_token_id]  # LLaVA writes no end of turn
    return Example(prompt, target)


def _render(prompter: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> tuple[Any, str]:
    """The adapted messages (what the template sees) and the template's text, as the server builds them."""
    from vlmserve.preprocess.prompt import render_chat
    from vlmserve.preprocess.template import adapt_messages

    adapted, tools = adapt_messages(messages, [WEATHER_TOOL], prompter.template)
    text = render_chat(prompter.processor, adapted, tools, add_generation_prompt=generation_prompt)
    if generation_prompt:
        return prompter.build(messages, [], [WEATHER_TOOL]).input_ids, text
    return adapted, text


def tune(model: nn.Module, processor: Any, eos_ids: frozenset[int], seed: int = 0) -> int:
    """Full fine-tune until greedy decoding gives both answers exactly; returns the steps taken.

    Deterministic: the data order is fixed and the checks are greedy.
    """
    data = examples(processor, eos_ids)
    mx.random.seed(seed)
    optimizer = optim.Adam(learning_rate=LEARNING_RATE, bias_correction=True)
    step = nn.value_and_grad(model, _loss)
    for i in range(1, MAX_STEPS + 1):
        _, grads = step(model, data[i % len(data)])
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        if i % CHECK_EVERY == 0 and all(_greedy(model, ex) == ex.target for ex in data):
            return i
    raise RuntimeError(f"the model did not learn the tool round trip in {MAX_STEPS} steps")


def _greedy(model: nn.Module, example: Example) -> list[int]:
    from mlx_vlm.generate.ar import generate_step

    ids = mx.array(example.prompt, dtype=mx.int32)[None]
    steps = generate_step(ids, model, None, mx.ones(ids.shape, dtype=mx.int32),
                          max_tokens=len(example.target), temperature=0.0)
    return [int(token) for token, _ in steps]


def _loss(model: nn.Module, example: Example) -> mx.array:
    ids = mx.array(example.prompt + example.target[:-1], dtype=mx.int32)[None]
    features = model.get_input_embeddings(ids, None, mask=mx.ones(ids.shape, dtype=mx.int32))
    extra = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
    start = len(example.prompt) - 1
    mask = _prefix_lm_mask(model, len(example.prompt), ids.shape[1])
    if mask is not None:
        extra["mask"] = mask
    logits = model.language_model(ids, inputs_embeds=features.inputs_embeds, **extra).logits[0]
    return nn.losses.cross_entropy(logits[start:], mx.array(example.target), reduction="mean")


def _prefix_lm_mask(model: nn.Module, prompt_len: int, total: int) -> mx.array | None:
    """PaliGemma's language model attends both ways with no mask; teacher forcing must not let
    an answer token see the ones after it: the prompt sees itself, each answer token its past."""
    if not getattr(getattr(model.config, "text_config", None), "use_bidirectional_attention", False):
        return None
    rows, cols = mx.arange(total)[:, None], mx.arange(total)[None]
    return (cols <= rows) | ((rows < prompt_len) & (cols < prompt_len))
