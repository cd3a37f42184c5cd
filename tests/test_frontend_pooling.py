"""frontend/pooling.py through AsyncEngine: a pooling model's requests run on its worker while the loop stays
free, and a shutdown ends every waiting request at once."""

from __future__ import annotations

import asyncio

import pytest

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.frontend.pooling import EmbedInput, PoolingInputError, PoolingStoppedError
from vlmserve.testing.pooling_models import build_pooling_model


def test_a_shutdown_ends_every_waiting_request():
    async def main() -> list[object]:
        engine = AsyncEngine(str(build_pooling_model("text_embedder")), "embedder", EngineConfig())
        await engine.start()
        assert engine.kind == "embed" and engine.info.kind == "embed" and engine.pooler is not None
        pooler = engine.pooler
        inputs = [EmbedInput(text="word " * 300)] * 64
        tasks = [asyncio.create_task(pooler.embed(inputs)) for _ in range(20)]
        await asyncio.sleep(0)  # they are in flight: tokenizing or waiting for the worker
        assert engine.num_in_flight > 0
        await engine.shutdown("server is shutting down")
        # a guard against a hang, not a timing assertion: every request has ended by now
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        assert engine.num_in_flight == 0
        return done

    done = asyncio.run(main())
    stopped = [d for d in done if isinstance(d, PoolingStoppedError)]
    assert stopped and all(isinstance(d, PoolingStoppedError) or len(d.vectors) == 64 for d in done)


def test_an_input_over_the_limit_is_refused_before_the_worker_sees_it():
    async def main() -> None:
        engine = AsyncEngine(str(build_pooling_model("reranker")), "reranker", EngineConfig(max_model_len=300))
        await engine.start()
        assert engine.kind == "score" and engine.pooler is not None
        try:
            with pytest.raises(PoolingInputError, match=r"documents\[1\] has \d+ tokens; .* at most 300"):
                await engine.pooler.score("q", ["d", "long " * 400], None)
            assert engine.pooler.runner.rows == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())
