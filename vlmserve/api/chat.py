"""[loop] POST /v1/chat/completions: one request from body to response, streaming or not."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vlmserve.api.errors import APIError, bad_request, retry_after
from vlmserve.api.messages import ChatInput, guide_spec, to_chat_input, to_sampling_params
from vlmserve.api.openai_format import ChoiceBuilder, choices_usage
from vlmserve.api.schemas import ChatCompletionRequest, SamplingFields
from vlmserve.api.state import ServedModel, ServerState
from vlmserve.api.timing import Timing
from vlmserve.engine.params import PromptInputs, SamplingParams
from vlmserve.frontend.async_engine import (
    AsyncEngine,
    EngineNotReadyError,
    EngineOverloadedError,
    ImagePrompt,
    OverBudgetError,
    PromptFactory,
    PromptTooLongError,
)
from vlmserve.frontend.output import RequestOutput
from vlmserve.preprocess.guided import GuideError
from vlmserve.preprocess.images import ImageError
from vlmserve.preprocess.media import MediaPolicy, load_image_source, load_video_source
from vlmserve.preprocess.prompt import PromptBuilder, PromptError
from vlmserve.preprocess.video import VideoError, VideoSampling


def prompt_factory(chat: ChatInput, media: MediaPolicy, request_id: str,
                   add_generation_prompt: bool = True) -> PromptFactory | ImagePrompt:
    """Phase 1 for the pool: fetch and decode the images and videos, then template and tokenize (a
    request with either in the image lane)."""

    def make(prompter: PromptBuilder) -> PromptInputs:
        limit = prompter.image_limit
        images = [load_image_source(url, media, f"image {i + 1}", limit) for i, url in enumerate(chat.image_urls)]
        sampling = chat.video_sampling.merge(prompter.video_sampling or VideoSampling())
        videos = [load_video_source(url, media, sampling, f"video {i + 1}") for i, url in enumerate(chat.video_urls)]
        low = [detail == "low" for detail in chat.image_details]
        image_kwargs = dict(chat.image_kwargs)
        if limit is not None and any(low):
            images = [limit.low_detail(image) if is_low else image for image, is_low in zip(images, low)]
            if all(low):
                image_kwargs.update(limit.low_detail_kwargs())
        return prompter.build(chat.messages, images, chat.tools, chat.instructions, request_id,
                              add_generation_prompt, chat.template_kwargs, image_kwargs, videos)

    return ImagePrompt(make) if chat.image_urls or chat.video_urls else make


def chat_input(req: ChatCompletionRequest, state: ServerState, engine: AsyncEngine) -> ChatInput:
    """A chat request as phase 1 takes it, under the server's media policy; media the model cannot
    take is a 400 naming the model, before anything is fetched or decoded."""
    chat = to_chat_input(req, state.media, state.config.default_chat_template_kwargs, engine.info.max_pixels)
    refused = engine.media_refusal(len(chat.image_urls), len(chat.video_urls))
    if refused is not None:
        raise bad_request(refused, "messages", "unsupported_media")
    return chat


@dataclass(slots=True)
class Fork:
    """A further choice of a chat request with n > 1: its own builder and outputs (the engine's fork)."""

    builder: ChoiceBuilder
    stream: AsyncGenerator[RequestOutput, None]
    finish: str = "error"


@dataclass(slots=True)
class Call:
    """One chat request in flight: what the response needs, and its timing for logs and metrics."""

    state: ServerState
    served: ServedModel
    req: ChatCompletionRequest
    builder: ChoiceBuilder
    timing: Timing
    finish: str = "error"
    forks: list[Fork] = field(default_factory=list)  # choices 1..n-1

    @property
    def usage(self) -> dict[str, Any]:
        return choices_usage([self.builder.usage, *(f.builder.usage for f in self.forks)])

    async def close_forks(self) -> None:
        """End the further choices' streams (each one still running is aborted)."""
        for fork in self.forks:
            await fork.stream.aclose()

    def observe(self, out: RequestOutput) -> None:
        self.timing.observe(out)

    def done(self, status: str, detail: str = "") -> None:
        self.timing.record(status, self.usage, detail)


async def create_chat_completion(req: ChatCompletionRequest, http: Request, state: ServerState) -> Any:
    opened = await open_call(req, http, state, f"chatcmpl-{uuid.uuid4().hex}")
    if opened is None:
        return JSONResponse({}, status_code=499)  # nobody is listening; the request is aborted
    call, first, stream = opened
    if req.stream:
        return StreamingResponse(_sse(call, first, stream), media_type="text/event-stream", headers=SSE_HEADERS)
    response = await until_done_or_disconnect(http, _complete(call, first, stream), stream)
    return JSONResponse({}, status_code=499) if response is GONE else response


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Stream = AsyncGenerator[RequestOutput, None]


async def outputs(call: Call, first: RequestOutput, stream: Stream) -> AsyncIterator[RequestOutput]:
    """The call's outputs from ``first`` until the last (each one after ``first`` observed)."""
    out = first
    yield out
    while not out.finished:
        out = await stream.__anext__()
        call.observe(out)
        yield out


async def serve_call(body: ChatCompletionRequest, http: Request, state: ServerState, request_id: str,
                     events: Callable[[Call, RequestOutput, Stream], AsyncIterator[str]],
                     whole: Callable[[Call, RequestOutput], dict[str, Any]]) -> Any:
    """Another API's request (Responses, Anthropic's Messages) run as the chat request ``body``: its
    ``events`` when it streams, else ``whole`` of the last output; 499 when the client left first."""
    opened = await open_call(body, http, state, request_id)
    if opened is None:
        return JSONResponse({}, status_code=499)
    call, first, stream = opened
    if body.stream:
        return StreamingResponse(events(call, first, stream), media_type="text/event-stream", headers=SSE_HEADERS)
    last = await until_done_or_disconnect(http, run_to_end(call, first, stream), stream)
    return JSONResponse({}, status_code=499) if last is GONE else JSONResponse(whole(call, last))


async def open_call(req: ChatCompletionRequest, http: Request, state: ServerState,
                    request_id: str) -> tuple[Call, RequestOutput, AsyncGenerator[RequestOutput, None]] | None:
    """Submit a chat request and wait for its first output (so that errors are still statuses);
    None when the client went away first (the request is aborted). A model on demand is loaded first, and
    kept loaded until the request is in flight (then its engine counts it)."""
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another replica", "service_unavailable",
                       None, "shutting_down")
    async with state.using(req.model) as served:
        return await _open(req, http, state, request_id, served)


