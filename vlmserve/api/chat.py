"""[loop] POST /v1/chat/completions: one request from body to response, streaming or not; Responses and
Messages run their requests through it as chat requests (``serve_call``), submitted by ``flight.Flight``."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vlmserve.api.errors import APIError, bad_request
from vlmserve.api.flight import (
    GONE,
    SSE_HEADERS,
    Flight,
    all_or_none,
    choice_count,
    predicted,
    refuse_if_draining,
    sse_event,
    until_done_or_disconnect,
)
from vlmserve.api.messages import ChatInput, guide_spec, to_chat_input, to_sampling_params
from vlmserve.api.openai_format import ChoiceBuilder, choices_usage
from vlmserve.api.schemas import ChatCompletionRequest
from vlmserve.api.state import ServedModel, ServerState
from vlmserve.api.timing import Timing
from vlmserve.frontend.async_engine import ImagePrompt, PromptFactory
from vlmserve.frontend.output import RequestOutput
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.guided import GuideError
from vlmserve.preprocess.media import MediaPolicy, load_audio_source, load_image_source, load_video_source
from vlmserve.preprocess.prompt import PromptBuilder
from vlmserve.preprocess.video import VideoSampling


def prompt_factory(chat: ChatInput, media: MediaPolicy, request_id: str,
                   add_generation_prompt: bool = True) -> PromptFactory | ImagePrompt:
    """Phase 1 for the pool: fetch and decode the images and videos, then template and tokenize (a
    request with either in the image lane)."""

    def make(prompter: PromptBuilder) -> PromptInputs:
        limit = prompter.image_limit
        images = [load_image_source(url, media, f"image {i + 1}", limit) for i, url in enumerate(chat.image_urls)]
        sampling = chat.video_sampling.merge(prompter.video_sampling or VideoSampling())
        videos = [load_video_source(url, media, sampling, f"video {i + 1}") for i, url in enumerate(chat.video_urls)]
        rate = prompter.audio_rate or 0  # chat_input refused audio to a model without a feature extractor
        audio = [load_audio_source(data, fmt, media, rate, f"audio {i + 1}") for i, (data, fmt) in enumerate(chat.audio)]
        low = [detail == "low" for detail in chat.image_details]
        image_kwargs = dict(chat.image_kwargs)
        if limit is not None and any(low):
            images = [limit.low_detail(image) if is_low else image for image, is_low in zip(images, low)]
            if all(low):
                image_kwargs.update(limit.low_detail_kwargs())
        return prompter.build(chat.messages, images, chat.tools, chat.instructions, request_id,
                              add_generation_prompt, chat.template_kwargs, image_kwargs, videos, audio)

    return ImagePrompt(make) if chat.image_urls or chat.video_urls or chat.audio else make


def chat_input(req: ChatCompletionRequest, state: ServerState, served: ServedModel) -> ChatInput:
    """A chat request as phase 1 takes it, under the server's media policy; media the model cannot
    take is a 400 naming the model, before anything is fetched or decoded."""
    engine = served.engine
    chat = to_chat_input(req, state.media, state.config.default_chat_template_kwargs, engine.info.max_pixels,
                         served.tool_parser)
    refused = engine.media_refusal(len(chat.image_urls), len(chat.video_urls), len(chat.audio))
    if refused is not None:
        raise bad_request(refused, "messages", "unsupported_media")
    state.billing_headers_dropped(chat.billing_headers, served.name)
    return chat


@dataclass(slots=True)
class Fork:
    """A choice of a chat request: its own builder over the flight's choice ``index`` (0: the request's own,
    1..n-1: its forks, n > 1)."""

    index: int
    builder: ChoiceBuilder
    finish: str = "error"


@dataclass(slots=True)
class Call:
    """One chat request in flight: what the response needs, and its timing for logs and metrics."""

    state: ServerState
    served: ServedModel
    req: ChatCompletionRequest
    flight: Flight
    first: RequestOutput  # the request's first output (choice 0's)
    timing: Timing
    choices: list[Fork]  # every choice, in order

    @property
    def builder(self) -> ChoiceBuilder:
        return self.choices[0].builder

    @property
    def forks(self) -> list[Fork]:
        return self.choices[1:]

    @property
    def finish(self) -> str:
        return self.choices[0].finish

    @finish.setter
    def finish(self, reason: str) -> None:
        self.choices[0].finish = reason

    @property
    def usage(self) -> dict[str, Any]:
        return choices_usage([c.builder.usage for c in self.choices])

    def done(self, status: str, detail: str = "") -> None:
        self.timing.record(status, self.usage, detail)


Events = Callable[[Call], AsyncIterator[str]]


async def create_chat_completion(req: ChatCompletionRequest, http: Request, state: ServerState) -> Any:
    return await serve_call(req, http, state, f"chatcmpl-{uuid.uuid4().hex}", _sse, _whole)


async def serve_call(body: ChatCompletionRequest, http: Request, state: ServerState, request_id: str,
                     events: Events, whole: Callable[[Call, RequestOutput], dict[str, Any]],
                     media_type: str = "text/event-stream") -> Any:
    """A request of the chat family (chat completions, Responses, Anthropic's Messages, Ollama's chat and
    generate) run as the chat request ``body``: its ``events`` (of ``media_type``) when it streams, else
    ``whole`` of choice 0's last output; 499 when the client left first (the request is aborted)."""
    call = await open_call(body, http, state, request_id)
    if call is None:
        return JSONResponse({}, status_code=499)
    if body.stream:
        return StreamingResponse(events(call), media_type=media_type, headers=SSE_HEADERS)
    last = await until_done_or_disconnect(http, run_to_end(call), lambda: [call.flight])
    if last is GONE:
        call.done("disconnected")
        return JSONResponse({}, status_code=499)
    return JSONResponse(whole(call, last))


