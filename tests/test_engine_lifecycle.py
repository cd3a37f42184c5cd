"""Start, stop and failure: warm-up, failed loads, shutdown, step faults, a dying worker, two engines."""

from __future__ import annotations

import asyncio
import shutil
import time

import numpy as np
import pytest
from conftest import collect, running_engine, scene

from vlmserve.engine.loader import ModelLoadError
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine, EngineNotReadyError
from vlmserve.inputs import PromptInputs

LONG = SamplingParams(max_tokens=500, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, ignore_eos=True)


def test_start_warms_up_on_the_worker_and_leaves_nothing_behind(gemma4_micro):
    async def scenario():
        engine = AsyncEngine(str(gemma4_micro))
        assert not engine.ready
        await engine.start()
        try:
            stats = await engine.stats()
            return engine.ready, stats, dict(engine.core._requests), engine.worker.name
        finally:
            await engine.shutdown()

    ready, stats, leftovers, _ = asyncio.run(scenario())
    assert ready and stats.steps > 0 and stats.generated_tokens > 0  # the warm-up really ran
    assert leftovers == {} and stats.running == stats.batch_size == 0


def _broken_copy(src, tmp_path, how: str):
    dst = tmp_path / how
    shutil.copytree(src, dst)
    if how == "config":
        (dst / "config.json").write_text("{ not json")
    elif how == "weights":
        weights = dst / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif how == "missing-config":
        (dst / "config.json").unlink()
    return dst


@pytest.mark.parametrize("how", ["config", "weights", "missing-config", "no-such-dir"])
def test_a_failed_load_surfaces_at_once(gemma4_micro, tmp_path, how):
    path = tmp_path / "nowhere" / "model" if how == "no-such-dir" else _broken_copy(gemma4_micro, tmp_path, how)

    async def scenario():
        engine = AsyncEngine(str(path))
        start = time.monotonic()
        with pytest.raises(ModelLoadError, match="cannot load model"):
            await asyncio.wait_for(engine.start(), timeout=60)
        assert not engine.ready
        await engine.shutdown()
        return time.monotonic() - start, engine.worker.alive

    elapsed, alive = asyncio.run(scenario())
    assert not alive and elapsed < 60


def _unservable_copy(tmp_path):
    """A model that loads but cannot take an image: its processor cuts patches the vision tower can't read."""
    import json

    from vlmserve.testing import build_model

    dst = tmp_path / "qwen2_vl-broken"
    shutil.copytree(build_model("qwen2_vl", "micro"), dst)
    config = json.loads((dst / "processor_config.json").read_text())
    config["image_processor"]["patch_size"] = 16  # the vision tower's is 8
    (dst / "processor_config.json").write_text(json.dumps(config))
    return dst


def test_a_failed_warmup_means_the_model_failed_to_load(tmp_path):
    async def scenario():
        engine = AsyncEngine(str(_unservable_copy(tmp_path)))
        with pytest.raises(ModelLoadError, match=r"\(qwen2_vl\) failed its warm-up: "):
            await asyncio.wait_for(engine.start(), timeout=60)
        ready = engine.ready
        await engine.shutdown()
        return ready, engine.worker.alive

    assert asyncio.run(scenario()) == (False, False)


