"""[any] The tool-call formats by name, and which one a model speaks."""

from __future__ import annotations

from vlmserve.tools import gemma4, glm, hermes, kimi, llama4, mistral
from vlmserve.tools.base import ToolFormat

# A format whose markers another's include comes before it (GLM's are Hermes's): the first that matches wins
FORMATS: dict[str, ToolFormat] = {fmt.name: fmt for fmt in (gemma4.FORMAT, glm.FORMAT, hermes.FORMAT, mistral.FORMAT,
                                                     llama4.FORMAT, kimi.FORMAT)}
PARSERS: tuple[str, ...] = tuple(FORMATS)
ALIASES: dict[str, str] = {"qwen": "hermes", "qwen3_coder": "hermes", "pixtral": "mistral"}


def get_format(parser: str) -> ToolFormat:
    fmt = FORMATS.get(ALIASES.get(parser, parser))
    if fmt is None:
        known = ", ".join((*PARSERS, *ALIASES))
        raise ValueError(f"unknown tool parser {parser!r}; expected one of {known}")
    return fmt


def select_parser(chat_template: str | None, family_default: str | None) -> str | None:
    """The format the chat template writes calls in, else the model family's default."""
    for name, fmt in FORMATS.items():
        if chat_template and (fmt.signature or fmt.start) in chat_template:
            return name
    return family_default
