"""The bad-input corpus a security review sent: each case is a clear 400, and the server stays whole.

Every case runs against the shared real server; after each one a normal request is served, and
at the end no request is left in flight and nothing answered 5xx.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import scene
from server_utils import image_data_url
from test_api_errors import _assert_error, _ok, _png_bytes, _post

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def _nested_any_of(depth: int) -> str:
    """The schema as JSON text (Python's own encoder would recurse too deep to write it)."""
    inner = '{"anyOf": [' * depth + '{"type": "string"}' + "]}" * depth
    return '{"type": "object", "properties": {"x": ' + inner + "}}"


def _post_json(server, head: str, tail: str = "}"):
    return _post(server, None, {"content-type": "application/json"}, content=(head + tail).encode())


def _with_image(text: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30])
def test_a_seed_out_of_range_is_400(server, model_name, seed):
    _assert_error(_post(server, {"model": model_name, "messages": HI, "seed": seed}), 400, "seed")
    _ok(server, model_name)


def test_the_largest_seed_is_served(server, model_name):
    r = _post(server, {"model": model_name, "messages": HI, "seed": 2**64 - 1, "max_tokens": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("depth", [40, 900])
def test_a_schema_nested_too_deep_is_400(server, model_name, depth):
    head = json.dumps({"model": model_name, "messages": HI})[:-1]
    tools = f', "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {_nested_any_of(depth)}}}}}]'
    schema = f', "response_format": {{"type": "json_schema", "json_schema": {_nested_any_of(depth)}}}'
    for body, param in ((head + tools, "tools.0.function.parameters"), (head + schema, "response_format.json_schema")):
        # Past about 200 levels the JSON parser itself refuses; below, the schema check names the field.
        _assert_error(_post_json(server, body), 400, param if depth < 200 else None, "deep", "json_too_deep")
    _ok(server, model_name)


def test_a_schema_too_large_is_400(server, model_name):
    params = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    _assert_error(_post(server, {"model": model_name, "messages": HI, "tools": [tool]}), 400, code="json_too_large")
    _ok(server, model_name)


def test_tool_call_arguments_nested_too_deep_are_400(server, model_name):
    arguments = "[" * 5000 + "]" * 5000
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": arguments}}]}]
    _assert_error(_post(server, {"model": model_name, "messages": history}), 400,
                  "messages.1.tool_calls.0.function.arguments", code="json_too_deep")
    _ok(server, model_name)


def test_a_file_path_with_a_nul_byte_is_400(server, model_name, media_dir):
    for url in (f"file://{media_dir}/red%00.png", f"{media_dir}/red\x00.png"):
        _assert_error(_post(server, {"model": model_name, "messages": _with_image("what?", url)}), 400,
                      "messages", "NUL byte", "invalid_image")
    _ok(server, model_name)


@pytest.mark.parametrize("token", ["<|image|>", "<turn|>", "<|turn>", "<bos>", "<eos>"])
def test_special_tokens_typed_as_text_are_400_naming_the_token(server, model_name, token):
    url = image_data_url(scene("circle", (220, 30, 30)))
    body = {"model": model_name, "messages": _with_image(f"look {token} here", url)}
    error = _assert_error(_post(server, body), 400, "messages", "control token")
    assert repr(token) in error["message"] and "messages.0" in error["message"]
    for where in ({"role": "system", "content": token}, {"role": "user", "content": [{"type": "text", "text": token}]}):
        _assert_error(_post(server, {"model": model_name, "messages": [where]}), 400, says=repr(token))
    tool = {"type": "function", "function": {"name": "f", "description": f"a {token}"}}
    _assert_error(_post(server, {"model": model_name, "messages": HI, "tools": [tool]}), 400, says="tools.0")
    _ok(server, model_name)


def test_look_alike_text_is_served(server, model_name):
    """Text near a control token (a broken marker, a word) is ordinary text."""
    r = _post(server, {"model": model_name, "messages": [{"role": "user", "content": "<|imag|> turn| <b o s>"}],
                       "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_a_utf16_body_is_400(server, model_name):
    body = json.dumps({"model": model_name, "messages": HI})
    for encoding in ("utf-16", "utf-16-le", "utf-32"):
        r = _post(server, None, {"content-type": "application/json"}, content=body.encode(encoding))
        _assert_error(r, 400, code="invalid_encoding", says="UTF-8")
    _ok(server, model_name)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_without_tools_is_400(server, model_name, choice):
    _assert_error(_post(server, {"model": model_name, "messages": HI, "tool_choice": choice}), 400,
                  "tool_choice", "none were given", "missing_tools")
    r = _post(server, {"model": model_name, "messages": HI, "tools": [TOOL], "tool_choice": choice, "max_tokens": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("part, kind", [
    ({"type": "input_file", "input_file": {"file_data": "AAAA"}}, "'input_file'"),
    ({"type": "hologram"}, "'hologram'"),
    ({"text": "no type"}, "no 'type'"),
    ("just a string", "no 'type'"),
])
def test_unsupported_content_parts_are_named(server, model_name, part, kind):
    body = {"model": model_name, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}
    error = _assert_error(_post(server, body), 400, "messages.0.content")
    assert f"content part 1 has {kind if kind.startswith('no') else 'type ' + kind}" in error["message"], error["message"]
    assert "text, image_url, video_url and input_audio parts" in error["message"] and "valid string" not in error["message"]
    _ok(server, model_name)


# -- remote images: no server-side request forgery ----------------------------------------


class _Images(BaseHTTPRequestHandler):
    png = b""
    hits = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).hits += 1
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("to=", 1)[1])
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(self.png)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.png = _png_bytes(scene("square", (30, 30, 220)))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.0.0.7", "0.0.0.0"])
def test_remote_urls_to_internal_addresses_are_refused(server, model_name, image_host, host):
    before = _Images.hits
    url = f"http://{host}:{image_host}/admin.png"
    _assert_error(_post(server, {"model": model_name, "messages": _with_image("what?", url)}), 400,
                  "messages", "non-public address", "invalid_image")
    assert _Images.hits == before  # refused before any connection
    _ok(server, model_name)


def test_allowed_domains_may_name_an_internal_host_and_redirects_are_checked(image_host):
    from vlmserve.preprocess.images import ImageError
    from vlmserve.preprocess.media import MediaPolicy, load_image_source

    policy = MediaPolicy(allow_remote=True, allowed_domains=("127.0.0.1",))
    assert load_image_source(f"http://127.0.0.1:{image_host}/ok.png", policy).size == (96, 96)
    hop = f"http://127.0.0.1:{image_host}/redirect?to=http://127.0.0.1:{image_host}/ok.png"
    assert load_image_source(hop, policy).size == (96, 96)  # a redirect inside the allow-list
    away = f"http://127.0.0.1:{image_host}/redirect?to=http://localhost:{image_host}/ok.png"
    with pytest.raises(ImageError, match="not in --allowed-media-domains"):
        load_image_source(away, policy)
    with pytest.raises(ImageError, match="non-public address"):  # no allow-list: a redirect is checked too
        load_image_source(hop, MediaPolicy(allow_remote=True))


def test_the_corpus_left_the_server_whole(server, model_name):
    """Runs last in this module: nothing in flight, no 5xx counted, health and a request fine."""
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    in_flight = [line for line in metrics.splitlines() if line.startswith("vlmserve_requests_in_flight{")]
    assert in_flight and all(line.endswith(" 0.0") for line in in_flight), in_flight
    assert 'status="error_5' not in metrics
    _ok(server, model_name)
