"""[loop] The FastAPI app: routes, auth, body limits, and the engines' life cycle."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from vlmserve import __version__
from vlmserve.api import ollama, ollama_embed, ollama_input, probes
from vlmserve.api.anthropic import count_tokens, create_message
from vlmserve.api.anthropic_input import CountTokensRequest, MessagesRequest
from vlmserve.api.chat import create_chat_completion
from vlmserve.api.completions import CompletionRequest, create_completion
from vlmserve.api.errors import APIError, first_line, install_error_handlers, log_rejection
from vlmserve.api.memory_metrics import fresh_counters
from vlmserve.api.pooling import EmbeddingsRequest, RerankRequest, create_embeddings, rerank
from vlmserve.api.responses import create_response
from vlmserve.api.responses_input import ResponsesRequest
from vlmserve.api.schemas import ChatCompletionRequest
from vlmserve.api.state import ServedModel, ServerState
from vlmserve.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info
from vlmserve.api.transcriptions import create_transcription
from vlmserve.engine import worker_pool

log = logging.getLogger(__name__)


def create_app(state: ServerState, on_fatal: Callable[[str], None] | None = None,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The app starts every engine in the background (``/ready`` says when; then ``on_ready`` runs)
    and stops them on exit."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # anyio imports its asyncio backend on first use, a streamed response's: 15-20 ms of the loop here
        # (2 cores) that the first stream after start-up, a flood's included, would hold everyone for
        await anyio.sleep(0)
        starting = asyncio.create_task(_start_engines(state, on_fatal, on_ready))
        if state.registry is not None:
            state.registry.start()
        try:
            yield
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await stop_engines(state, "server is shutting down")

    # No /docs or /redoc: FastAPI's pages fetch their scripts from a CDN and are blank offline.
    # /openapi.json stays; the playground at / is served from files inside the package.
    app = FastAPI(title="vlmserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.vlmserve = state
    install_error_handlers(app, state.metrics)
    app.add_middleware(BodyLimit, max_bytes=state.config.max_request_bytes, on_reject=state.metrics.rejected)
    if state.config.api_key is not None:  # outside the body limit: a refused request's body is never read
        app.add_middleware(RequireKey, api_key=state.config.api_key, on_reject=state.metrics.rejected)
    if state.config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id", "X-Api-Key",
                                          "Anthropic-Version", "Anthropic-Beta"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(RequestId)  # outermost: every response carries one, refusals included
    _routes(app, state)
    return app


async def _start_engines(state: ServerState, on_fatal: Callable[[str], None] | None,
                         on_ready: Callable[[], None] | None) -> None:
    """Each pinned model (``--model``) in turn; one that fails does not stop the others loading, so that every
    bad ``--model`` is named at once. Any failure is fatal (one line each), reported once the rest are tried.
    The models of ``--model-dir`` load on demand (api/registry.py)."""
    failures = []
    for served in state.pinned:
        began = time.perf_counter()
        try:
            await served.engine.start()
        except Exception as exc:  # noqa: BLE001 - reported once, clearly, then the server exits
            said = first_line(exc)
            failures.append(said if "cannot load model" in said else f"model {served.name!r} failed to load: {said}")
            await served.engine.shutdown(said)
            continue
        served.loads, served.load_seconds = served.loads + 1, time.perf_counter() - began
        log.info("model %s ready (tool parser: %s)", served.name, served.tool_parser)
    if failures:
        message = "; ".join(failures)
        if on_fatal is None:
            log.error(message)
        else:
            on_fatal(message)
    elif on_ready is not None:
        on_ready()


async def stop_engines(state: ServerState, message: str) -> None:
    """Every waiting request gets an error (``shutting_down``: the server is draining); every worker joins."""
    state.draining = True
    if state.registry is not None:
        await state.registry.stop()
    loads = [m.transition for m in state.models if m.transition is not None and not m.transition.done()]
    for load in loads:  # a load on demand stops where it is; its waiters get the shutdown's error
        load.cancel()
    await asyncio.gather(*loads, return_exceptions=True)
    await asyncio.gather(*(m.engine.shutdown(message) for m in state.models), return_exceptions=True)
    # the threads that swapped models parked with their streams: end them before the process does
    await asyncio.get_running_loop().run_in_executor(None, worker_pool.end_parked)


def _routes(app: FastAPI, state: ServerState) -> None:
    """Every route: the playground and the probes here, then the models', the APIs' and the tokenizer's."""
    state.metrics.watch_engines(lambda: [(m.name, m.engine) for m in state.models])
    state.metrics.watch_models(lambda: list(state.models))

    web = importlib.resources.files("vlmserve") / "web"
    app.mount("/static", StaticFiles(directory=str(web)), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(str(web / "index.html"))

    # Plain probes are answered before the app, by the HTTP protocol (probes.py); these answer the rest.
    @app.get("/health")
    async def health() -> JSONResponse:
        return _probe_response(probes.health(state))

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return _probe_response(probes.readiness(state))

    @app.get("/metrics")
    async def metrics() -> Response:
        fresh = await fresh_counters([(m.name, m.engine) for m in state.models])  # an idle worker publishes nothing
        return Response(state.metrics.render(fresh), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    _model_routes(app, state)
    _api_routes(app, state)
    _ollama_routes(app, state)
    _tokenizer_routes(app, state)


def _model_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/models``: the list with each model's status, one model, and loading and unloading by hand."""
    def card(served: ServedModel) -> dict[str, Any]:
        engine = served.engine
        info = engine.info if engine.ready else None
        limit = info.max_context if info is not None else None
        status = served.status
        extra: dict[str, Any] = {"reason": served.problem or engine.dead_reason} if status in ("unavailable", "failed") else {}
        if status == "available" and served.last_error:
            extra["last_error"] = served.last_error  # its next request tries again
        if info is not None:  # which adapter serves it; for a family none names, what is off and why
            extra |= {"adapter": info.adapter, **({"untested": list(info.untested)} if info.untested else {})}
        return {"id": served.name, "object": "model", "created": info.created if info is not None else 0, "owned_by": "vlmserve",
                "root": engine.model_spec, "parent": None, "max_model_len": limit, "status": status,
                "pinned": served.pinned, "kind": engine.kind, **extra}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        if state.registry is not None:
            state.registry.rescan()
        return {"object": "list", "data": [card(m) for m in state.models]}

    @app.post("/v1/models/load")
    async def load(body: ModelAction) -> dict[str, Any]:
        """Load a model of --model-dir now (as its first request would); answers once it is loaded."""
        served = await state.acquire(body.model, kind=None)
        state.release(served)
        return card(served)

    @app.post("/v1/models/unload")
    async def unload(body: ModelAction) -> dict[str, Any]:
        """Unload a model of --model-dir now; 409 if it is pinned or has requests in flight."""
        served = state.model(body.model)
        if state.registry is None or served.pinned:
            raise APIError(409, f"model {served.name!r} is pinned (--model): it never unloads", "invalid_request_error",
                           "model", "model_pinned")
        await state.registry.unload_now(served)
        return card(served)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return card(state.model(model_id))


def _api_routes(app: FastAPI, state: ServerState) -> None:
    """The APIs: OpenAI's chat completions, Responses and completions, Anthropic's Messages."""
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(body, request, state)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        return await create_response(body, request, state)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Any:
        return await create_message(body, request, state)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_tokens(body, state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(body, request, state)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsRequest) -> dict[str, Any]:
        return await create_embeddings(body, state)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await create_transcription(request, state)

    @app.post("/v1/rerank")
    @app.post("/rerank")  # Jina's and Cohere's clients' path
    async def rerank_(body: RerankRequest) -> dict[str, Any]:
        return await rerank(body, state)


def _ollama_routes(app: FastAPI, state: ServerState) -> None:
    """Ollama's API (``/api/``), for the local apps that speak it."""
    @app.post("/api/chat")
    async def ollama_chat(body: ollama_input.ChatRequest, request: Request) -> Any:
        return await ollama.chat(body, request, state)

    @app.post("/api/generate")
    async def ollama_generate(body: ollama_input.GenerateRequest, request: Request) -> Any:
        return await ollama.generate(body, request, state)

    @app.post("/api/embed")
    async def ollama_embed_route(body: ollama_embed.EmbedRequest) -> dict[str, Any]:
        return await ollama_embed.embed(body, state)

    @app.post("/api/embeddings")
    async def ollama_embeddings(body: ollama_embed.EmbeddingsRequest) -> dict[str, Any]:
        return await ollama_embed.embeddings(body, state)

    @app.get("/api/tags")
    async def ollama_tags() -> dict[str, Any]:
        return ollama.tags(state)

    @app.post("/api/show")
    async def ollama_show(body: ollama_input.ShowRequest) -> dict[str, Any]:
        return ollama.show(body, state)

    @app.get("/api/ps")
    async def ollama_ps() -> dict[str, Any]:
        return ollama.ps(state)

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return {"version": __version__}


def _tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's ``/tokenize``, ``/tokenizer_info`` and ``/detokenize``."""
    @app.post("/tokenize")
    async def tokenize_(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(body, state)

    @app.get("/tokenizer_info")
    async def tokenizer_info_(model: str | None = None) -> dict[str, Any]:
        return await tokenizer_info(model, state)

    @app.post("/detokenize")
    async def detokenize_(body: DetokenizeRequest) -> dict[str, str]:
        return await detokenize(body, state)


class ModelAction(BaseModel):
    model: str


def _probe_response(answer: probes.ProbeAnswer) -> JSONResponse:
    return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers or None)


class RequestId:
    """An ``x-request-id`` header on every response: the client's own (up to 128 printable
    characters), else a new one, as vLLM and most proxies do."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = probes.request_id(dict(scope.get("headers") or []).get(b"x-request-id", b""))

        async def with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, with_id)


class RequireKey:
    """The API key, checked from the headers of every ``/v1/`` and ``/api/`` (Ollama's) request before any
    byte of its body is read: a refused request costs no body memory (a 50 MB body without a key used to be
    read and parsed first). ``Authorization: Bearer``, or ``x-api-key`` as Anthropic's clients send it. 401 with
    ``WWW-Authenticate: Bearer``. CORS preflights pass."""

    def __init__(self, app: Any, api_key: str, on_reject: Callable[[int, str | None], None] | None = None) -> None:
        self.app, self.key, self.on_reject = app, api_key.encode(), on_reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _keyed(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"authorization", b"")
        token = header[7:] if header[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if secrets.compare_digest(token, self.key):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>, or x-api-key: <key>)",
                         "invalid_request_error",
                         None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        await _reject(error, scope, receive, send, self.on_reject)


def _keyed(path: str) -> bool:
    """The paths the API key guards: the APIs (Ollama's ``/api/`` too), and the tokenizer (it runs phase 1, images
    and all)."""
    return path.startswith(("/v1/", "/api/")) or path in ("/tokenize", "/detokenize", "/tokenizer_info", "/rerank")


async def _reject(error: APIError, scope: dict[str, Any], receive: Any, send: Any,
                  on_reject: Callable[[int, str | None], None] | None) -> None:
    """Answer from a middleware, counted and logged as the app's error handlers do."""
    if on_reject is not None:
        on_reject(error.status, error.code)
    log_rejection(scope.get("method", "-"), scope.get("path", "-"), error)
    await error.response(scope.get("path", ""))(scope, receive, send)


class BodyLimit:
    """413 for bodies over the limit, by Content-Length or by counting a chunked upload; 400 for a
    body that is not UTF-8 (JSON text must be, and UTF-16 or UTF-32 always has a NUL byte)."""

    def __init__(self, app: Any, max_bytes: int, on_reject: Callable[[int, str | None], None] | None = None) -> None:
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _reject(self._too_large(), scope, receive, send, self.on_reject)
        received, rejected = 0, False
        # an upload (POST /v1/audio/transcriptions) is bytes, not JSON text: NUL bytes are its own
        binary = dict(scope.get("headers") or []).get(b"content-type", b"").startswith(b"multipart/form-data")

        async def checking_receive() -> dict[str, Any]:
            nonlocal received, rejected
            message: dict[str, Any] = await receive()
            body = message.get("body", b"")
            received += len(body)
            nul = b"\x00" in body and not binary
            error = self._too_large() if received > self.max_bytes else _not_utf8() if nul else None
            if error is not None and not rejected:
                rejected = True
                await _reject(error, scope, receive, send, self.on_reject)
                return {"type": "http.disconnect"}  # the app stops reading; what it sends is dropped
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, checking_receive, guarded_send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body is over the {self.max_bytes}-byte limit", "invalid_request_error",
                        None, "request_too_large")


def _not_utf8() -> APIError:
    return APIError(400, "request body must be JSON in UTF-8 (it has NUL bytes: UTF-16 or UTF-32?)",
                    "invalid_request_error", None, "invalid_encoding")
