"""Tool calls through the real output path: the tokens a quantized Gemma 4 emits, detokenized
one at a time, into OpenAI ``tool_calls`` (streamed and not). The model-driven end-to-end test
with the trained demo model lives in test_demo_server.py."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from vlmserve.api.openai_format import ChoiceBuilder
from vlmserve.engine.request import StepOutput
from vlmserve.frontend.output import OutputProcessor

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"},
                                     "days": {"type": "integer"}}}}}]

MALFORMED = "Let me check.<|tool_call>call:get_weather{location:'Tokyo',unit:'celsius',days:'3'}<tool_call|>"


@pytest.fixture(scope="module")
def tokenizer(gemma4_micro):
    return AutoTokenizer.from_pretrained(str(gemma4_micro))


def _outputs(tokenizer, text, skip_special_tokens=False):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    processor = OutputProcessor(tokenizer, skip_special_tokens=skip_special_tokens)
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        yield processor.process(StepOutput("r", (token,), finish_reason="stop" if last else None,
                                           num_prompt_tokens=10))


def test_malformed_gemma4_call_becomes_tool_calls(tokenizer):
    builder = ChoiceBuilder("chatcmpl-x", "m", tokenizer, "gemma4", WEATHER)
    for out in _outputs(tokenizer, MALFORMED):
        builder.step(out)
    response = builder.response(builder.finish_reason("stop"), False)
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": "Tokyo", "unit": "celsius", "days": 3}


def test_streamed_call_never_leaks_markers_and_arrives_as_deltas(tokenizer):
    builder = ChoiceBuilder("chatcmpl-x", "m", tokenizer, "gemma4", WEATHER)
    content, calls = "", []
    for out in _outputs(tokenizer, MALFORMED):
        delta = builder.step(out)
        assert "<|" not in delta.content and "|>" not in delta.content
        content += delta.content
        calls += delta.tool_calls
    assert content == "Let me check." and builder.finish_reason("stop") == "tool_calls"
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"location": "Tokyo", "unit": "celsius", "days": 3}


def test_unknown_tool_stays_content(tokenizer):
    text = "<|tool_call>call:rm_rf{path:'/'}<tool_call|>"
    builder = ChoiceBuilder("chatcmpl-x", "m", tokenizer, "gemma4", WEATHER)
    for out in _outputs(tokenizer, text):
        builder.step(out)
    response = builder.response(builder.finish_reason("stop"), False)
    assert response["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in response["choices"][0]["message"]
    assert "rm_rf" in response["choices"][0]["message"]["content"]


def test_without_tools_the_markup_is_plain_content(tokenizer):
    builder = ChoiceBuilder("chatcmpl-x", "m", tokenizer, "gemma4", None)
    for out in _outputs(tokenizer, MALFORMED, skip_special_tokens=True):
        builder.step(out)
    assert builder.finish_reason("stop") == "stop" and "get_weather" in builder.content


def test_multi_turn_agent_history_renders_in_gemma4_syntax(gemma4_micro):
    import mlx_vlm.models.gemma4  # noqa: F401 - registers Gemma4Processor with AutoProcessor
    from mlx_vlm.utils import load_processor

    from vlmserve.api.messages import to_chat_input
    from vlmserve.api.schemas import ChatCompletionRequest
    from vlmserve.preprocess.media import MediaPolicy
    from vlmserve.preprocess.prompt import render_chat

    req = ChatCompletionRequest.model_validate({
        "model": "m", "tools": WEATHER, "messages": [
            {"role": "user", "content": "Weather in Tokyo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"location": "Tokyo", "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        ]})
    chat = to_chat_input(req, MediaPolicy())
    text = render_chat(load_processor(gemma4_micro), chat.messages, chat.tools)
    assert "<|tool>declaration:get_weather{" in text
    assert '<|tool_call>call:get_weather{location:<|"|>Tokyo<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>' in text
    assert "<|tool_response>response:get_weather{" in text and "21 degrees" in text


def test_a_call_cut_by_the_token_limit_says_length_and_stays_what_the_model_wrote(tokenizer):
    """Issue 32: a call cut by max_tokens was closed for the model and reported as tool_calls."""
    cut = MALFORMED[: MALFORMED.index("celsius")]
    ids = tokenizer(cut, add_special_tokens=False)["input_ids"]
    processor = OutputProcessor(tokenizer, skip_special_tokens=False)
    builder = ChoiceBuilder("chatcmpl-x", "m", tokenizer, "gemma4", WEATHER)
    for i, token in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        builder.step(processor.process(StepOutput("r", (token,), finish_reason=finish, num_prompt_tokens=10)))
    choice = builder.response(builder.finish_reason("length"), False)["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    assert choice["message"]["content"] == "Let me check." + cut[len("Let me check."):]


TWO_CALLS = ("<|tool_call>call:get_weather{location:<|\"|>Tokyo<|\"|>}<tool_call|>"
             "<|tool_call>call:get_weather{location:<|\"|>Paris<|\"|>}<tool_call|>")


@pytest.mark.parametrize("one_call", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call_streamed_and_whole(tokenizer, one_call):
    """``parallel_tool_calls: false`` (Codex sends it; Anthropic's ``disable_parallel_tool_use``): a reply's
    first call only, in the stream and in the whole reply, as vLLM does."""
    builder = ChoiceBuilder("chatcmpl-x", "m", tokenizer, "gemma4", WEATHER, one_call=one_call)
    streamed = [c for out in _outputs(tokenizer, TWO_CALLS) for c in builder.step(out).tool_calls]
    whole = builder.response(builder.finish_reason("stop"), False)["choices"][0]["message"]["tool_calls"]
    places = [json.loads(c["function"]["arguments"])["location"] for c in whole]
    assert places == (["Tokyo"] if one_call else ["Tokyo", "Paris"])
    assert {c["index"] for c in streamed} == ({0} if one_call else {0, 1})
