"""The prefix stores' disk tier (``--prefix-cache-dir``, issue 45) on the real worker, MLX and files.

What the stores hold at a clean shutdown is written to disk; a restarted engine reads it back when
the same chat comes again, reports the prompt as cached and answers as a cold prefill does, greedy.
Files that are corrupt, truncated or another model's are ignored and deleted; another picture with
the same words reuses nothing past the text before it. The file format itself is tested in
``test_engine_disk_store.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from conftest import gather, running_engine, scene

from vlmserve.engine.disk_tier import model_folder
from vlmserve.engine.params import SamplingParams
from vlmserve.testing import build_model

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
RED, BLUE = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220))
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 15}  # a shared prefix, within Gemma's window


def _chat(question: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


async def _ask(directory: Path | None, arch: str, chats: list[tuple[list[dict[str, Any]], list[Any]]],
               seen: list[Any] | None = None, **config: Any) -> list[tuple[list[int], int, int]]:
    """Each chat's greedy tokens, cached prompt tokens and prompt length, on one engine; ``seen`` gets
    its disk tier's stats before the shutdown."""
    dirs = {"prefix_cache_dir": str(directory)} if directory is not None else {}
    async with running_engine(build_model(arch, "micro"), mm_prefix_cache=True, **dirs, **config) as engine:
        out = []
        for i, (messages, images) in enumerate(chats):
            if engine.core is not None and engine.core.tier is not None:  # what was evicted is on disk by now
                assert engine.core.tier.store.flush(30)
            result = await gather(engine.generate_chat(f"c{i}", messages, images, None, GREEDY))
            assert result.error is None, result.error
            out.append((result.token_ids, result.num_cached_tokens, result.num_prompt_tokens))
        if seen is not None:
            seen.append((await engine.stats()).disk)
        return out


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma3"])
def test_a_restart_reads_the_chat_back_from_disk_and_answers_as_a_cold_prefill(arch: str, tmp_path: Path) -> None:
    chat = (_chat("What is this?"), [RED])
    cold = asyncio.run(_ask(None, arch, [chat]))
    first = asyncio.run(_ask(tmp_path, arch, [chat]))  # stores it; the shutdown writes it to disk
    assert list(tmp_path.rglob("*.kv")), "nothing was written at shutdown"
    again = asyncio.run(_ask(tmp_path, arch, [chat]))  # a new engine: only the disk holds it
    tokens, cached, prompt = again[0]
    assert first[0][0] == cold[0][0] and tokens == cold[0][0]
    assert cached >= 0.9 * prompt, (cached, prompt)


def test_another_picture_with_the_same_words_reuses_only_the_text_before_it(tmp_path: Path) -> None:
    asyncio.run(_ask(tmp_path, "qwen2_5_vl", [(_chat("What is this?"), [RED])]))
    (other, cached, prompt), = asyncio.run(_ask(tmp_path, "qwen2_5_vl", [(_chat("What is this?"), [BLUE])]))
    (cold, _, _), = asyncio.run(_ask(None, "qwen2_5_vl", [(_chat("What is this?"), [BLUE])]))
    assert other == cold and 0 <= cached < prompt - 20  # the picture's tokens and all after it are prefilled


