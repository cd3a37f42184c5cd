"""Models on demand (``--model-dir``, api/registry.py) against a real server: a folder of three models built
offline, one with corrupt weights and one that is not a model, beside a pinned ``--model``.

Listed before any load; the first requests to a model load it once; ``--max-loaded-models`` unloads the
least recently used idle model and never one with requests in flight (the load waits); ``--memory-budget-gb``
and ``--idle-unload-s`` unload too; the broken folder fails clearly while the others serve; the pinned model
never unloads; and the memory comes back over rounds of loads and unloads.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, start_server

from vlmserve.testing.build import build_model

ON_DEMAND = ("gemma4", "qwen2_5_vl", "smolvlm")


def model_dir(root: Path, archs: tuple[str, ...] = ON_DEMAND, size: str = "micro") -> Path:
    """Copies (a link out of DIR is refused) of offline-built models, a folder whose weights are corrupt, and
    one that is not a model."""
    root.mkdir(parents=True, exist_ok=True)
    for arch in archs:
        shutil.copytree(build_model(arch, size), root / arch)
    broken = root / "broken"
    broken.mkdir()
    shutil.copy(build_model("gemma4", "micro") / "config.json", broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    (root / "notes").mkdir()
    (root / "notes" / "README.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("model-dir")
    pinned = build_model("paligemma", "micro")
    srv = start_server(["--model", str(pinned), "--served-model-name", "pinned", "--model-dir", str(model_dir(root / "m")),
                        "--max-loaded-models", "3", "--idle-unload-s", "0"], root / "server.log")
    yield srv
    srv.stop()


def cards(server: ServerProcess) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}


def statuses(server: ServerProcess) -> dict[str, str]:
    return {name: card["status"] for name, card in cards(server).items()}


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    assert match, f"{name}{{{want}}} not on /metrics"
    return float(match.group(1))


async def chat(client: httpx.AsyncClient, server: ServerProcess, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": max_tokens,
            "ignore_eos": True}
    return await client.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def ask(server: ServerProcess, model: str, max_tokens: int = 4) -> httpx.Response:
    async def one() -> httpx.Response:
        async with httpx.AsyncClient() as client:
            return await chat(client, server, model, max_tokens)
    return asyncio.run(one())


def test_every_folder_is_listed_before_any_load(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200  # ready before any on-demand load
    listed = cards(server)
    assert set(listed) == {"pinned", *ON_DEMAND, "broken", "notes"}
    assert listed["pinned"]["status"] == "loaded" and listed["pinned"]["pinned"] is True
    for name in (*ON_DEMAND, "broken"):
        assert listed[name]["status"] == "available" and listed[name]["pinned"] is False, listed[name]
    assert listed["notes"]["status"] == "unavailable" and "no config.json" in listed["notes"]["reason"]
    for name in ON_DEMAND:
        assert metric(server, "vlmserve_model_loads_total", model=name) == 0


def test_concurrent_first_requests_share_one_load(server: ServerProcess) -> None:
    async def eight() -> list[httpx.Response]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(chat(client, server, "gemma4") for _ in range(8)))

    answers = asyncio.run(eight())
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert all(r.json()["choices"][0]["message"]["content"] is not None for r in answers)
    assert metric(server, "vlmserve_model_loads_total", model="gemma4") == 1
    assert server.log.count("model gemma4: loading on demand") == 1
    assert statuses(server)["gemma4"] == "loaded"


def test_a_broken_folder_fails_clearly_while_the_others_serve(server: ServerProcess) -> None:
    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(chat(client, server, "broken"), chat(client, server, "pinned"))

    broken, pinned = asyncio.run(both())
    assert pinned.status_code == 200
    assert broken.status_code == 500
    error = broken.json()["error"]
    assert error["code"] == "model_load_failed" and "'broken' failed to load" in error["message"], error
    assert "safetensors" in error["message"]  # and why
    assert ask(server, "broken").status_code == 500  # the next request tries again, and fails again
    assert metric(server, "vlmserve_model_load_failures_total", model="broken") == 2
    assert cards(server)["broken"]["status"] == "available" and "safetensors" in cards(server)["broken"]["last_error"]
    notes = ask(server, "notes")
    assert notes.status_code == 400 and notes.json()["error"]["code"] == "model_unavailable"
    assert ask(server, "gemma4").status_code == 200


def test_the_least_recently_used_idle_model_unloads(server: ServerProcess) -> None:
    assert ask(server, "gemma4").status_code == 200
    assert ask(server, "qwen2_5_vl").status_code == 200  # pinned + 2: --max-loaded-models 3 reached
    now = statuses(server)
    assert (now["pinned"], now["gemma4"], now["qwen2_5_vl"], now["smolvlm"]) == ("loaded", "loaded", "loaded", "available")
    unloads = metric(server, "vlmserve_model_unloads_total", model="gemma4", reason="lru")
    assert ask(server, "smolvlm").status_code == 200  # gemma4 was used least recently
    now = statuses(server)
    assert (now["gemma4"], now["qwen2_5_vl"], now["smolvlm"], now["pinned"]) == ("available", "loaded", "loaded", "loaded")
    assert metric(server, "vlmserve_model_unloads_total", model="gemma4", reason="lru") == unloads + 1
    assert "model gemma4: unloading (--max-loaded-models reached; least recently used)" in server.log
    assert ask(server, "gemma4").status_code == 200  # and loads again on its next request
    assert statuses(server)["qwen2_5_vl"] == "available"


def test_a_model_with_requests_in_flight_is_not_unloaded_the_load_waits(server: ServerProcess) -> None:
    for name in ("gemma4", "smolvlm"):
        assert ask(server, name).status_code == 200
    assert statuses(server)["qwen2_5_vl"] == "available"  # pinned, gemma4 and smolvlm are loaded: full

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient() as client:
            busy = [asyncio.create_task(chat(client, server, name, max_tokens=300)) for name in ("gemma4", "smolvlm")]
            await asyncio.sleep(0.3)  # both are decoding
            third = await chat(client, server, "qwen2_5_vl")
            return await asyncio.gather(*busy), third

    long_ones, third = asyncio.run(scenario())
    assert third.status_code == 200
    for answer in long_ones:  # neither was cut short by an unload
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 300
        assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert "waiting for a loaded model to finish its requests" in server.log


def test_the_pinned_model_never_unloads(server: ServerProcess) -> None:
    refused = httpx.post(f"{server.url}/v1/models/unload", json={"model": "pinned"}, timeout=10)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_pinned"
    assert statuses(server)["pinned"] == "loaded"
    assert metric(server, "vlmserve_model_unloads_total", model="pinned", reason="lru") == 0
    loaded = httpx.post(f"{server.url}/v1/models/load", json={"model": "qwen2_5_vl"}, timeout=60)
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"
    unloaded = httpx.post(f"{server.url}/v1/models/unload", json={"model": "qwen2_5_vl"}, timeout=60)
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "available"
    assert metric(server, "vlmserve_model_unloads_total", model="qwen2_5_vl", reason="request") == 1
    assert ask(server, "pinned").status_code == 200


def test_memory_budget_and_idle_unload(tmp_path: Path) -> None:
    root = model_dir(tmp_path / "m", ("gemma4", "qwen2_5_vl"))
    # each micro model is under 1 MiB of weights: a budget of 1.2 MiB holds one
    srv = start_server(["--model-dir", str(root), "--memory-budget-gb", str(1.2 / 1024), "--idle-unload-s", "2"],
                       tmp_path / "server.log")
    try:
        assert ask(srv, "gemma4").status_code == 200
        assert ask(srv, "qwen2_5_vl").status_code == 200
        assert metric(srv, "vlmserve_model_unloads_total", model="gemma4", reason="memory") == 1
        assert "model gemma4: unloading (--memory-budget-gb reached; least recently used)" in srv.log
        used = time.monotonic()
        while statuses(srv)["qwen2_5_vl"] == "loaded":
            assert time.monotonic() - used < 10, "not unloaded after --idle-unload-s 2"
            time.sleep(0.1)
        assert time.monotonic() - used >= 1.5  # not before its time (the check runs every half second)
        assert metric(srv, "vlmserve_model_unloads_total", model="qwen2_5_vl", reason="idle") == 1
        assert "model qwen2_5_vl: unloading (idle for --idle-unload-s)" in srv.log
    finally:
        srv.stop()


def rss_bytes(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc")
def test_memory_comes_back_over_rounds_of_loads(tmp_path: Path) -> None:
    """Six rounds of three models, two loaded at most: the server's RSS stays within 1.3x its RSS after the
    first two loads (the small models: 7-17 MB of weights each)."""
    archs = ("gemma4", "qwen2_5_vl", "qwen2_vl")
    root = model_dir(tmp_path / "m", archs, "small")
    srv = start_server(["--model-dir", str(root), "--max-loaded-models", "2", "--idle-unload-s", "0"],
                       tmp_path / "server.log")
    try:
        for name in archs[:2]:
            assert ask(srv, name).status_code == 200
        base = rss_bytes(srv)
        for _ in range(6):
            for name in archs:
                assert ask(srv, name).status_code == 200
        after = rss_bytes(srv)
        unloads = sum(metric(srv, "vlmserve_model_unloads_total", model=n, reason="lru") for n in archs)
        assert unloads == 16  # each of the 18 requests but the first round's first two loads a model
        print(f"RSS {base / 2**20:.0f} MiB after two loads, {after / 2**20:.0f} MiB after 16 unloads and loads")
        assert after <= 1.3 * base, f"RSS {base / 2**20:.0f} MiB after two loads, {after / 2**20:.0f} MiB after 16 more"
    finally:
        srv.stop()
