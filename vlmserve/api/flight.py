"""[loop] The one request path every endpoint takes to the engine: a prompt in flight.

A ``Flight`` is one prompt submitted with its further choices (n > 1, the engine's forks). It waits
for the first output, so that a refusal (phase 1's, the engine's admission) is still an HTTP status. It
reads each choice's outputs, each one timed, and raises an engine fault as the API's error. Closing it
aborts whatever still runs. ``until_done_or_disconnect`` races a request's work against its client
leaving. Chat completions, Responses, Messages and completions all submit through here; each
endpoint only translates its shapes (``chat.Call`` for the chat family, ``completions`` for prompts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from vlmserve.api.errors import APIError, bad_request, retry_after
from vlmserve.api.schemas import SamplingFields
from vlmserve.engine.params import SamplingParams
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
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.images import ImageError
from vlmserve.preprocess.prompt import PromptError
from vlmserve.preprocess.video import VideoError

if TYPE_CHECKING:
    from vlmserve.api.state import ServerState

T = TypeVar("T")

Stream = AsyncGenerator[RequestOutput, None]

# What phase 1 and the engine refuse a request with, before its first token: the API's 4xx/503s
REFUSALS = (ImageError, PromptError, PromptTooLongError, OverBudgetError, EngineOverloadedError, EngineNotReadyError)


class Flight:
    """One prompt in the engine with its ``n`` choices: choice 0 is the request, the others its forks
    (prefilled once; choice i samples as the request with seed + i would)."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt: PromptInputs | PromptFactory | ImagePrompt,
                 params: SamplingParams, n: int, observe: Callable[[RequestOutput], None],
                 draining: Callable[[], bool], param: str) -> None:
        forks = [(f"{request_id}-{i}", fork_params(params, i)) for i in range(1, n)]
        self.request_id = request_id
        # The forks' streams are read only once the request's first output came (then they exist)
        self.streams: list[Stream] = [engine.generate(request_id, prompt, params, forks),
                                      *(engine.follow(fork_id, p) for fork_id, p in forks)]
        self._observe, self._draining, self._param = observe, draining, param
        self._given: list[RequestOutput | None] = [None] * n

    async def start(self) -> RequestOutput:
        """The request's first output: once it is here, the prompt is in the engine and its forks' outputs
        exist. Anything before it (a refusal, a fault) raises the API's error."""
        first = await self.next(0)
        self._given[0] = first  # choice 0's outputs begin with it
        return first

    async def next(self, i: int = 0) -> RequestOutput:
        """Choice ``i``'s next output, timed; the engine's refusal or fault as the API's error."""
        given, self._given[i] = self._given[i], None
        if given is not None:
            return given
        try:
            out = await self.streams[i].__anext__()
        except REFUSALS as exc:
            raise refusal(exc, self._param) from None
        except StopAsyncIteration:
            raise engine_fault(self.request_id, "no output", self._draining()) from None
        if out.finish_reason == "error":
            raise engine_fault(self.request_id, out.error, self._draining())
        self._observe(out)
        return out

    async def outputs(self, i: int = 0) -> AsyncIterator[RequestOutput]:
        """Choice ``i``'s outputs until its last."""
        while True:
            out = await self.next(i)
            yield out
            if out.finished:
                return

    async def close(self) -> None:
        """End every choice's stream: those still running are aborted on the worker at its next step."""
        for stream in self.streams:
            await stream.aclose()


def refuse_if_draining(state: ServerState) -> None:
    """A server shutting down takes no new generation (running ones finish)."""
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another replica", "service_unavailable", None,
                       "shutting_down")


async def all_or_none(works: Iterable[Awaitable[T]]) -> list[T]:
    """Await every one of ``works`` side by side; the first error cancels the others, and is raised once
    they have ended (so that nothing still reads a stream its caller is about to close)."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def fork_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i``'s sampling: the request's, with seed + i when it has a seed (as vLLM does)."""
    return params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**64)


def choice_count(given: int | None, max_batch: int) -> int:
    """``n``: the choices (per prompt), each a row of the batch (they share one prefill)."""
    n = 1 if given is None else given
    if not 1 <= n <= max_batch:
        raise bad_request(f"n: {n} choices; this server takes 1 to {max_batch} (each is a row of its batch of "
                          f"{max_batch})", "n", "invalid_value")
    return n


async def predicted(params: SamplingParams, req: SamplingFields, engine: AsyncEngine) -> SamplingParams:
    """``params`` with the request's ``prediction`` as token ids (tokenized on the pool): the engine
    verifies them as drafts, so they make the output no different, only sooner where they are right."""
    if req.prediction is None or not req.prediction.text:
        return params
    text = req.prediction.text
    ids = await engine.on_pool(lambda p: p.tokenize(text, add_special_tokens=False))
    return dataclasses.replace(params, prediction=tuple(ids))


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


def engine_fault(request_id: str, message: str | None, draining: bool = False) -> APIError:
    """How a request the engine ended with an error is answered: a fault is a 500; a request the
    server's drain ended (queued or running) is a 503 ``shutting_down``, as a new one would be."""
    if draining:
        return APIError(503, f"request {request_id} was ended: the server is shutting down; retry on another "
                             "replica", "service_unavailable", None, "shutting_down")
    return APIError(500, f"request {request_id} failed in the engine: {message}", "server_error", None, "engine_error")


GONE = object()  # the client disconnected


async def until_done_or_disconnect(http: Request, work: Awaitable[Any], flights: Callable[[], list[Flight]]) -> Any:
    """Await ``work`` unless the client goes away first: then cancel it, close its ``flights`` (their
    requests are aborted) and return ``GONE``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for flight in flights():
            await flight.close()
        return GONE
    finally:
        watcher.cancel()


async def disconnected(http: Request) -> None:
    """Returns when the client has gone away."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# JSON leaves these three line breaks raw, and readers that split lines as Python's str.splitlines
# does (httpx's iter_lines among them) would get an event cut in two. Models emit them from byte
# tokens; escaped, the text a client decodes is the same.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: dict[str, Any], kind: str | None = None) -> str:
    """One server-sent event: ``payload`` as one line of JSON that every SSE reader keeps whole."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return f"event: {kind}\ndata: {data}\n\n" if kind else f"data: {data}\n\n"
