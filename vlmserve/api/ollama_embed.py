"""[loop] Ollama's embeddings: ``POST /api/embed`` and the legacy ``POST /api/embeddings``, on /v1/embeddings' path.

``/api/embed`` takes ``input`` (a string or a list of them) and answers ``embeddings``, each scaled to unit length
as Ollama's are (after cutting to ``dimensions``), with the counts and durations (ns) of Ollama's reply. An input
past the model's tokens is cut to them (``truncate``, Ollama's default) or refused. ``/api/embeddings`` takes one
``prompt`` and answers its ``embedding`` as the model pools it (Ollama's legacy endpoint does not rescale). Empty
input only loads the model, as Ollama's does. The wrong kind of model and other errors are ``{"error"}`` (errors.py).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from vlmserve.api.errors import APIError
from vlmserve.api.ollama import known_name
from vlmserve.api.pooling import MAX_INPUTS, await_pooled, check_dimensions, pooler_of
from vlmserve.api.state import ServerState
from vlmserve.frontend.pooling import EmbedInput, truncate


class EmbedRequest(BaseModel):
    model: str
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None  # sampling and runner options: nothing here for a pooling model
    keep_alive: float | str | None = None  # how long Ollama keeps a model loaded: here --idle-unload-s says


class EmbeddingsRequest(BaseModel):
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


async def embed(req: EmbedRequest, state: ServerState) -> dict[str, Any]:
    start = time.perf_counter()
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    if not any(texts):
        texts = []  # "" and []: the model only loads, as Ollama's does
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"input has {len(texts)} items; at most {MAX_INPUTS} per request", param="input")
    for i, text in enumerate(texts):
        if not text:
            raise APIError(400, f"input[{i}] must not be an empty string", param="input")
    vectors, tokens, loaded = await _pooled(req.model, texts, req.truncate, req.dimensions, state)
    return {"model": req.model, "embeddings": [truncate(v, req.dimensions or len(v)) for v in vectors],
            "total_duration": _ns(time.perf_counter() - start), "load_duration": _ns(loaded - start),
            "prompt_eval_count": tokens}


async def embeddings(req: EmbeddingsRequest, state: ServerState) -> dict[str, Any]:
    vectors, _, _ = await _pooled(req.model, [req.prompt] if req.prompt else [], False, None, state)
    return {"embedding": vectors[0] if vectors else []}


async def _pooled(model: str, texts: list[str], truncate: bool, dimensions: int | None,
                  state: ServerState) -> tuple[list[list[float]], int, float]:
    """The texts' vectors, their tokens, and when the model was ready (it may load first, or wait its turn)."""
    async with state.using(known_name(model, state), "embed") as served:
        loaded = time.perf_counter()
        if not texts:
            return [], 0, loaded
        pooler = pooler_of(served.engine)
        if dimensions is not None:
            check_dimensions(pooler, dimensions)
        pooled = await await_pooled(pooler.embed([EmbedInput(text=t, truncate=truncate) for t in texts]))
    return pooled.vectors, pooled.tokens, loaded


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