def test_serve_exits_when_warmup_fails_and_is_never_ready(tmp_path):
    """The server stays unready (503) while it starts, then exits 1 with one line naming the model."""
    import httpx
    from server_utils import start_server

    server = start_server(["--model", str(_unservable_copy(tmp_path))], tmp_path / "serve.log", wait_ready=False)
    statuses, deadline = set(), time.monotonic() + 120
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.add(httpx.get(server.url + "/ready", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    assert server.stop(timeout=60) == 1
    assert 200 not in statuses
    errors = [line for line in server.log.splitlines() if line.startswith("vlmserve: error:")]
    assert len(errors) == 1 and "failed its warm-up" in errors[0] and "qwen2_vl-broken" in errors[0]


def test_shutdown_wakes_every_waiting_and_running_request(gemma4_micro):
    async def scenario():
        async with running_engine(gemma4_micro, max_batch_size=2) as engine:
            tasks = [asyncio.create_task(collect(engine, f"r{i}", "hi", [], LONG)) for i in range(5)]
            while (engine.metrics.running or 0) < 2:
                await asyncio.sleep(0.001)
            await engine.shutdown()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            with pytest.raises(EngineNotReadyError):
                await collect(engine, "late", "hi", [], SHORT)
            return results, engine.worker.alive

    results, alive = asyncio.run(scenario())
    assert not alive
    assert [r.finish_reason for r in results] == ["error"] * 5
    assert all("shutting down" in r.error for r in results)


def test_a_fault_in_a_step_fails_only_its_requests(gemma4_micro):
    # Pixel values of the wrong shape make the vision tower raise inside the step.
    bad = PromptInputs(list(range(5, 40)), {"pixel_values": np.zeros((1, 3, 7, 5), np.float32)}, num_images=1)

    async def scenario():
        async with running_engine(gemma4_micro) as engine:
            ref = await collect(engine, "ref", "hello", [], SamplingParams(max_tokens=30, ignore_eos=True))
            ok = asyncio.create_task(collect(engine, "ok", "hello", [], SamplingParams(max_tokens=30, ignore_eos=True)))
            while engine.metrics.generated_tokens < 5:
                await asyncio.sleep(0.001)
            broken = [out async for out in engine.generate("bad", bad, SHORT)]
            after = await collect(engine, "after", "hello", [], SamplingParams(max_tokens=30, ignore_eos=True))
            return ref, await ok, broken[-1], after, engine.ready

    ref, ok, broken, after, ready = asyncio.run(scenario())
    assert broken.finish_reason == "error" and broken.error
    assert ok.token_ids == ref.token_ids == after.token_ids and ready


def test_a_dead_worker_fails_pending_and_new_requests_at_once(gemma4_micro):
    class WorkerKiller(BaseException):
        """Not an Exception: the step's own error handling does not catch it, so the thread dies."""

    async def scenario():
        async with running_engine(gemma4_micro) as engine:
            pending = asyncio.create_task(collect(engine, "pending", "hi", [], LONG))
            while engine.metrics.generated_tokens < 3:
                await asyncio.sleep(0.001)

            def die(*args):
                raise WorkerKiller("simulated crash in the MLX thread")

            engine.core.runner.decode = die  # fault injection into the real worker loop
            result = await asyncio.wait_for(pending, timeout=30)
            with pytest.raises(EngineNotReadyError, match="worker died"):
                await collect(engine, "new", "hi", [], SHORT)
            return result, engine.ready

    result, ready = asyncio.run(scenario())
    assert result.finish_reason == "error" and "worker died" in result.error and not ready


def test_two_engines_generate_concurrently_like_alone(gemma4_micro, gemma3_micro):
    red = scene("circle", (220, 30, 30))
    cases = [("hello", []), ("what is this", [red])]

    async def run_all(engines):
        jobs = [collect(e, f"{n}-{i}", t, imgs, SHORT) for n, e in enumerate(engines) for i, (t, imgs) in enumerate(cases)]
        return [r.token_ids for r in await asyncio.gather(*jobs)]

    async def scenario():
        async with running_engine(gemma4_micro) as g4, running_engine(gemma3_micro) as g3:
            assert g4.worker.ident != g3.worker.ident and g4.worker.stream is not None
            alone = (await run_all([g4])) + (await run_all([g3]))
            together = await run_all([g4, g3])
            return alone, together

    alone, together = asyncio.run(scenario())
    assert alone == together


def test_the_worker_loads_and_generates_repeatedly_from_asyncio(gemma4_micro):
    async def scenario():
        async with running_engine(gemma4_micro) as engine:
            return [await collect(engine, f"again{i}", "hello", [], SHORT) for i in range(5)]

    results = asyncio.run(scenario())
    assert len({tuple(r.token_ids) for r in results}) == 1 and len(results[0].token_ids) == 6

