"""[loop] What the app serves: the engines by name, media policy, auth, tool parsers, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vlmserve.api.errors import APIError
from vlmserve.api.metrics import ServerMetrics
from vlmserve.config import ServeConfig
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.preprocess.media import MediaPolicy


@dataclass(slots=True)
class ServedModel:
    name: str
    engine: AsyncEngine
    aliases: tuple[str, ...] = ()
    tool_parser_override: str | None = None

    @property
    def tool_parser(self) -> str | None:
        return self.tool_parser_override or self.engine.tool_format


@dataclass(slots=True)
class ServerState:
    models: list[ServedModel]
    media: MediaPolicy = field(default_factory=MediaPolicy)
    config: ServeConfig = field(default_factory=ServeConfig)  # api_key, default_max_tokens, body limit, CORS
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    draining: bool = False  # shutting down: no new requests, running ones finish


    def model(self, name: str) -> ServedModel:
        for served in self.models:
            if name == served.name or name in served.aliases:
                return served
        known = ", ".join(m.name for m in self.models)
        raise APIError(404, f"model {name!r} does not exist; this server has: {known}", "not_found_error", "model", "model_not_found")

    @property
    def ready(self) -> bool:
        return bool(self.models) and not self.draining and all(m.engine.ready for m in self.models)


def aliases_for(spec: str) -> tuple[str, ...]:
    """A local directory also answers to its base name (``/models/foo`` -> ``foo``)."""
    name = Path(spec).name
    return (name,) if name and name != spec else ()
