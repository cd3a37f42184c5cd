"""[loop] POST /v1/completions: the legacy text completions API over the same engine.

A prompt is a string, a list of strings, token ids, or a list of token-id lists; each becomes its
own choice (``index`` in prompt order), and the batch's prompts run side by side, as many at once
as the batch takes. Strings are tokenized on the pool as the model's tokenizer does (its BOS
included). ``echo`` puts the prompt's text before the completion; ``max_tokens: 0`` with ``echo``
answers with the prompt alone. ``logprobs: k`` gives the legacy shape (``tokens``,
``token_logprobs``, ``top_logprobs`` with k alternatives, ``text_offset``) for the generated tokens;
with ``echo``, for the prompt's own tokens first (each given those before it, the first ``null``:
what lm-evaluation-harness's ``local-completions`` scores likelihoods with; such a prompt is
prefilled alone, by tokens, and reuses no cached prefix).

``n`` choices per prompt (index ``prompt * n + j``) are the engine's forks: the prompt is prefilled
once, and choice j samples as a request with seed + j would.

Refused with a 400, never ignored: ``best_of`` over 1, ``suffix``, and a
prompt holding the model's image, video or audio placeholder (no pixels come with it). Other special
tokens are the prompt's own business: a raw completion prompt writes its chat turns itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

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
from vlmserve.api.messages import sampling_params
from vlmserve.api.openai_format import PREDICTION_USAGE
from vlmserve.api.schemas import SamplingFields
from vlmserve.api.state import ServedModel, ServerState
from vlmserve.api.timing import Timing
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.output import RequestOutput
from vlmserve.frontend.token_bytes import token_text_and_bytes
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.prompt import PromptBuilder

MAX_PROMPTS = 256  # prompts in one request


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy API's: alternatives per token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


@dataclasses.dataclass(slots=True)
class Choice:
    """One prompt's completion as it grows."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    text: str = ""
    finish_reason: str | None = None
    tokens: list[str] = dataclasses.field(default_factory=list)
    token_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = dataclasses.field(default_factory=list)
    text_offset: list[int] = dataclasses.field(default_factory=list)
    completion_tokens: int = 0
    prediction: tuple[int, int] = (0, 0)  # OpenAI's accepted and rejected prediction tokens
    fork: bool = False  # n > 1: a further choice of the prompt before it (its prompt is counted once)


async def create_completion(req: CompletionRequest, http: Request, state: ServerState) -> Any:
    refuse_if_draining(state)
    _refuse_unsupported(req)
    served = await state.acquire(req.model)  # held until every prompt ran: they may go one group at a time
    timing = Timing(state.metrics, served.name, f"cmpl-{uuid.uuid4().hex}")
    streams = False
    try:
        response = await _complete(req, http, state, served, timing)
        streams = isinstance(response, StreamingResponse)  # it releases the model (and records) as it ends
        return response
    except APIError as exc:
        raise timing.failed(exc) from None
    finally:
        if not streams:
            state.release(served)


