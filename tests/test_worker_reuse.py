"""Worker threads are reused across model loads (engine/worker_pool.py): MLX 0.32 leaks a native thread for
every Python thread that evaluates, so a server swapping models through fresh threads grew one a swap.

A stopped worker's thread parks with its stream and the next worker takes it, never while it serves another;
a worker that died is never reused; a reused thread serves a new model and keeps nothing of the old one; and a
``--model-dir`` server swapping three models keeps its native thread count flat with the same greedy answers.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from conftest import anon_rss_kib, collect
from server_utils import ServerProcess, start_server
from test_engine_worker import Broken
from test_model_dir import model_dir

from vlmserve.engine import worker_pool
from vlmserve.engine.assembly import load_for_serving
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.memory import give_back
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.worker import MLXWorkerThread, WorkerDiedError
from vlmserve.frontend.async_engine import AsyncEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_a_stopped_worker_parks_and_the_next_takes_it_but_never_a_live_one() -> None:
    worker_pool.end_parked()  # the pool is the process's: earlier tests' engines parked theirs
    first = MLXWorkerThread(name="first")
    first.start()
    ident, stream = first.ident, first.stream
    first.shutdown()
    assert not first.alive and worker_pool.parked() >= 1
    second, third = MLXWorkerThread(name="second"), MLXWorkerThread(name="third")
    second.start()
    third.start()
    try:
        assert second.ident == ident and second.stream == stream  # the parked thread, with its own stream
        assert third.ident != ident  # a live worker is never shared
        assert second.call(lambda: mx.eval(mx.arange(4) * 2) or (mx.arange(3) + 1).tolist()) == [1, 2, 3]
        assert second.call(lambda: __import__("threading").current_thread().name) == "second"
        with pytest.raises(AssertionError):
            second.call(first.assert_on_worker)  # the old worker's check no longer passes on its reused thread
    finally:
        second.shutdown()
        third.shutdown()


def test_a_worker_that_died_is_never_reused() -> None:
    w = MLXWorkerThread(name="test-dies")
    w.start()
    carrier = w._carrier
    assert carrier is not None
    w.set_stepper(Broken())
    assert w.join(10)
    carrier.thread.join(10)
    assert not carrier.thread.is_alive() and carrier not in worker_pool._parked
    with pytest.raises(WorkerDiedError, match="step exploded"):
        w.submit(lambda: None).result(timeout=1)


def test_end_parked_ends_every_parked_thread() -> None:
    workers = [MLXWorkerThread(name=f"w{i}") for i in range(2)]
    for w in workers:
        w.start()
    carriers = [w._carrier for w in workers]
    for w in workers:
        w.shutdown()
    worker_pool.end_parked()
    assert worker_pool.parked() == 0
    assert all(c is not None and not c.thread.is_alive() for c in carriers)


async def _load_and_ask(path: Path) -> tuple[AsyncEngine, list[int]]:
    engine = AsyncEngine(str(path), config=EngineConfig())
    await engine.start()
    result = await collect(engine, "r", "what is this?", params=GREEDY)
    assert result.error is None, result.error
    return engine, result.token_ids


def test_a_reused_worker_serves_a_second_model_and_keeps_nothing_of_the_first(gemma4_micro, gemma3_micro) -> None:
    async def scenario() -> None:
        worker_pool.end_parked()  # so the first engine's thread is the one the second takes
        before = mx.get_active_memory()
        first, alone = await _load_and_ask(gemma4_micro)
        ident, loaded = first.worker.ident, mx.get_active_memory()
        await first.shutdown()
        first.forget()
        del first
        give_back()
        freed = mx.get_active_memory()
        print(f"MLX active memory: {before} B before, {loaded} B loaded, {freed} B after the unload")
        assert freed < loaded and freed - before < (loaded - before) / 4, (before, loaded, freed)
        second, tokens = await _load_and_ask(gemma3_micro)  # no "There is no Stream" on the reused thread
        try:
            assert second.worker.ident == ident and len(tokens) == GREEDY.max_tokens
        finally:
            await second.shutdown()
        again, repeat = await _load_and_ask(gemma4_micro)
        await again.shutdown()
        assert repeat == alone

    asyncio.run(scenario())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
def test_loading_a_model_leaves_no_lazy_graph_behind(gemma4_micro, gemma3_micro) -> None:
    """Building a module draws its initial weights from MLX's global random key, lazily: each draw chained
    a graph node to the last, nothing evaluated the key, and every load left ~130 KiB behind (3 MiB over
    these 24 loads; a swapping server grew 16-20 MiB a minute). The loader now evaluates the key."""
    worker = MLXWorkerThread(name="test-loads")
    worker.start()

    def load_and_drop(path: Path) -> None:
        assembled = load_for_serving(str(path), None, EngineConfig())
        del assembled
        give_back()

    try:
        for path in (gemma4_micro, gemma3_micro) * 3:  # transformers' and mlx-vlm's first-use caches
            worker.call(load_and_drop, path)
        before = anon_rss_kib()
        for path in (gemma4_micro, gemma3_micro) * 12:
            worker.call(load_and_drop, path)
        grown = anon_rss_kib() - before
    finally:
        worker.shutdown()
    print(f"anonymous RSS grew {grown} KiB over 24 loads")
    assert grown < 1024, f"anonymous RSS grew {grown} KiB over 24 loads"


def native_threads(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/task"))


def greedy_answer(server: ServerProcess, model: str) -> list[str]:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "logprobs": True}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return [t["token"] for t in reply.json()["choices"][0]["logprobs"]["content"]]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts the server's threads in /proc")
def test_swapping_models_keeps_the_native_thread_count_flat(tmp_path: Path) -> None:
    """Seven rounds of three micro models, one loaded at a time (21 loads): before the reuse, each load left
    one more native thread behind."""
    archs = ("gemma4", "qwen2_5_vl", "smolvlm")
    root = model_dir(tmp_path / "m", archs)
    srv = start_server(["--model-dir", str(root), "--max-loaded-models", "1", "--idle-unload-s", "0"],
                       tmp_path / "server.log")
    try:
        first = {name: greedy_answer(srv, name) for name in archs}
        base = native_threads(srv)
        counts = []
        for _ in range(6):
            assert {name: greedy_answer(srv, name) for name in archs} == first
            counts.append(native_threads(srv))
        print(f"native threads: {base} after the first round, then {counts}")
        # Python's lazy pools (the loop's default executor) may still add a thread or two; before the reuse,
        # these 18 loads added 19
        assert counts[-1] <= base + 3, f"{base} threads after the first round, then {counts}"
    finally:
        srv.stop()
