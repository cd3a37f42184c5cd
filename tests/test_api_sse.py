"""Every SSE reader gets each event whole, whatever text the model emits. JSON leaves U+0085,
U+2028 and U+2029 raw, and readers that split lines as Python's str.splitlines does (httpx's
iter_lines) cut an event there. A random model emits them from byte tokens: that once broke a
SIGTERM test's reader in CI. Constrained decoding makes the demo model emit them on purpose."""

from __future__ import annotations

import json

import httpx

from vlmserve.config import DEFAULT_MODEL_NAME

LINE_BREAKS = "\x85\u2028\u2029"
BREAKS = "next{}line{}sep{}para".format(*LINE_BREAKS)
CHAT = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 40,
        "temperature": 0, "structured_outputs": {"choice": [BREAKS]}}


def _data_lines(server, path: str, body: dict) -> tuple[bytes, list[str]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        raw = r.read()
    return raw, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_line_splitting_reader_gets_every_chat_chunk_whole(demo_server):
    raw, payloads = _data_lines(demo_server, "/v1/chat/completions", CHAT | {"stream": True})
    assert not any(char.encode() in raw for char in LINE_BREAKS)  # escaped, so no reader sees a line break
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == BREAKS and payloads[-1] == "[DONE]"


def test_the_openai_sdk_stream_and_the_whole_answer_agree(demo_client):
    kwargs = {k: v for k, v in CHAT.items() if k != "structured_outputs"}
    extra = {"structured_outputs": CHAT["structured_outputs"]}
    whole = demo_client.chat.completions.create(**kwargs, extra_body=extra).choices[0].message.content
    with demo_client.chat.completions.stream(**kwargs, extra_body=extra) as stream:
        streamed = stream.get_final_completion().choices[0].message.content
    assert whole == streamed == BREAKS


def test_a_line_splitting_reader_gets_every_responses_event_whole(demo_server):
    schema = {"type": "object", "properties": {"say": {"enum": [BREAKS]}}, "required": ["say"]}
    body = {"model": DEFAULT_MODEL_NAME, "input": "Say it.", "max_output_tokens": 60, "temperature": 0, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "say", "schema": schema}}}
    raw, payloads = _data_lines(demo_server, "/v1/responses", body)
    events = [json.loads(p) for p in payloads]
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert not any(char.encode() in raw for char in LINE_BREAKS) and len(done) == 1
    assert json.loads(done[0]["text"]) == {"say": BREAKS}