async def _open(req: ChatCompletionRequest, http: Request, state: ServerState, request_id: str,
                served: ServedModel) -> tuple[Call, RequestOutput, AsyncGenerator[RequestOutput, None]] | None:
    engine = served.engine
    chat = chat_input(req, state, engine)
    tokenizer = engine.tokenizer  # the loop's own copy
    params = to_sampling_params(req, state.config.default_max_tokens, len(tokenizer) if tokenizer is not None else 0)
    if chat.tools and served.tool_parser:
        params = dataclasses.replace(params, skip_special_tokens=False)  # the parser needs the markers
    params = await predicted(params, req, engine)
    opens_reasoning = engine.opens_reasoning_with(chat.template_kwargs)  # enable_thinking: false closes it
    wanted = guide_spec(req, served.tool_parser)
    if wanted is not None:
        try:
            params = dataclasses.replace(params, guide=await engine.guide(wanted[0], opens_reasoning))
        except (GuideError, ValueError) as exc:
            raise bad_request(f"{wanted[1]}: {exc}", wanted[1], "invalid_grammar") from None
    builder = ChoiceBuilder(request_id, served.name, tokenizer, served.tool_parser, chat.tools, opens_reasoning)
    call = Call(state, served, req, builder, Timing(state.metrics, served.name, request_id))
    forks = [(f"{request_id}-{i}", fork_params(params, i)) for i in range(1, choice_count(req.n, engine.info.max_batch_size))]
    stream = engine.generate(request_id, prompt_factory(chat, state.media, request_id), params, forks)
    call.forks = [Fork(ChoiceBuilder(request_id, served.name, tokenizer, served.tool_parser, chat.tools,
                                     opens_reasoning, i), engine.follow(fork_id, p))
                  for i, (fork_id, p) in enumerate(forks, 1)]
    first = await until_done_or_disconnect(http, _first_output(stream, call), stream)
    if first is GONE:
        await call.close_forks()
        return None
    return call, first, stream


async def predicted(params: SamplingParams, req: SamplingFields, engine: AsyncEngine) -> SamplingParams:
    """``params`` with the request's ``prediction`` as token ids (tokenized on the pool): the engine
    verifies them as drafts, so they make the output no different, only sooner where they are right."""
    if req.prediction is None or not req.prediction.text:
        return params
    text = req.prediction.text
    ids = await engine.on_pool(lambda p: p.tokenize(text, add_special_tokens=False))
    return dataclasses.replace(params, prediction=tuple(ids))


def choice_count(given: int | None, max_batch: int) -> int:
    """``n``: the choices (per prompt), each a row of the batch (they share one prefill)."""
    n = 1 if given is None else given
    if not 1 <= n <= max_batch:
        raise bad_request(f"n: {n} choices; this server takes 1 to {max_batch} (each is a row of its batch of "
                          f"{max_batch})", "n", "invalid_value")
    return n


