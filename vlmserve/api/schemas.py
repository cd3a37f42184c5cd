"""[loop] Pydantic schemas of the OpenAI chat completions API, validated at the edge only."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CACHE_TTL_S = 3600.0
SEED_MAX = 2**64 - 1  # what the sampler's random key takes
CONTENT_PART_TYPES = ("text", "image_url", "video_url", "input_audio")


class _Lenient(BaseModel):
    # Clients send fields we do not use (OpenAI adds them often); ignore, never fail on them.
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Lenient):
    url: str


class VideoPart(_Lenient):
    type: Literal["video_url"]  # vLLM's
    video_url: VideoURL


class InputAudio(_Lenient):
    data: str  # base64 (a data URL's base64 part is taken too)
    format: str  # "wav" or "mp3" (preprocess/audio.py says which else is refused)


class AudioPart(_Lenient):
    type: Literal["input_audio"]  # OpenAI's
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | VideoPart | AudioPart, Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, content: Any) -> Any:
        """Name an unsupported part and its type, instead of pydantic's guess at the union."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in CONTENT_PART_TYPES:
                    what = f"type {kind!r}" if kind is not None else f"no 'type' ({type(part).__name__})"
                    raise ValueError(f"content part {i} has {what}; this server takes "
                                     f"{', '.join(CONTENT_PART_TYPES[:-1])} and {CONTENT_PART_TYPES[-1]} parts")
        return content


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class Prediction(_Lenient):
    """OpenAI's Predicted Outputs: text the output is expected to be, or to be close to (an edit)."""

    type: Literal["content"]
    content: str | list[TextPart] = Field(max_length=1 << 20)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """The sampling fields the chat and the (legacy) completions APIs share, and their limits."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)  # token id (a string) to bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    prediction: Prediction | None = None
    # Extensions, as vLLM and mlx-lm name them.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)
    # vlmserve's: keep this prompt's cached prefix from eviction this many seconds (how the Messages API's
    # cache_control breakpoints reach the engine; at most Anthropic's longest TTL, an hour)
    cache_ttl: float | None = Field(default=None, gt=0, le=MAX_CACHE_TTL_S)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: each prompt token's, and k best
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call a reply (the first the model writes)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the chat template's own variables (enable_thinking)
    # min_pixels/max_pixels for images, fps/max_frames for videos, as vLLM takes them
    mm_processor_kwargs: dict[str, int | float] | None = None
    # vLLM's older names for structured_outputs' fields (one of them, and not beside it)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # would change the output; refused, never ignored

    @model_validator(mode="after")
    def _guided_as_structured_outputs(self) -> ChatCompletionRequest:
        given = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                   ("choice", self.guided_choice), ("grammar", self.guided_grammar)) if v is not None}
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported (JSON is written without free whitespace)")
        if not given:
            return self
        if self.structured_outputs is not None:
            raise ValueError("give structured_outputs or vLLM's older guided_* fields, not both")
        if isinstance(self.guided_json, str):
            try:
                given["json"] = json.loads(self.guided_json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided_json is not JSON: {exc}") from None
        self.structured_outputs = StructuredOutputs.model_validate(given)
        return self


class StructuredOutputs(_Lenient):
    """vLLM's extension: constrain the output to one of these (exactly one)."""

    json_schema: dict[str, Any] | None = Field(default=None, alias="json")  # a JSON schema ("json": BaseModel's name)
    regex: str | None = Field(default=None, max_length=10_000)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1_000)
    grammar: str | None = Field(default=None, max_length=100_000)  # Lark, as llguidance reads it
