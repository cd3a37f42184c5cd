"""Phase 1 against the families' published chat templates: what the probes find, and that no
template loses the user's words, tools or call ids. Real processors, as mlx_vlm.load gives them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import pytest
from PIL import Image

from vlmserve.preprocess.prompt import PromptBuilder, tokenizer_of
from vlmserve.preprocess.template import TemplateInfo
from vlmserve.testing import ARCHS, build_model
from vlmserve.testing.tool_tuning import AFTER_CALL, WEATHER_TOOL

ALL = frozenset({"system", "user", "assistant"})
# What each published template needs; anything not listed is a template that needs no help.
EXPECTED = {
    "gemma3": TemplateInfo(renders_tools=False, renders_calls=False, user_runs=False),
    "qwen2_vl": TemplateInfo(renders_tools=False, renders_calls=False),
    "qwen2_5_vl": TemplateInfo(renders_tools=False, renders_calls=False),
    "qwen3_vl": TemplateInfo(tool_images=True),
    "qwen3_vl_moe": TemplateInfo(tool_images=True),
    "qwen3_5": TemplateInfo(opens_reasoning=True, tool_images=True),
    "qwen3_5_moe": TemplateInfo(opens_reasoning=True, tool_images=True),
    "glm4v": TemplateInfo(tool_images=True),
    "glm4v_moe": TemplateInfo(tool_images=True),
    "mistral3": TemplateInfo(nine_char_call_ids=True, user_runs=False, user_after_results=False,
                             tool_image_text="[IMG]"),
    "pixtral": TemplateInfo(renders_tools=False, text_in_content=True, renders_calls=False, user_runs=False),
    "smolvlm": TemplateInfo(parts_roles=ALL, renders_tools=False, renders_calls=False),
    "paligemma": TemplateInfo(renders_tools=False, system_role=False, renders_calls=False),
    "llava": TemplateInfo(parts_roles=ALL, renders_tools=False, renders_calls=False),
    "llava_next": TemplateInfo(parts_roles=ALL, renders_tools=False, renders_calls=False),
    "lfm2_vl": TemplateInfo(renders_tools=False, renders_calls=False),
    "internvl_chat": TemplateInfo(renders_tools=False, renders_calls=False),
    "llama4": TemplateInfo(tools_first_text=True, image_text="<|image|>"),
    "kimi_vl": TemplateInfo(ids_as_names=True),
}


@dataclass(frozen=True)
class Family:
    arch: str
    prompter: PromptBuilder

    def text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             instructions: str = "") -> str:
        return self.text_of(self.prompter.build(messages, [], tools, instructions).input_ids)

    def text_of(self, ids: list[int]) -> str:
        return tokenizer_of(self.prompter.processor).decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module", params=ARCHS)
def family(request: pytest.FixtureRequest) -> Family:
    from mlx_vlm.utils import load_processor

    importlib.import_module(f"mlx_vlm.models.{request.param}")  # registers mlx-vlm's processor classes
    processor = load_processor(build_model(request.param, "micro"), add_detokenizer=False)
    return Family(request.param, PromptBuilder.for_processor(processor))


def test_probes_find_what_each_template_needs(family: Family) -> None:
    assert family.prompter.template == EXPECTED.get(family.arch, TemplateInfo())


def test_plain_string_messages_keep_their_words(family: Family) -> None:
    """SmolVLM's and LLaVA's templates render a plain-string message as ``User: <end_of_utterance>``."""
    assert "zebra crossing at noon" in family.text([{"role": "user", "content": "zebra crossing at noon"}])


def test_tools_reach_every_prompt(family: Family) -> None:
    text = family.text([{"role": "user", "content": "Weather in Tokyo?"}], [WEATHER_TOOL])
    assert "get_weather" in text and "Current weather for a city." in text


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["no-tools", "tools"])
def test_a_finished_tool_call_and_its_result_reach_the_prompt(family: Family, tools: Any) -> None:
    """With tools or without (a client's follow-up turn, a harness replaying history): without, Qwen2-VL's,
    LFM2-VL's and InternVL's templates wrote the call as an empty assistant turn, SmolVLM's and LLaVA's the
    result as ``Tool: <end_of_utterance>`` too."""
    from vlmserve.api.messages import to_chat_input
    from vlmserve.api.schemas import ChatCompletionRequest
    from vlmserve.preprocess.media import MediaPolicy

    call = {**AFTER_CALL[2]["tool_calls"][0], "id": "call_x",  # an id Mistral's templates would refuse
            "function": {"name": "get_weather", "arguments": '{"location": "Ulaanbaatar"}'}}
    history = [*AFTER_CALL[:2], {**AFTER_CALL[2], "tool_calls": [call]}, {**AFTER_CALL[3], "tool_call_id": "call_x"}]
    chat = to_chat_input(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": history, **({"tools": tools} if tools else {})}), MediaPolicy(max_images=0))
    text = family.text(chat.messages, chat.tools)
    assert "21 degrees and sunny" in text
    if family.arch != "paligemma":  # its template keeps the last turn only
        assert "get_weather" in text and "Ulaanbaatar" in text


@pytest.mark.parametrize("system", [[], [{"role": "system", "content": "Be brief."}]], ids=["no-system", "system"])
def test_the_first_user_turns_parts_reach_the_prompt_with_tools(family: Family, system: Any) -> None:
    """Llama 4's template writes the first user turn into its tools preamble as ``content|trim``: parts were
    written as Python data (``[{'type': 'text', ...}]``) and an image was a 400 ("Found 0 placeholders")."""
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "zebra crossing at noon"}]}
    ids = family.prompter.build([*system, first], [image], [WEATHER_TOOL]).input_ids
    text = family.text_of(ids)
    assert "zebra crossing at noon" in text and "'type'" not in text
    alone = family.prompter.build([{"role": "user", "content": [{"type": "image"}]}], [image]).input_ids
    assert _image_tokens(family, ids) == _image_tokens(family, alone)


def test_instructions_land_where_the_template_keeps_system_text(family: Family) -> None:
    assert "Answer in JSON." in family.text([{"role": "user", "content": "hi"}], instructions="Answer in JSON.")


# The templates that write an image part of a tool message as their image placeholder, inside the result
KEEP_TOOL_IMAGES = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe"})
# Mistral 3.2's refuses a user turn after tool results: the placeholder is written in the result's text, and the
# user's words after results join the last one
INLINE_TOOL_IMAGES = frozenset({"mistral3"})
SHOT_CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "screenshot", "arguments": {"region": "top-left"}}}
CALLED = [{"role": "user", "content": "Check the settings page."},
          {"role": "assistant", "content": "", "tool_calls": [SHOT_CALL]}]
SHOT = [{"type": "text", "text": "Screenshot taken."}, {"type": "image"}]


def _image_tokens(family: Family, ids: list[int]) -> int:
    return sum(i in family.prompter.media_token_ids for i in ids)  # none found for InternVL's processor


def test_a_tool_results_image_stays_in_it_only_where_the_template_writes_it_there(family: Family) -> None:
    """Keeping templates get the image inside the result (the prompt differs from the image in a user turn
    after it, with the same image tokens); Mistral 3.2's, which takes no user turn there, gets it written in the
    result's text (and the user turn after it joins the result); every other template gets exactly the prompt of
    that user turn."""
    inside = [*CALLED, {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": SHOT}]
    after = [*CALLED, {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "Screenshot taken."},
             {"role": "user", "content": [{"type": "image"}]}]
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    ids_inside = family.prompter.build(inside, [image]).input_ids
    if family.arch in INLINE_TOOL_IMAGES:
        ids_after = family.prompter.build(after, [image]).input_ids
        assert "[TOOL_CONTENT]Screenshot taken.\n\n[IMG]" in family.text_of(ids_after)
        alone = family.prompter.build([{"role": "user", "content": [{"type": "image"}]}], [image]).input_ids
        assert _image_tokens(family, ids_inside) == _image_tokens(family, ids_after) == _image_tokens(family, alone) > 0
        assert "[TOOL_CONTENT]Screenshot taken.[IMG]" in family.text_of(ids_inside)
        return
    ids_after = family.prompter.build(after, [image]).input_ids
    assert (ids_inside != ids_after) == (family.arch in KEEP_TOOL_IMAGES)
    images_inside, images_after = _image_tokens(family, ids_inside), _image_tokens(family, ids_after)
    assert images_inside == images_after and (images_inside > 0 or family.arch not in KEEP_TOOL_IMAGES)


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["no-tools", "tools"])
@pytest.mark.parametrize("then", [[], [{"role": "user", "content": "What do you see?"}]], ids=["last", "user-after"])
@pytest.mark.parametrize("shot", [SHOT, [{"type": "image"}]], ids=["text-image", "image-only"])
def test_every_template_takes_a_screenshot_in_a_tool_result(family: Family, tools: Any, then: Any, shot: Any) -> None:
    """Gemma 3's, Pixtral's and LLaVA-NeXT's take no tool message, and Gemma 3's and Pixtral's no two user turns
    in a row: the result is a user turn and its image joins it. Mistral 3.2's takes no user turn after results
    (mistral-common did not either before 1.11.1): the user's words join the result. Without tools, SmolVLM's
    refused an image-only result ("str object has no element 0"), and lost a result's text with LLaVA's."""
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    messages = [*CALLED, {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": shot}, *then]
    ids = family.prompter.build(messages, [image], tools).input_ids
    text = family.text_of(ids)
    assert "What do you see?" in text or not then
    if family.arch != "paligemma":  # its template keeps the last turn only
        assert "Check the settings page." in text and "top-left" in text  # the call's argument
        assert "Screenshot taken." in text or shot is not SHOT
    alone = family.prompter.build([{"role": "user", "content": [{"type": "image"}]}], [image]).input_ids
    assert _image_tokens(family, ids) == _image_tokens(family, alone)


def test_the_users_words_after_tool_results_reach_every_template(family: Family) -> None:
    """Claude Code's shape: tool_result blocks and a text block in one user message. Mistral 3.2's template takes
    no user turn after results (was a 400, "roles must alternate"): the words join the last result."""
    calls = [{**SHOT_CALL, "id": f"a1b2c3d4{i}"} for i in range(2)]
    messages = [CALLED[0], {"role": "assistant", "content": "", "tool_calls": calls},
                *[{"role": "tool", "tool_call_id": f"a1b2c3d4{i}", "content": f"Shot {i} taken."} for i in range(2)],
                {"role": "user", "content": [{"type": "text", "text": "What do you see?"}]}]
    text = family.text(messages)
    assert "What do you see?" in text
    if family.arch in INLINE_TOOL_IMAGES:
        assert "[TOOL_CONTENT]Shot 0 taken.[/TOOL_RESULTS]" in text
        assert "[TOOL_CONTENT]Shot 1 taken.\n\nWhat do you see?[/TOOL_RESULTS]" in text
    elif family.arch != "paligemma":
        assert "Shot 0 taken." in text and "Shot 1 taken." in text
