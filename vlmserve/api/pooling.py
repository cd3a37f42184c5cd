"""[loop] ``POST /v1/embeddings`` (OpenAI's shape, plus mlx-vlm's image items) and ``POST /v1/rerank`` (and
``/rerank``: mlx-vlm's, Jina's and Cohere's request shape), for the models whose kind is ``embed`` or ``score``."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, Field

from vlmserve.api.errors import APIError
from vlmserve.api.state import ServerState
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.frontend.pooling import EmbedInput, Pooled, Pooler, PoolingInputError, PoolingStoppedError, truncate
from vlmserve.preprocess.images import ImageError
from vlmserve.preprocess.media import load_image_source

MAX_INPUTS = 2048  # inputs in one embeddings request, and documents in one rerank: OpenAI's own limit

Item = str | dict[str, Any]


class EmbeddingsRequest(BaseModel):
    input: str | list[int] | list[list[int]] | dict[str, Any] | list[Item]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class RerankRequest(BaseModel):
    query: Item
    documents: list[Item] = Field(min_length=1)
    model: str | None = None
    instruction: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False


async def create_embeddings(body: EmbeddingsRequest, state: ServerState) -> dict[str, Any]:
    items = _embed_items(body.input)
    images = sum(not isinstance(item, list) and _image_url(item) is not None for item in items)
    if images > state.media.max_images:
        raise APIError(400, f"input has {images} images; at most {state.media.max_images} per request (--max-images)",
                       param="input")
    async with state.using(body.model, "embed") as served:
        pooler = pooler_of(served.engine)
        if body.dimensions is not None:
            check_dimensions(pooler, body.dimensions)
        inputs = [await _decoded(item, i, state) for i, item in enumerate(items)]
        pooled = await await_pooled(pooler.embed(inputs))
    vectors = pooled.vectors if body.dimensions is None else [truncate(v, body.dimensions) for v in pooled.vectors]
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": body.model or served.name,
            "usage": {"prompt_tokens": pooled.tokens, "total_tokens": pooled.tokens}}


async def rerank(body: RerankRequest, state: ServerState) -> dict[str, Any]:
    query = _text(body.query, "query")
    documents = [_text(d, f"documents[{i}]") for i, d in enumerate(body.documents)]
    if len(documents) > MAX_INPUTS:
        raise APIError(400, f"documents has {len(documents)} items; at most {MAX_INPUTS}", param="documents")
    instruction = body.instruction.strip() if body.instruction is not None else None
    if instruction == "":
        raise APIError(400, "instruction must not be empty", param="instruction")
    async with state.using(body.model, "score") as served:
        pooled = await await_pooled(pooler_of(served.engine).score(query, documents, instruction))
    scores = [v[0] for v in pooled.vectors]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n]
    results = [{"index": i, "relevance_score": scores[i], **({"document": body.documents[i]}
                                                             if body.return_documents else {})} for i in order]
    return {"model": body.model or served.name, "results": results,
            "usage": {"prompt_tokens": pooled.tokens, "total_tokens": pooled.tokens}}


def pooler_of(engine: AsyncEngine) -> Pooler:
    """A served embed or score model's pooler (its requests' way to the worker)."""
    assert engine.pooler is not None, "a ready embed or score model has its pooler"
    return engine.pooler


async def await_pooled(work: Any) -> Pooled:
    """The pooler's result, its refusals as 400s and its stopping as a 503 (also Ollama's ``/api/embed``)."""
    try:
        result: Pooled = await work
    except PoolingInputError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except PoolingStoppedError as exc:
        raise APIError(503, str(exc), "service_unavailable", None, "shutting_down") from None
    return result


def _embed_items(value: Any) -> list[Item | list[int]]:
    """``input`` as a list of items: texts, token-id lists, image objects."""
    if isinstance(value, (str, dict)):
        items: list[Any] = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [value]  # one sequence of token ids
    else:
        items = list(value)
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input has {len(items)} items; at most {MAX_INPUTS} per request", param="input")
    return items


def _image_url(item: Any) -> str | None:
    """mlx-vlm's image items: ``{"type": "image_url" | "input_image", "image_url": URL | {"url": URL}}``,
    ``{"type": "image", "image": URL}``, or a data URL string."""
    if isinstance(item, str):
        return item if item.startswith("data:image/") else None
    url = item.get("image_url", item.get("image", item.get("url")))
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) else None


async def _decoded(item: Any, i: int, state: ServerState) -> EmbedInput:
    param = f"input[{i}]"
    if isinstance(item, list):
        if not item:
            raise APIError(400, f"{param} is empty", param=param)
        return EmbedInput(ids=tuple(item))
    url = _image_url(item)
    if url is None:
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"{param} must not be an empty string", param=param)
            return EmbedInput(text=item)
        raise APIError(400, f"{param}: an item is text, token ids, or an image object with a URL", param=param)
    try:  # fetching and decoding block: off the loop, once per image
        image = await asyncio.to_thread(load_image_source, url, state.media, param)
    except ImageError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_image") from None
    return EmbedInput(image=image)


def check_dimensions(pooler: Pooler, dimensions: int) -> None:
    facts = pooler.facts
    if not facts.matryoshka:
        raise APIError(400, f"model {pooler.name!r} ({facts.model_type}) does not take dimensions: it was not "
                       "trained for truncated embeddings", param="dimensions")
    if dimensions > facts.dimensions:
        raise APIError(400, f"dimensions {dimensions} is over the model's {facts.dimensions}", param="dimensions")


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """float: the list; base64: little-endian float32 bytes, as OpenAI sends them (its SDK asks for this)."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _text(item: Item, param: str) -> str:
    """A rerank query or document: a string, or an object with ``text`` (Cohere's and Jina's documents)."""
    text = item if isinstance(item, str) else item.get("text")
    if not isinstance(text, str) or not text.strip():
        raise APIError(400, f"{param} must be non-empty text (images and video are not reranked here)", param=param)
    return text.strip()