async def _complete(req: CompletionRequest, http: Request, state: ServerState, served: ServedModel,
                    timing: Timing) -> Any:
    """``create_completion`` with the model loaded and leased. The first prompt's first output is awaited
    before the response begins, so that its refusal is still a status (as chat's); a later prompt's error
    ends a stream with an error event."""
    engine = served.engine
    vocab = len(engine.tokenizer) if engine.tokenizer is not None else 0
    prompts = await _prompt_ids(req, served, vocab)
    params = await predicted(_params(req, state, vocab), req, engine)
    texts = await asyncio.gather(*(engine.on_pool(partial(PromptBuilder.detokenize, token_ids=ids)) for ids in prompts)) \
        if req.echo else [""] * len(prompts)
    # echo: the text starts with the prompt's; max_tokens 0 (with echo): the prompt alone, no generation
    # unless its logprobs are asked (then one token is generated for them, and dropped)
    n = choice_count(req.n, engine.info.max_batch_size)
    groups = [[Choice(i * n + j, ids, text, text, fork=j > 0) for j in range(n)]
              for i, (ids, text) in enumerate(zip(prompts, texts))]
    choices = [c for group in groups for c in group]
    created = int(time.time())
    if req.max_tokens == 0:
        for choice in choices:
            choice.finish_reason = "length"
        if params.prompt_logprobs is None:  # the prompts alone
            if req.stream:
                return StreamingResponse(state.holding(served, _stream(created, served, choices, None, req, timing)),
                                         media_type="text/event-stream", headers=SSE_HEADERS)
            _record(timing, choices, "length")
            return JSONResponse(_body(timing.request_id, created, served.name, choices, req, usage=True))
    run = _Run(timing, served, groups, params, lambda: state.draining)
    begun = await until_done_or_disconnect(http, run.begin(), run.open_flights)
    if begun is GONE:
        _record(timing, choices, "disconnected")
        return JSONResponse({}, status_code=499)
    if req.stream:
        return StreamingResponse(state.holding(served, _stream(created, served, choices, run, req, timing)),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    done = await until_done_or_disconnect(http, run.all(), run.open_flights)
    if done is GONE:
        _record(timing, choices, "disconnected")
        return JSONResponse({}, status_code=499)
    _record(timing, choices, choices[0].finish_reason or "stop")
    return JSONResponse(_body(timing.request_id, created, served.name, choices, req, usage=True))


def _refuse_unsupported(req: CompletionRequest) -> None:
    if req.best_of not in (None, 1):
        raise bad_request("best_of: only 1 is supported", "best_of", "unsupported_value")
    if req.suffix:
        raise bad_request("suffix: insertion is not supported", "suffix", "unsupported_value")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens: 0 only with echo (the prompt alone)", "max_tokens", "invalid_value")


async def _prompt_ids(req: CompletionRequest, served: ServedModel, vocab: int) -> list[list[int]]:
    """Every prompt as token ids: strings tokenized on the pool, ids checked against the vocabulary."""
    raw = req.prompt
    items: list[str | list[int]] = []
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [[int(t) for t in raw if isinstance(t, int)]]  # one prompt of token ids
    else:
        items = [p if isinstance(p, str) else list(p) for p in raw if isinstance(p, (str, list))]
    if not items or len(items) > MAX_PROMPTS:
        raise bad_request(f"prompt: give 1 to {MAX_PROMPTS} prompts", "prompt", "invalid_value")
    engine = served.engine
    media = engine.info.media_token_ids
    out = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt.{i}"
        if isinstance(item, str):
            ids = await engine.on_pool(partial(PromptBuilder.tokenize, text=item, add_special_tokens=True))
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"{where}: {bad} is not a token id of model {served.name!r}", "prompt",
                                  "invalid_value")
        if not ids:
            raise bad_request(f"{where}: empty", "prompt", "invalid_value")
        placeholder = next((t for t in ids if t in media), None)
        if placeholder is not None:  # it would ask the model for image features nobody sent
            raise bad_request(f"{where}: token {placeholder} is the model's image (or video, audio) placeholder; "
                              "send images through /v1/chat/completions", "prompt", "control_token")
        out.append(ids)
    return out


def _params(req: CompletionRequest, state: ServerState, vocab: int) -> SamplingParams:
    params = sampling_params(req, max_tokens=req.max_tokens or 1, logprobs=req.logprobs is not None,
                             top_logprobs=req.logprobs or 0, vocab_size=vocab,
                             default_max_tokens=state.config.default_max_tokens)
    if req.echo and req.logprobs is not None:  # the prompt's own, as lm-evaluation-harness scores it
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    return params