def fork_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i``'s sampling: the request's, with seed + i when it has a seed (as vLLM does)."""
    return params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**64)


async def _first_output(stream: AsyncGenerator[RequestOutput, None], call: Call) -> RequestOutput:
    """Wait for the first output so that anything before a token can still be a proper status code."""
    try:
        first = await stream.__anext__()
    except REFUSALS as exc:
        raise failed(call, refusal(exc, "messages")) from None
    if first.finish_reason == "error":
        raise failed(call, engine_fault(call.builder.id, first.error, call.state.draining))
    call.observe(first)
    return first


# What phase 1 and the engine refuse a request with, before its first token: the API's 4xx/503s
REFUSALS = (ImageError, PromptError, PromptTooLongError, OverBudgetError, EngineOverloadedError, EngineNotReadyError)


def refusal(exc: Exception, param: str) -> APIError:
    """The API's answer to one of ``REFUSALS``; ``param``: where the prompt came from."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), "rate_limit_error", None, "overloaded", retry_after(exc.retry_after_s))
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), "service_unavailable", None, "not_ready", retry_after(exc.retry_after_s))
    if isinstance(exc, OverBudgetError):
        return bad_request(str(exc), "max_tokens", "kv_budget_exceeded")
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param, "context_length_exceeded")
    code = "invalid_video" if isinstance(exc, VideoError) else "invalid_image" if isinstance(exc, ImageError) else None
    return bad_request(str(exc), param, code)


def failed(call: Call, error: APIError) -> APIError:
    call.done(f"error_{error.status}", f" code={error.code or '-'}: {error.message[:200]}")
    error.logged = True  # the request's own line says it; the error handler need not
    return error


def engine_fault(request_id: str, message: str | None, draining: bool = False) -> APIError:
    """How a request the engine ended with an error is answered: a fault is a 500; a request the
    server's drain ended (queued or running) is a 503 ``shutting_down``, as a new one would be."""
    if draining:
        return APIError(503, f"request {request_id} was ended: the server is shutting down; retry on another "
                             "replica", "service_unavailable", None, "shutting_down")
    return APIError(500, f"request {request_id} failed in the engine: {message}", "server_error", None, "engine_error")


async def _complete(call: Call, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None]) -> JSONResponse:
    try:
        await asyncio.gather(run_to_end(call, first, stream), *(_fork_to_end(call, f) for f in call.forks))
    finally:
        await call.close_forks()
    if call.forks:
        call.done(call.finish)
    want = bool(call.req.logprobs)
    others = [f.builder.choice(f.finish, want) for f in call.forks]
    return JSONResponse(call.builder.response(call.finish, want, others, call.usage))


async def _fork_to_end(call: Call, fork: Fork) -> None:
    out = None
    async for out in fork.stream:
        call.observe(out)
        fork.builder.step(out)
    if out is None or out.finish_reason == "error":
        raise failed(call, engine_fault(call.builder.id, out.error if out is not None else "no output",
                                        call.state.draining))
    fork.finish = fork.builder.finish_reason(out.finish_reason)


async def run_to_end(call: Call, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """Every output through the call's builder; sets ``call.finish`` and logs the request."""
    try:
        out = first
        call.builder.step(out)
        while not out.finished:
            out = await stream.__anext__()
            call.observe(out)
            call.builder.step(out)
        if out.finish_reason == "error":
            raise failed(call, engine_fault(call.builder.id, out.error, call.state.draining))
        call.finish = call.builder.finish_reason(out.finish_reason)
        if not call.forks:  # with n > 1, once every choice has ended
            call.done(call.finish)
        return out
    finally:
        await stream.aclose()


GONE = object()  # the client disconnected


async def until_done_or_disconnect(http: Request, work: Awaitable[Any], stream: AsyncGenerator[RequestOutput, None]) -> Any:
    """Await ``work`` unless the client goes away first: then cancel it and abort the request."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()  # aborts on the worker at its next step
        return GONE
    finally:
        watcher.cancel()


async def disconnected(http: Request) -> None:
    """Returns when the client has gone away."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _sse(call: Call, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
    """The stream: each choice's role chunk, then their outputs as they come (with n > 1 one output
    of each choice in turn: they decode in the same steps), the usage once every choice has ended."""
    choices = [Fork(call.builder, stream), *call.forks]
    status = "disconnected"
    try:
        for choice in choices:
            yield sse_event(choice.builder.chunk({"role": "assistant", "content": ""}))
        live: list[Fork] = list(choices)
        given: RequestOutput | None = first
        while live:
            for choice in list(live):
                if given is not None:
                    out, given = given, None
                else:
                    out = await choice.stream.__anext__()
                    call.observe(out)
                if out.finish_reason == "error":
                    status = "error"
                    yield sse_event(engine_fault(call.builder.id, out.error, call.state.draining).body())
                    live = []
                    break
                for chunk in _chunks(choice, out):
                    yield sse_event(chunk)
                if out.finished:
                    live.remove(choice)
        if status != "error":
            status = call.finish = choices[0].finish
            if call.req.stream_options and call.req.stream_options.include_usage:
                yield sse_event(call.builder.usage_chunk(call.usage))
        yield "data: [DONE]\n\n"
    finally:
        call.done(status)
        await stream.aclose()
        await call.close_forks()


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


# JSON leaves these three line breaks raw, and readers that split lines as Python's str.splitlines
# does (httpx's iter_lines among them) would get an event cut in two. Models emit them from byte
# tokens; escaped, the text a client decodes is the same.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: dict[str, Any], kind: str | None = None) -> str:
    """One server-sent event: ``payload`` as one line of JSON that every SSE reader keeps whole."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return f"event: {kind}\ndata: {data}\n\n" if kind else f"data: {data}\n\n"