async def open_call(req: ChatCompletionRequest, http: Request, state: ServerState, request_id: str) -> Call | None:
    """Submit a chat request and wait for its first output (so that errors are still statuses);
    None when the client went away first (the request is aborted). A model on demand is loaded first, and
    kept loaded until the request is in flight (then its engine counts it)."""
    refuse_if_draining(state)
    async with state.using(req.model) as served:
        return await _open(req, http, state, request_id, served)


async def _open(req: ChatCompletionRequest, http: Request, state: ServerState, request_id: str,
                served: ServedModel) -> Call | None:
    engine = served.engine
    chat = chat_input(req, state, served)
    tokenizer = engine.tokenizer  # the loop's own copy
    params = to_sampling_params(req, state.config.default_max_tokens, len(tokenizer) if tokenizer is not None else 0)
    if chat.tools and served.tool_parser:
        params = dataclasses.replace(params, skip_special_tokens=False)  # the parser needs the markers
    params = await predicted(params, req, engine)
    opens_reasoning = engine.opens_reasoning_with(chat.template_kwargs)  # enable_thinking: false closes it
    wanted = guide_spec(req, served.tool_parser)
    if wanted is not None:
        if params.min_tokens:  # the grammar's end is a stop token: it could not end
            raise bad_request(f"min_tokens: not with {wanted[1]} (a constrained answer ends where its grammar does)",
                              "min_tokens", "unsupported_value")
        try:
            params = dataclasses.replace(params, guide=await engine.guide(wanted[0], opens_reasoning))
        except (GuideError, ValueError) as exc:
            raise bad_request(f"{wanted[1]}: {exc}", wanted[1], "invalid_grammar") from None
    n = choice_count(req.n, engine.info.max_batch_size)
    timing = Timing(state.metrics, served.name, request_id)
    flight = Flight(engine, request_id, prompt_factory(chat, state.media, request_id), params, n, timing.observe,
                    lambda: state.draining, "messages")
    try:
        first = await until_done_or_disconnect(http, flight.start(), lambda: [flight])
    except APIError as error:
        await flight.close()
        raise timing.failed(error) from None
    if first is GONE:
        timing.record("disconnected", {})
        return None
    return Call(state, served, req, flight, first, timing, [
        Fork(i, ChoiceBuilder(request_id, served.name, tokenizer, served.tool_parser, chat.tools, opens_reasoning, i,
                              one_call=req.parallel_tool_calls is False))
        for i in range(n)])


async def run_to_end(call: Call) -> RequestOutput:
    """Every choice's outputs through its builder; sets each one's finish, records the request, and
    returns choice 0's last output."""
    try:
        lasts = await all_or_none([_to_end(call, choice) for choice in call.choices])
    except APIError as error:
        raise call.timing.failed(error, call.usage) from None
    finally:
        await call.flight.close()
    for choice, last in zip(call.choices, lasts):
        choice.finish = choice.builder.finish_reason(last.finish_reason)
    call.done(call.finish)
    return lasts[0]


async def _to_end(call: Call, choice: Fork) -> RequestOutput:
    out = call.first
    async for out in call.flight.outputs(choice.index):
        choice.builder.step(out)
    return out


def _whole(call: Call, _: RequestOutput) -> dict[str, Any]:
    want = bool(call.req.logprobs)
    others = [f.builder.choice(f.finish, want) for f in call.forks]
    return call.builder.response(call.finish, want, others, call.usage)


async def _sse(call: Call) -> AsyncIterator[str]:
    """The stream: each choice's role chunk, then their outputs as they come (with n > 1 one output
    of each choice in turn: they decode in the same steps), the usage once every choice has ended."""
    choices = call.choices
    status = "disconnected"
    try:
        try:
            for choice in choices:
                yield sse_event(choice.builder.chunk({"role": "assistant", "content": ""}))
            live: list[Fork] = list(choices)
            while live:
                for choice in list(live):
                    out = await call.flight.next(choice.index)
                    for chunk in _chunks(choice, out):
                        yield sse_event(chunk)
                    if out.finished:
                        live.remove(choice)
            status = call.finish
            if call.req.stream_options and call.req.stream_options.include_usage:
                yield sse_event(call.builder.usage_chunk(call.usage))
        except APIError as error:  # the stream has begun: the error is its last event
            status = "error"
            yield sse_event(error.body())
        yield "data: [DONE]\n\n"
    finally:
        call.done(status)
        await call.flight.close()


def _chunks(choice: Fork, out: RequestOutput) -> list[dict[str, Any]]:
    b = choice.builder
    delta = b.step(out)
    chunks = []
    if delta:
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        if body or delta.logprobs:
            chunks.append(b.chunk(body, logprobs=delta.logprobs or None))
        # One tool-call entry per chunk, as OpenAI sends them: the first of a call carries its id, type
        # and name, later ones argument text. Two entries of one index in one chunk make the openai
        # SDK 2.x accumulator and llama-index see two calls, one nameless.
        chunks.extend(b.chunk({"tool_calls": [call]}) for call in delta.tool_calls)
    if out.finished:
        choice.finish = b.finish_reason(out.finish_reason)
        chunks.append(b.chunk({}, choice.finish))
    return chunks