class _Run:
    """Every prompt of one request through the engine, each with its further choices (n > 1) as one
    ``Flight``, as many at once as the batch takes; the first error ends all. Each output's tokens go
    to the request's timing (the gaps between them only where there is one choice: several would
    interleave). Streamed, each choice's news goes to ``updates``."""

    def __init__(self, timing: Timing, served: ServedModel, groups: list[list[Choice]], params: SamplingParams,
                 draining: Callable[[], bool]) -> None:
        self.timing, self.served, self.groups, self.params = timing, served, groups, params
        self.updates: asyncio.Queue[tuple[Choice, str, dict[str, Any] | None]] | None = None  # set to stream
        self._observe = partial(timing.observe, gaps=sum(map(len, groups)) == 1)
        self._draining = draining
        self._flights: list[Flight] = []
        self._room = asyncio.Semaphore(max(1, served.engine.info.max_batch_size // len(groups[0])))

    def open_flights(self) -> list[Flight]:
        return list(self._flights)

    async def begin(self) -> None:
        """The first prompt submitted and its first output come: until then, any error is the request's status."""
        await self._open(self.groups[0])

    async def all(self) -> None:
        """Every prompt to its end (the first one already begun)."""
        await all_or_none([self._group(i, group) for i, group in enumerate(self.groups)])

    async def _open(self, group: list[Choice]) -> Flight:
        """A prompt submitted in a slot of the batch, once its first output has come."""
        await self._room.acquire()
        flight = Flight(self.served.engine, f"{self.timing.request_id}-{group[0].index}",
                        PromptInputs(group[0].prompt_ids), self.params, len(group), self._observe, self._draining,
                        "prompt")
        self._flights.append(flight)
        try:
            await flight.start()
        except BaseException:
            self._room.release()
            await flight.close()
            raise
        return flight

    async def _group(self, i: int, group: list[Choice]) -> None:
        flight = self._flights[0] if i == 0 else await self._open(group)  # the first has begun
        try:
            await all_or_none([self._choice(flight, j, group) for j in range(len(group))])
        finally:
            self._room.release()
            await flight.close()

    async def _choice(self, flight: Flight, j: int, group: list[Choice]) -> None:
        """Choice ``j`` of a prompt's outputs; the prompt's logprobs (with the first) go to every choice of it."""
        choice, tokenizer = group[j], self.served.engine.tokenizer
        async for out in flight.outputs(j):
            if out.prompt_logprobs is not None and j == 0:
                for each in group:
                    await self._put(each, each.prompt_text, _prompt_logprobs(each, out.prompt_logprobs, tokenizer))
            if choice.finish_reason is not None:  # max_tokens 0: the token made for the prompt's logprobs
                if out.finished:
                    await self._put(choice, "", None)
                continue
            delta = out.text
            logprobs = _logprobs(choice, out, tokenizer) if self.params.logprobs else None
            choice.text += delta
            choice.completion_tokens = out.num_completion_tokens
            choice.prediction = (out.accepted_prediction_tokens, out.rejected_prediction_tokens)
            if out.finished:
                choice.finish_reason = "length" if out.finish_reason == "length" else "stop"
            if delta or logprobs or out.finished:
                await self._put(choice, delta, logprobs)

    async def _put(self, choice: Choice, delta: str, logprobs: dict[str, Any] | None) -> None:
        if self.updates is not None:
            await self.updates.put((choice, delta, logprobs))


def _record(timing: Timing, choices: list[Choice], status: str) -> None:
    timing.record(status, _usage(choices), what=f"prompts={len(choices)} ")


def _prompt_logprobs(choice: Choice, scored: tuple[Any, ...], tokenizer: Any) -> dict[str, Any]:
    """The prompt's tokens in the legacy shape, the first with no logprob (nothing comes before it);
    they open the choice's arrays. Each position's alternatives include its own token."""
    new: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, lp in zip(choice.prompt_ids, scored):
        text = token_text_and_bytes(tokenizer, token_id)[0]
        new["tokens"].append(text)
        new["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            new["token_logprobs"].append(None)
            new["top_logprobs"].append(None)
            continue
        top = {token_text_and_bytes(tokenizer, t)[0]: p for t, p in lp.top}
        top[text] = lp.logprob
        new["token_logprobs"].append(lp.logprob)
        new["top_logprobs"].append(top)
    for key, values in new.items():
        getattr(choice, key)[:0] = values
    return new


def _logprobs(choice: Choice, out: RequestOutput, tokenizer: Any) -> dict[str, Any]:
    """This step's tokens in the legacy shape, appended to the choice's too; a stop token that ended it
    comes last, as vLLM lists it (its text is not in the completion)."""
    new: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = len(choice.text)  # before this step's text joins it
    for lp in (*out.logprobs, out.stop_logprob):
        if lp is None:
            continue
        text, _ = token_text_and_bytes(tokenizer, lp.token_id)
        new["tokens"].append(text)
        new["token_logprobs"].append(lp.logprob)
        new["top_logprobs"].append({token_text_and_bytes(tokenizer, t)[0]: p for t, p in lp.top})
        new["text_offset"].append(offset)
        offset += len(text)
    choice.tokens += new["tokens"]
    choice.token_logprobs += new["token_logprobs"]
    choice.top_logprobs += new["top_logprobs"]
    choice.text_offset += new["text_offset"]
    return new


def _body(request_id: str, created: int, model: str, choices: list[Choice], req: CompletionRequest,
          usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason or "length",
                     "logprobs": _choice_logprobs(c) if req.logprobs is not None else None} for c in choices],
    }
    if usage:
        body["usage"] = _usage(choices)
    return body


def _choice_logprobs(choice: Choice) -> dict[str, Any]:
    return {"tokens": choice.tokens, "token_logprobs": choice.token_logprobs, "top_logprobs": choice.top_logprobs,
            "text_offset": choice.text_offset}


def _usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(len(c.prompt_ids) for c in choices if not c.fork)  # n > 1: each prompt prefilled once
    completion = sum(c.completion_tokens for c in choices)
    details = {name: sum(c.prediction[i] for c in choices) for i, name in enumerate(PREDICTION_USAGE)}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "completion_tokens_details": details}


