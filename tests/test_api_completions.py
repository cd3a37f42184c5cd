"""POST /v1/completions (issue 32) with the official openai client against a real ``vlmserve serve``
of the micro Gemma 4: prompts as text and as token ids, batches, streaming, echo, logprobs, and
what it refuses."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_utils import start_server

GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(gemma4_micro, tmp_path_factory):
    proc = start_server(["--model", str(gemma4_micro), "--max-batch-size", "2"],
                        tmp_path_factory.mktemp("completions") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(server, model: str, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"model": model, "prompt": text}, timeout=30).json()["tokens"]


def test_text_and_token_id_prompts_complete_alike(server, client, gemma4_micro):
    model, text = gemma4_micro.name, "Once upon a time, a red circle"
    by_text = client.completions.create(model=model, prompt=text, **GREEDY)
    by_ids = client.completions.create(model=model, prompt=_ids(server, model, text), **GREEDY)
    assert by_text.object == "text_completion" and by_text.choices[0].text
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.choices[0].finish_reason == "length"
    assert by_text.usage.completion_tokens == 8 and by_text.usage.prompt_tokens == len(_ids(server, model, text))


def test_a_batch_of_prompts_is_one_choice_each_in_order_and_equals_each_alone(client, gemma4_micro):
    """Five prompts through a batch of two: each choice is what its prompt gives alone."""
    model = gemma4_micro.name
    prompts = [f"Shape number {i} is a" for i in range(5)]
    batch = client.completions.create(model=model, prompt=prompts, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(5))
    alone = [client.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.completion_tokens == 5 * 8


def test_streamed_choices_join_to_the_whole_answer(client, gemma4_micro):
    model, prompts = gemma4_micro.name, ["A blue square", "A green triangle"]
    whole = client.completions.create(model=model, prompt=prompts, **GREEDY)
    texts, finishes, usage = ["", ""], [None, None], None
    for chunk in client.completions.create(model=model, prompt=prompts, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices] and finishes == ["length", "length"]
    assert usage.completion_tokens == 16


def test_n_choices_per_prompt_share_its_prefill_and_sample_with_seed_plus_j(server, client, gemma4_micro):
    """Three prompts, two choices each (index prompt * 2 + j): choice j is the prompt alone with seed + j;
    the prompts are counted once each in usage; streamed, the choices join to the same texts."""
    model, prompts = gemma4_micro.name, ["A red", "Two blue", "Three"]
    sampled = {"temperature": 1.0, "max_tokens": 6, "seed": 7, "extra_body": {"ignore_eos": True}}
    reply = client.completions.create(model=model, prompt=prompts, n=2, **sampled)
    assert [c.index for c in reply.choices] == list(range(6))
    alone = [client.completions.create(model=model, prompt=p, **{**sampled, "seed": 7 + j}).choices[0].text
             for p in prompts for j in range(2)]
    assert [c.text for c in reply.choices] == alone and len(set(alone)) > 3
    assert reply.usage.prompt_tokens == sum(len(_ids(server, model, p)) for p in prompts)
    assert reply.usage.completion_tokens == 6 * 6
    texts = [""] * 6
    for chunk in client.completions.create(model=model, prompt=prompts, n=2, stream=True, **sampled):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == alone
    scored = client.completions.create(model=model, prompt=prompts[0], n=2, echo=True, logprobs=1, max_tokens=1,
                                       temperature=0)
    first, second = (c.logprobs for c in scored.choices)
    assert first.token_logprobs[0] is None and first.token_logprobs[:-1] == second.token_logprobs[:-1]


def test_echo_and_max_tokens_zero(client, gemma4_micro):
    model, text = gemma4_micro.name, "Echo this prompt"
    echoed = client.completions.create(model=model, prompt=text, echo=True, **GREEDY).choices[0].text
    plain = client.completions.create(model=model, prompt=text, **GREEDY).choices[0].text
    assert echoed.endswith(plain) and text in echoed
    alone = client.completions.create(model=model, prompt=text, echo=True, max_tokens=0)
    assert text in alone.choices[0].text and alone.usage.completion_tokens == 0


def test_logprobs_in_the_legacy_shape(client, gemma4_micro):
    reply = client.completions.create(model=gemma4_micro.name, prompt="Count the shapes", logprobs=3, **GREEDY)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(p <= 0 for p in lp.token_logprobs) and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert all(max(top.values()) == pytest.approx(p, abs=1e-4) for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    whole = [t for t in lp.tokens if not t.startswith("bytes:")]  # part of a character: OpenAI's bytes:\xNN
    assert all(t in reply.choices[0].text for t in whole)


def test_what_lm_evaluation_harness_sends_to_score_likelihoods(server, client, gemma4_micro):
    """Its local-completions model: a batch of token-id prompts, echo, logprobs 1, max_tokens 1 (or
    0), temperature 0. It reads token_logprobs and the top_logprobs dict at every prompt position,
    the first one null, and calls a continuation greedy where each token's logprob is its dict's max."""
    model = gemma4_micro.name
    contexts = [_ids(server, model, t) for t in ("The red circle is", "A blue square and a green")]
    for max_tokens in (1, 0):
        reply = client.completions.create(model=model, prompt=contexts, echo=True, logprobs=1, max_tokens=max_tokens,
                                          temperature=0)
        for ids, choice in zip(contexts, reply.choices):
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(ids) + max_tokens == len(lp.top_logprobs) == len(lp.tokens)
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            for token, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
                assert token <= 0 and max(top.values()) >= token and len(top) in (1, 2)
        assert reply.usage.completion_tokens == len(contexts) * max_tokens
    alone = client.completions.create(model=model, prompt=contexts[0], echo=True, logprobs=1, max_tokens=0)
    assert alone.choices[0].logprobs.token_logprobs == reply.choices[0].logprobs.token_logprobs
    streamed = [c for c in client.completions.create(model=model, prompt=contexts[0], echo=True, logprobs=1,
                                                       max_tokens=2, temperature=0, stream=True)]
    first = streamed[0].choices[0]
    assert first.logprobs.token_logprobs[:len(contexts[0])] == alone.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("extra, param", [
    ({"n": 3}, "n"),  # over the batch of 2
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 10**9]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "an <|image|> typed in"}, "prompt"),
])
def test_what_it_refuses_is_an_openai_shaped_400(server, gemma4_micro, extra, param):
    body = {"model": gemma4_micro.name, "prompt": "hi", **extra}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_client_that_leaves_a_long_completion_aborts_it(server, client, gemma4_micro):
    """The client gives up after half a second on 2,000 tokens; the server aborts every prompt of it
    (its log says so) and serves the next request."""
    body = {"model": gemma4_micro.name, "prompt": ["a", "b"], "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    for _ in range(100):
        if "finish=disconnected" in server.log:
            break
        time.sleep(0.1)
    assert "prompts=2" in server.log and "finish=disconnected" in server.log
    assert client.completions.create(model=gemma4_micro.name, prompt="next", **GREEDY).choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_is_a_400_streamed_or_not(server, client, gemma4_micro, stream):
    """The first prompt's refusal comes before the response begins, streamed too (as chat's does): a 400
    the openai client raises, not a 200 whose stream holds an error."""
    limit = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as refused:
        reply = client.completions.create(model=gemma4_micro.name, prompt=[5] * (limit + 1), max_tokens=4,
                                          stream=stream)
        list(reply) if stream else None
    assert refused.value.code == "context_length_exceeded"
    assert client.completions.create(model=gemma4_micro.name, prompt="next", **GREEDY).choices[0].text
