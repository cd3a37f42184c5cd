"""[main] One agent turn through the real SDKs, timed: the ``anthropic`` client (Messages) and the ``openai``
client's Responses, both streamed; and the server's /metrics as numbers.

A turn's TTFT is the time to the stream's first event, which the server sends with the request's first
token (``message_start``, ``response.created``): its first content delta can come tokens later, while a
tool-call parser holds text that might open a call (``<tool_response>`` does). Its time is the whole
request's; its prompt and cached tokens come from the usage the server reports
(Messages: input + cache read + cache creation, as Anthropic counts; Responses: input_tokens and
input_tokens_details.cached_tokens).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import anthropic
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 1800.0  # a cold prefill of a long prompt on 2 CPU cores takes minutes


@dataclass(slots=True)
class Timed:
    """What one request measured (seconds)."""

    ttft_s: float | None = None  # the first token (the stream's first event)
    first_delta_s: float | None = None  # the first content delta a client renders
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Client:
    """Both SDKs pointed at one server, greedy, ``max_tokens`` a turn."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    def messages(self, body: dict[str, Any], max_tokens: int | None = None, **extra: Any) -> Timed:
        out, sent = Timed(), time.perf_counter()
        try:
            stream = self.claude.messages.create(model=self.model, max_tokens=max_tokens or self.max_tokens, stream=True,
                                                 extra_body={"temperature": 0.0}, **body, **extra)
            for event in stream:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - sent
                if event.type == "content_block_delta" and out.first_delta_s is None:
                    out.first_delta_s = time.perf_counter() - sent
                elif event.type == "message_delta":
                    u = event.usage
                    read, made = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
                    out.prompt_tokens, out.cached_tokens = (u.input_tokens or 0) + read + made, read
        except (anthropic.APIError, httpx.HTTPError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:300]
        out.total_s = time.perf_counter() - sent
        return out

    def responses(self, body: dict[str, Any], max_tokens: int | None = None) -> Timed:
        out, sent = Timed(), time.perf_counter()
        try:
            stream = self.openai.responses.create(model=self.model, max_output_tokens=max_tokens or self.max_tokens,
                                                  temperature=0.0, stream=True, **body)
            for event in stream:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - sent
                if event.type.endswith(".delta") and out.first_delta_s is None:
                    out.first_delta_s = time.perf_counter() - sent
                elif event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                    u = event.response.usage
                    if u is not None:
                        out.prompt_tokens, out.cached_tokens = u.input_tokens, u.input_tokens_details.cached_tokens
        except (openai.APIError, httpx.HTTPError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:300]
        out.total_s = time.perf_counter() - sent
        return out

    def metrics(self) -> dict[str, float]:
        """vlmserve's counters and gauges, summed over their labels, without the ``vlmserve_`` prefix."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for s in family.samples:
                if s.name.startswith("vlmserve_"):
                    name = s.name.removeprefix("vlmserve_").removesuffix("_total")
                    values[name] = values.get(name, 0.0) + s.value
        return values