async def _stream(created: int, served: ServedModel, choices: list[Choice], run: _Run | None,
                  req: CompletionRequest, timing: Timing) -> AsyncIterator[str]:
    """SSE: a chunk per choice per step, a last chunk with usage when asked, then [DONE]; an error
    after the stream began is an error event, then [DONE]. ``run`` has begun (None: the prompts alone)."""
    head = {"id": timing.request_id, "object": "text_completion", "created": created, "model": served.name}
    if req.echo and req.logprobs is None:  # with logprobs, the prompt comes with its own when known
        for choice in choices:
            yield sse_event({**head, "choices": [{"index": choice.index, "text": choice.prompt_text,
                                                  "logprobs": None, "finish_reason": choice.finish_reason}]})
    if run is None:
        _record(timing, choices, "length")
        yield "data: [DONE]\n\n"
        return
    updates = run.updates = asyncio.Queue()
    runner = asyncio.ensure_future(run.all())
    status = "disconnected"
    try:
        while not (runner.done() and updates.empty()):
            getter = asyncio.ensure_future(updates.get())
            await asyncio.wait({getter, runner}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            choice, delta, logprobs = getter.result()
            yield sse_event({**head, "choices": [{"index": choice.index, "text": delta, "logprobs": logprobs,
                                                  "finish_reason": choice.finish_reason}]})
        runner.result()  # its error, if any
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse_event({**head, "choices": [], "usage": _usage(choices)})
        status = choices[0].finish_reason or "stop"
    except APIError as exc:
        status = f"error_{exc.status}"
        yield sse_event({"error": exc.body()["error"]})
    finally:
        _record(timing, choices, status)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        for flight in run.open_flights():
            await flight.close()
    yield "data: [DONE]\n\n"