@pytest.mark.parametrize("damage", ["flip", "truncate", "other model"])
def test_damaged_or_foreign_files_are_ignored_and_deleted(damage: str, tmp_path: Path) -> None:
    chat = (_chat("What is this?"), [RED])
    asyncio.run(_ask(tmp_path, "qwen2_5_vl", [chat]))
    files = list(tmp_path.rglob("*.kv"))
    assert files
    for file in files:
        data = bytearray(file.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
            file.write_bytes(bytes(data))
        elif damage == "truncate":
            file.write_bytes(bytes(data[: len(data) // 2]))
    arch = "qwen2_vl" if damage == "other model" else "qwen2_5_vl"
    if damage == "other model":  # the same chat's files where another model looks: foreign there
        other = model_folder(str(tmp_path), str(build_model(arch, "micro")))
        other.mkdir()
        files = [file.rename(other / file.name) for file in files]
    seen: list[Any] = []
    (tokens, cached, _), = asyncio.run(_ask(tmp_path, arch, [chat], seen))
    (cold, _, _), = asyncio.run(_ask(None, arch, [chat]))
    assert tokens == cold and cached == 0
    assert seen[0].rejected == len(files) and seen[0].hits == 0  # each one dropped (and deleted), none served


def test_packed_kv_goes_to_disk_and_back(tmp_path: Path) -> None:
    chat = (_chat("What is this?"), [RED])
    quant = {"kv_bits": 8, "kv_group_size": 32}
    asyncio.run(_ask(tmp_path, "qwen2_5_vl", [chat], **quant))
    (tokens, cached, prompt), = asyncio.run(_ask(tmp_path, "qwen2_5_vl", [chat], **quant))
    assert cached >= 0.9 * prompt and len(tokens) == GREEDY.max_tokens
    # full-precision files are another KV's: never served to a packed engine, nor the other way
    (_, cached_full, _), = asyncio.run(_ask(tmp_path, "qwen2_5_vl", [chat]))
    assert cached_full == 0


def test_the_flags_through_the_server_sigterm_and_the_openai_client(tmp_path: Path) -> None:
    """``serve --kv-bits 8 --prefix-cache-dir``: SIGTERM's drain writes the caches; a new server on the
    directory serves the same chat from disk (usage and /metrics say so); a second one on it is refused."""
    import httpx
    import openai
    from server_utils import image_data_url, start_server

    args = ["--model", str(build_model("qwen2_5_vl", "micro")), "--mm-prefix-cache", "--kv-bits", "8",
            "--kv-group-size", "32", "--prefix-cache-dir", str(tmp_path / "kv")]
    messages = [SYSTEM, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(RED)}},
                                                     {"type": "text", "text": "What is this?"}]}]

    def ask(server: Any) -> Any:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        return client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)

    server = start_server(args, tmp_path / "first.log")
    try:
        first = ask(server)
    finally:
        assert server.stop() == 0
    assert "KV quantized to 8 bits" in server.log
    server = start_server(args, tmp_path / "second.log")
    try:
        refused = start_server(args, tmp_path / "third.log", wait_ready=False)
        assert refused.proc.wait(60) != 0 and "in use by another server" in refused.log  # one directory per server
        again = ask(server)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vlmserve_prefix_cache_disk_hits_total"))
    assert hits == 1


def test_what_memory_evicts_is_read_back_from_disk_while_serving(tmp_path: Path) -> None:
    """A text store of one entry: the second chat evicts the first to disk (in the background), and the
    first asked again comes back from the file, as a cold prefill answers it."""
    first = ([SYSTEM, {"role": "user", "content": "Name three shapes."}], [])
    second = ([{"role": "system", "content": "Answer in French. " * 30}, {"role": "user", "content": "Hi."}], [])
    seen: list[Any] = []
    runs = asyncio.run(_ask(tmp_path, "qwen2_5_vl", [first, second, first], seen, prefix_cache_entries=1))
    (cold, _, _), = asyncio.run(_ask(None, "qwen2_5_vl", [first]))
    (tokens, cached, prompt) = runs[2]
    assert tokens == cold and cached >= 0.9 * prompt
    assert seen[0].hits == 1 and seen[0].written_bytes > 0


def test_two_models_of_one_server_share_the_directory_a_folder_each(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running_engine(build_model("qwen2_5_vl", "micro"), prefix_cache_dir=str(tmp_path)) as one, \
                running_engine(build_model("qwen2_vl", "micro"), prefix_cache_dir=str(tmp_path)) as two:
            assert one.core is not None and two.core is not None and one.core.tier and two.core.tier
            assert one.core.tier.store.directory != two.core.tier.store.directory

    asyncio.run(scenario())
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_a_waiting_prompts_file_is_read_ahead_off_the_worker(tmp_path: Path) -> None:
    """A prompt that waits for a batch slot has its file read on the tier's reader thread meanwhile; at its
    admission the worker only turns the arrays into a cache."""
    import threading

    chat = ([SYSTEM, {"role": "user", "content": "Name three shapes."}], [])
    asyncio.run(_ask(tmp_path, "qwen2_5_vl", [chat]))  # on disk after the shutdown
    readers: list[str] = []

    async def scenario() -> tuple[list[int], int]:
        async with running_engine(build_model("qwen2_5_vl", "micro"), prefix_cache_dir=str(tmp_path),
                                  max_batch_size=1) as engine:
            assert engine.core is not None and engine.core.tier is not None
            store = engine.core.tier.store
            read = store.read
            store.read = lambda entry: (readers.append(threading.current_thread().name), read(entry))[1]  # type: ignore[method-assign]
            busy = asyncio.create_task(gather(engine.generate_chat(
                "busy", [{"role": "user", "content": "Count."}], [], None, SamplingParams(max_tokens=40, ignore_eos=True))))
            await asyncio.sleep(0.05)  # the slot is taken: the chat waits
            result = await gather(engine.generate_chat("chat", *chat, None, GREEDY))
            await busy
            return result.token_ids, result.num_cached_tokens

    tokens, cached = asyncio.run(scenario())
    (cold, _, prompt), = asyncio.run(_ask(None, "qwen2_5_vl", [chat]))
    assert tokens == cold and cached >= 0.9 * prompt
    assert readers and set(readers) == {"prefix-disk-read_0"}, readers  # never on the worker
