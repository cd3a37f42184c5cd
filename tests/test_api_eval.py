"""What evaluation and load harnesses rely on (issue 44), through a real server on the demo model.

``/v1/completions`` with ``echo`` and ``logprobs`` (lm-eval's ``loglikelihood``): the prompt's own
logprobs, then the generated token's, even when the model would stop right after the prompt; checked
against mlx-vlm's own forward over the same token ids. lm-eval's remote tokenizer's endpoints. vLLM's
sampling extensions on Responses and Messages (guidellm's ``ignore_eos``): honoured as on chat, or a
400 naming the field.

The demo model ends "A red circle." at once: its first sampled token is the end of the turn. lm-eval
sums ``token_logprobs[ctxlen:-1]``: without the prompt's logprobs it summed nothing (a
log-likelihood of 0, "certain"), and without the stop token's entry it would drop the continuation's
last token instead.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

PROMPT = "A red circle."


def _ids(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": "demo-gemma4", "prompt": text}, timeout=30)
    return r.json()["tokens"]


def _complete(server, **extra: Any) -> dict[str, Any]:
    body = {"model": "demo-gemma4", "prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(server, **extra: Any) -> dict[str, Any]:
    body = {"model": "demo-gemma4", "prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "stream": True, **extra}
    text, finish = "", None
    logprobs: dict[str, list[Any]] = {"tokens": [], "token_logprobs": []}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            for key in logprobs:
                logprobs[key] += (choice.get("logprobs") or {}).get(key, [])
    return {"text": text, "finish_reason": finish, "logprobs": logprobs}


def _check_prompt(logprobs: dict[str, list[Any]], ids: list[int], want: list[float | None]) -> None:
    got = logprobs["token_logprobs"][:len(ids)]
    assert got[0] is None and want[0] is None
    assert got[1:] == pytest.approx(want[1:], abs=1e-4)


def test_a_continuation_that_ends_at_once_keeps_its_logprobs_and_the_stop_tokens(demo_f32_server, demo_reference):
    ids = _ids(demo_f32_server, PROMPT)
    want = demo_reference(ids)
    choice = _complete(demo_f32_server)
    assert choice["finish_reason"] == "stop" and choice["text"] == PROMPT  # the model stops at once
    logprobs = choice["logprobs"]
    # the prompt's tokens, then the token the model ended on, as vLLM lists it (lm-eval drops it)
    assert len(logprobs["token_logprobs"]) == len(ids) + 1 == len(logprobs["tokens"])
    _check_prompt(logprobs, ids, want)
    assert logprobs["token_logprobs"][-1] is not None and logprobs["token_logprobs"][-1] < 0

    streamed = _streamed(demo_f32_server)
    assert streamed["text"] == PROMPT and streamed["finish_reason"] == "stop"
    assert streamed["logprobs"]["token_logprobs"] == logprobs["token_logprobs"]


def test_max_tokens_0_gives_the_prompts_logprobs_alone(demo_f32_server, demo_reference):
    ids = _ids(demo_f32_server, PROMPT)
    for choice in (_complete(demo_f32_server, max_tokens=0), _streamed(demo_f32_server, max_tokens=0)):
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
        _check_prompt(choice["logprobs"], ids, demo_reference(ids))


def test_a_one_token_prompt_is_its_token_with_a_null_logprob(demo_f32_server):
    ids = _ids(demo_f32_server, "A")
    choice = _complete(demo_f32_server, prompt=ids[:1])
    logprobs = choice["logprobs"]["token_logprobs"]
    assert logprobs[0] is None and len(logprobs) == 2  # the prompt's one token, then the one generated


def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_reads(demo_f32_server):
    """lm-eval's ``tokenizer_backend=remote``: GET /tokenizer_info (special tokens, chat template), then
    POST /tokenize {"prompt", "add_special_tokens": false} and /detokenize {"tokens"}, no model named."""
    info = httpx.get(demo_f32_server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] == "<bos>" and info["pad_token"] == "<pad>"
    assert "<|turn>" in info["chat_template"] and info["tokenizer_class"]
    assert "name_or_path" not in info  # the server's paths stay its own
    ids = httpx.post(demo_f32_server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    assert len(ids) == 1
    tokens = _ids(demo_f32_server, PROMPT)
    text = httpx.post(demo_f32_server.url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert text.endswith(PROMPT)


def test_responses_and_messages_honour_vllms_sampling_extensions_or_refuse_them(demo_f32_server):
    ask = {"model": "demo-gemma4", "input": "hi", "max_output_tokens": 40, "temperature": 0}
    short = httpx.post(demo_f32_server.url + "/v1/responses", json=ask, timeout=60).json()
    long = httpx.post(demo_f32_server.url + "/v1/responses", json={**ask, "ignore_eos": True}, timeout=60).json()
    assert short["usage"]["output_tokens"] < 40 == long["usage"]["output_tokens"]  # the greeting ends; not here
    cut = httpx.post(demo_f32_server.url + "/v1/responses", json={**ask, "ignore_eos": True, "stop": ["!"]},
                     timeout=60).json()
    assert cut["usage"]["output_tokens"] < 40  # "Hello! ..." ends at the stop string, ignore_eos or not

    claude = {"model": "demo-gemma4", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(demo_f32_server.url + "/v1/messages", json={**claude, "ignore_eos": True}, timeout=60).json()
    assert r["usage"]["output_tokens"] == 40

    held = httpx.post(demo_f32_server.url + "/v1/responses", json={**ask, "min_tokens": 30}, timeout=60).json()
    assert short["usage"]["output_tokens"] < 30 <= held["usage"]["output_tokens"]  # its end held back
    r = httpx.post(demo_f32_server.url + "/v1/messages", json={**claude, "min_tokens": 30}, timeout=60).json()
    assert r["usage"]["output_tokens"] >= 30

    for path, body in (("/v1/responses", {**ask, "use_beam_search": True}), ("/v1/messages", {**claude, "best_of": 2})):
        r = httpx.post(demo_f32_server.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert ("use_beam_search" if "use_beam_search" in body else "best_of") in r.text


def test_chat_prompt_logprobs_are_vllms_and_come_back_when_the_answer_stops_at_once(demo_f32_server, demo_reference):
    """vLLM's chat ``prompt_logprobs``: a top-level list, one entry per prompt token (the first None), each
    the prompt's token and the ``k`` best by token id with logprob, rank and text; here even when a stop
    string ends the answer at its first token. Streamed, a 400 (as vLLM); Responses and Messages have no
    place for them: a 400 naming the field."""
    url = demo_f32_server.url
    messages = [{"role": "user", "content": "Describe a red circle."}]
    ids = httpx.post(url + "/tokenize", json={"model": "demo-gemma4", "messages": messages}, timeout=30).json()["tokens"]
    want = demo_reference(ids)
    ask = {"model": "demo-gemma4", "messages": messages, "temperature": 0, "max_tokens": 8, "prompt_logprobs": 2}
    plain = httpx.post(url + "/v1/chat/completions", json=ask, timeout=60).json()
    first = plain["choices"][0]["message"]["content"][:1]
    cut = httpx.post(url + "/v1/chat/completions", json={**ask, "stop": [first]}, timeout=60).json()
    assert cut["choices"][0]["message"]["content"] == "" and cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] == 1  # the stop string ended it at its first token
    for reply in (plain, cut):
        scored = reply["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        for token, entry, logprob in zip(ids[1:], scored[1:], want[1:]):
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(logprob, abs=1e-4) and mine["rank"] >= 1
            assert 2 <= len(entry) <= 3 and all(e["rank"] >= 1 and isinstance(e["decoded_token"], str)
                                                for e in entry.values())
            best = min(entry.values(), key=lambda e: e["rank"])
            assert best["rank"] == 1 and best["logprob"] >= mine["logprob"]
    assert cut["prompt_logprobs"] == plain["prompt_logprobs"]

    streamed = httpx.post(url + "/v1/chat/completions", json={**ask, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    for path, body in (("/v1/responses", {"model": "demo-gemma4", "input": "hi", "prompt_logprobs": 1}),
                       ("/v1/messages", {"model": "demo-gemma4", "max_tokens": 8, "prompt_logprobs": 1,
                                         "messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and "prompt_logprobs" in r.text, r.text
