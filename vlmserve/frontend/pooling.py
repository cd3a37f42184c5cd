"""[loop] The asyncio side of a pooling model (embeddings, rerank scores): inputs tokenized on phase 1's pool,
one job per sequence handed to the worker's ``PoolingRunner``, results awaited without blocking the loop.

Every sequence of a request is its own job, so the runner batches sequences of requests that arrive together.
Shutdown fails every waiting request at once (``fail_all``).
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from vlmserve.engine.pooling import PoolingFacts, PoolingRunner, PoolJob, tokenizer_of
from vlmserve.engine.worker import MLXWorkerThread, WorkerDiedError, WorkerShutdownError

# Qwen3-Reranker's fixed prompt, from its model card: the system turn, the user turn's fields, the opened answer.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."  # mlx-vlm's and the card's


class PoolingInputError(ValueError):
    """An input the model cannot pool (the API answers 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PoolingStoppedError(RuntimeError):
    """The model stopped (shutdown, unload, a dead worker) before the request's results came (the API answers 503)."""


@dataclass(slots=True, frozen=True)
class EmbedInput:
    """One item of ``input``: text, token ids, or a decoded image (PIL, decoded by the API on the pool)."""

    text: str | None = None
    ids: tuple[int, ...] | None = None
    image: Any = None
    truncate: bool = False  # cut to the model's most tokens rather than refused (Ollama's ``truncate``)


@dataclass(slots=True, frozen=True)
class Pooled:
    """A request's results in input order (embeddings, or one-value score lists) and its prompt tokens."""

    vectors: list[list[float]]
    tokens: int


class Pooler:
    """One pooling model's requests: ``embed`` and ``score``."""

    def __init__(self, name: str, facts: PoolingFacts, processor: Any, worker: MLXWorkerThread,
                 runner: PoolingRunner, pool: Executor) -> None:
        self.name, self.facts, self.processor = name, facts, processor
        self.worker, self.runner, self.pool = worker, runner, pool
        self._waiting: set[asyncio.Future[list[float]]] = set()
        self._local = threading.local()  # each pool thread's own processor copy (see _processor)
        self.in_flight = 0  # requests between tokenizing and their last result

    async def embed(self, inputs: Sequence[EmbedInput]) -> Pooled:
        return await self._pooled(self._embed_jobs, list(inputs))

    async def score(self, query: str, documents: Sequence[str], instruction: str | None) -> Pooled:
        return await self._pooled(self._score_jobs, query, list(documents), instruction)

    async def _pooled(self, tokenize: Callable[..., list[PoolJob]], *args: Any) -> Pooled:
        """Tokenized on the pool, then run; in flight (never unloaded under it) from the first to the last."""
        self.in_flight += 1
        try:
            jobs = await asyncio.get_running_loop().run_in_executor(self.pool, tokenize, *args)
            return await self._run(jobs)
        finally:
            self.in_flight -= 1

    def fail_all(self, message: str) -> None:
        """Every waiting request ends with ``message`` (shutdown, a dead worker)."""
        for future in self._waiting:
            if not future.done():
                future.set_exception(PoolingStoppedError(message))

    async def _run(self, jobs: list[PoolJob]) -> Pooled:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in jobs]
        self._waiting.update(futures)
        try:
            bound = [PoolJob(j.ids, j.type_ids, j.image, _settle(loop, f)) for j, f in zip(jobs, futures, strict=True)]
            try:
                await self.worker.run(self.runner.add, bound)
            except (WorkerShutdownError, WorkerDiedError) as exc:
                raise PoolingStoppedError(f"model {self.name!r} stopped: {exc}") from None
            vectors = list(await asyncio.gather(*futures))
        finally:
            self._waiting.difference_update(futures)
            for future in futures:  # a cancelled request: its jobs still run, their results are dropped
                future.cancel()
        return Pooled(vectors, sum(len(j.ids) for j in jobs))

    # -- on the pool ----------------------------------------------------------------------

    def _processor(self) -> Any:
        """This pool thread's own copy: a fast tokenizer sets its padding and truncation state on every call,
        and two threads in one raise "Already borrowed" (the prompt builder copies per thread too)."""
        mine = getattr(self._local, "processor", None)
        if mine is None:
            mine = self._local.processor = copy.deepcopy(self.processor)
        return mine

    def _embed_jobs(self, inputs: list[EmbedInput]) -> list[PoolJob]:
        tokenizer = tokenizer_of(self._processor())
        jobs = []
        for i, item in enumerate(inputs):
            if item.image is not None:
                jobs.append(self._image_job(item.image, f"input[{i}]"))
                continue
            if item.ids is not None and not all(0 <= t < self.facts.vocab_size for t in item.ids):
                raise PoolingInputError(f"input[{i}] has a token id outside the model's vocabulary (0 to "
                                        f"{self.facts.vocab_size - 1})", f"input[{i}]")
            ids = item.ids if item.ids is not None else tuple(tokenizer(item.text)["input_ids"])
            ids = _cut(ids, self.facts.max_tokens, tokenizer) if item.truncate else ids
            jobs.append(PoolJob(self._fits(ids, f"input[{i}]")))
        return jobs

    def _image_job(self, image: Any, param: str) -> PoolJob:
        """As mlx-vlm embeds an image: its chat template around one image part, then its processor."""
        if not self.facts.takes_images:
            raise PoolingInputError(f"model {self.name!r} ({self.facts.model_type}) embeds text only", param)
        messages = [{"role": "user", "content": [{"type": "image"}]}]
        processor = self._processor()
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        arrays = processor(text=[prompt], images=[image], padding=True, return_tensors="np")
        image_arrays = {k: arrays[k] for k in ("pixel_values", "image_grid_thw") if k in arrays}
        return PoolJob(self._fits(tuple(int(t) for t in arrays["input_ids"][0]), param), image=image_arrays)

    def _score_jobs(self, query: str, documents: list[str], instruction: str | None) -> list[PoolJob]:
        tokenizer = tokenizer_of(self._processor())
        if self.facts.sequence_classifier:
            if instruction is not None:
                raise PoolingInputError("a sequence-classification reranker takes no instruction", "instruction")
            pairs = [tokenizer(query, doc) for doc in documents]
            return [PoolJob(self._fits(tuple(p["input_ids"]), f"documents[{i}]"),
                            tuple(p["token_type_ids"]) if "token_type_ids" in p else None)
                    for i, p in enumerate(pairs)]
        told = instruction or DEFAULT_INSTRUCTION
        texts = [f"{RERANK_PREFIX}<Instruct>: {told}\n<Query>: {query}\n<Document>: {doc}{RERANK_SUFFIX}"
                 for doc in documents]
        return [PoolJob(self._fits(tuple(tokenizer(t, add_special_tokens=False)["input_ids"]), f"documents[{i}]"))
                for i, t in enumerate(texts)]

    def _fits(self, ids: tuple[int, ...], param: str) -> tuple[int, ...]:
        most = self.facts.max_tokens
        if not ids:
            raise PoolingInputError(f"{param} is empty", param)
        if len(ids) > most:
            raise PoolingInputError(f"{param} has {len(ids)} tokens; model {self.name!r} takes at most {most} "
                                    "tokens per input", param)
        return ids


def _cut(ids: tuple[int, ...], most: int, tokenizer: Any) -> tuple[int, ...]:
    """The first ``most`` tokens; a special token the tokenizer ends with stays last (a last-token pooler reads it)."""
    if len(ids) <= most:
        return ids
    end = ids[-1] in set(getattr(tokenizer, "all_special_ids", ()))
    return ids[:most - 1] + ids[-1:] if end else ids[:most]


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[list[float]]
            ) -> Callable[[list[float] | BaseException], None]:
    """A job's ``finish``, called on the worker: the result lands on the loop."""
    def finish(result: list[float] | BaseException) -> None:
        def land() -> None:
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if not loop.is_closed():
            loop.call_soon_threadsafe(land)
    return finish


def truncate(vector: list[float], dimensions: int) -> list[float]:
    """Matryoshka: the first ``dimensions`` values, renormalized to unit length (as the Qwen3-Embedding and
    sentence-transformers cards do)."""
    head = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]
