"""[loop] POST /tokenize and /detokenize and GET /tokenizer_info in vLLM's shape, and GET /version.

Tokenizing runs on the preprocessing pool (a 30 s tokenization must not stall the loop): a plain
prompt through the model's tokenizer, or chat messages through the same phase 1 as a chat request
(template, images and all), so the count is what a chat request with them would cost.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlmserve.api.chat import chat_input, prompt_factory
from vlmserve.api.errors import bad_request
from vlmserve.api.flight import REFUSALS, refusal
from vlmserve.api.messages import chat_request
from vlmserve.api.schemas import ChatCompletionRequest, Message
from vlmserve.api.state import ServedModel, ServerState
from vlmserve.preprocess.prompt import PromptBuilder

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we do not know would change the count

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # a prompt: True; messages: False (the template writes them)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, int | float] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


async def tokenize(req: TokenizeRequest, state: ServerState) -> dict[str, Any]:
    async with state.using(req.model) as served:
        return await _tokenize(req, state, served)


async def _tokenize(req: TokenizeRequest, state: ServerState, served: ServedModel) -> dict[str, Any]:
    engine = served.engine
    try:
        if req.prompt is not None:
            text, special = req.prompt, req.add_special_tokens is not False
            ids = await engine.on_pool(lambda p: p.tokenize(text, special))
        else:
            ids = await chat_prompt_ids(_chat_body(req, served.name), state, req.add_generation_prompt)
    except REFUSALS as exc:
        raise refusal(exc, "prompt") from None
    strs = await engine.on_pool(lambda p: p.token_strings(ids)) if req.return_token_strs else None
    limit = engine.info.max_context
    return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}


async def tokenizer_info(model: str | None, state: ServerState) -> dict[str, Any]:
    """The tokenizer's configuration and chat template (``?model=``: which model; else the first)."""
    async with state.using(model) as served:
        info: dict[str, Any] = await served.engine.on_pool(lambda p: p.tokenizer_info())
    return info


def _chat_body(req: TokenizeRequest, model: str) -> ChatCompletionRequest:
    if req.add_special_tokens:
        raise bad_request("add_special_tokens: chat messages are tokenized as the chat template writes them",
                          "add_special_tokens", "unsupported_value")
    return chat_request({"model": model, "messages": req.messages, "tools": req.tools,
                         "chat_template_kwargs": req.chat_template_kwargs,
                         "mm_processor_kwargs": req.mm_processor_kwargs})


async def chat_prompt_ids(body: ChatCompletionRequest, state: ServerState, add_generation_prompt: bool = True) -> list[int]:
    """The prompt a chat request would cost: its phase 1 on the pool (template, images and all); what
    phase 1 refuses is the API's 4xx."""
    async with state.using(body.model) as served:
        engine = served.engine
        chat = chat_input(body, state, served)
        try:
            prompt = await engine.preprocess(prompt_factory(chat, state.media, f"tokenize-{uuid.uuid4().hex}",
                                                            add_generation_prompt))
        except REFUSALS as exc:
            raise refusal(exc, "messages") from None
    return prompt.input_ids


async def detokenize(req: DetokenizeRequest, state: ServerState) -> dict[str, str]:
    async with state.using(req.model) as served:
        return await _detokenize(req, served)


async def _detokenize(req: DetokenizeRequest, served: ServedModel) -> dict[str, str]:
    engine = served.engine
    vocab = len(engine.tokenizer) if engine.tokenizer is not None else 0
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: {bad} is not a token id of model {served.name!r} (0 to {vocab - 1})", "tokens",
                          "invalid_value")
    tokens = req.tokens

    def decode(prompter: PromptBuilder) -> str:
        return prompter.detokenize(tokens)

    try:
        return {"prompt": await engine.on_pool(decode)}
    except REFUSALS as exc:
        raise refusal(exc, "tokens") from None
