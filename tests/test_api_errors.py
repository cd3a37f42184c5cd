"""Every error the API promises, in OpenAI's shape, and the next request still served."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from conftest import scene
from PIL import Image
from server_utils import image_data_url


def _post(server, body, headers=None, content=None):
    return httpx.post(server.url + "/v1/chat/completions", json=None if content is not None else body,
                      content=content, headers=headers, timeout=60)


def _image_msg(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]}]


def _png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _assert_error(response, status, param=None, says=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if says is not None:
        assert says in error["message"], error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def _ok(server, model_name):
    r = _post(server, {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


BAD_BODIES = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "Field required"),
    ({"model": "M", "messages": []}, "messages", "at least 1"),
    ({"model": "M", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "Input should be"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, "temperature", "less than or equal to 2"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p", "greater than 0"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "takes 1 to 256"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": 257}, "n", "takes 1 to 256"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs", "requires logprobs"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"hi": 5}}, "logit_bias", "not a token id"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 5}}, "logit_bias", "not a token id"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
    ({"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
    ({"model": "M", "messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
]


@pytest.mark.parametrize("body, param, says", BAD_BODIES)
def test_invalid_bodies_say_which_field_and_why(server, model_name, body, param, says):
    body = {**body, "model": model_name} if body.get("model") == "M" else body
    _assert_error(_post(server, body), 400, param, says)
    _ok(server, model_name)


def test_body_that_is_not_json(server, model_name):
    _assert_error(_post(server, None, {"content-type": "application/json"}, content=b"{nope"), 400, says="not valid JSON")
    _ok(server, model_name)


@pytest.mark.parametrize("content", ['"a\\ud800b"', '[{"type": "text", "text": "\\udc00"}]'])
def test_an_unpaired_surrogate_is_a_400_naming_it(server, model_name, content):
    """JSON can write half a UTF-16 surrogate pair alone (``"\\ud800"``): no character, and no
    tokenizer takes it. A whole pair (``"\\ud83d\\ude00"``, an emoji) is one character, and is served."""

    def post(content: str):
        body = f'{{"model": {json.dumps(model_name)}, "max_tokens": 2, "messages": [{{"role": "user", "content": {content}}}]}}'
        return _post(server, None, {"content-type": "application/json"}, content=body.encode())

    error = _assert_error(post(content), 400, "messages", "surrogate pair, alone")
    assert error["message"].startswith("messages.0: the text contains U+D")
    whole = content.replace("\\ud800", "\\ud83d\\ude00").replace("\\udc00", "\\ud83d\\ude00")
    assert post(whole).status_code == 200


BAD_IMAGES = [
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    (_b64(b"this is plain text, not an image"), "not an image"),
    (_b64(_png_bytes(scene("circle", (1, 2, 3)))[:80]), "truncated or corrupt"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("ftp://example.com/x.png", "unsupported URL scheme"),
]


@pytest.mark.parametrize("url, says", BAD_IMAGES)
def test_bad_images_are_400(server, model_name, url, says):
    _assert_error(_post(server, {"model": model_name, "messages": _image_msg(url)}), 400, "messages", says)
    _ok(server, model_name)


def test_too_many_pixels_is_400(server, model_name):
    huge = Image.new("1", (8000, 8000))  # 64 MP, but a tiny PNG
    _assert_error(_post(server, {"model": model_name, "messages": _image_msg(_b64(_png_bytes(huge)))}), 400, says="pixel limit")
    _ok(server, model_name)


def test_too_many_images_is_400(server, model_name):
    url = image_data_url(scene("circle", (220, 30, 30), size=32))
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(9)]
    body = {"model": model_name, "messages": [{"role": "user", "content": parts}]}
    _assert_error(_post(server, body), 400, "messages", "over the limit of 8", "too_many_images")
    _ok(server, model_name)


def test_prompt_longer_than_the_context_is_400(server, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "word " * 2000}]}
    _assert_error(_post(server, body), 400, "messages", "allows at most", "context_length_exceeded")
    _ok(server, model_name)


def test_unknown_model_is_404(server, model_name):
    _assert_error(_post(server, {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}), 404, "model",
                  "does not exist", "model_not_found")
    _ok(server, model_name)


def test_oversized_body_is_413(server, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "x" * (3 * 1024 * 1024)}]}
    _assert_error(_post(server, body), 413, says="byte limit", code="request_too_large")

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"y" * (128 * 1024)
        yield b'"}]}'

    _assert_error(_post(server, None, {"content-type": "application/json"}, content=chunked()), 413)
    _ok(server, model_name)


def test_openai_client_sees_typed_errors(client, model_name):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=_image_msg("data:image/png;base64,AAAA"))
    assert "image 1" in str(info.value)
