"""An engine fault becomes a 500 naming the request; the app goes on serving. In-process app, real engine."""

from __future__ import annotations

import asyncio

import httpx

from vlmserve.api.app import create_app, stop_engines
from vlmserve.api.state import ServedModel, ServerState
from vlmserve.frontend.async_engine import AsyncEngine


def test_engine_fault_is_500_with_the_request_id(gemma4_micro):
    async def scenario():
        engine = AsyncEngine(str(gemma4_micro), "m")
        state = ServerState([ServedModel("m", engine)])
        app = create_app(state)
        await engine.start()
        real_prefill = engine.core.runner._prefill
        calls = {"n": 0}

        def failing_once(chunk, out):  # fault injection inside the real worker step
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("simulated kernel failure")
            return real_prefill(chunk, out)

        engine.core.runner._prefill = failing_once
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                failed = await http.post("/v1/chat/completions", json=body)
                ok = await http.post("/v1/chat/completions", json=body)
                streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        finally:
            await stop_engines(state, "test over")
        return failed, ok, streamed

    failed, ok, streamed = asyncio.run(scenario())
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "chatcmpl-" in error["message"] and "simulated kernel failure" in error["message"]
    assert ok.status_code == 200 and streamed.status_code == 200 and "[DONE]" in streamed.text
