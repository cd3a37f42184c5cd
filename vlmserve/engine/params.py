"""[any] Per-request sampling parameters, and the keys the engine's caches give a prompt. No MLX here; the prompt
itself (``PromptInputs``) is phase 1's contract with the engine: vlmserve/inputs.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vlmserve.inputs import Guide, HostArray, PromptInputs


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens for one request; validated at the API edge."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's: the request's stop tokens (EOS, stop_token_ids) cannot be sampled, nor stop strings end it,
    # before this many tokens
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True  # False keeps tool-call markers in the text for the parser
    guide: Guide | None = None  # constrained decoding: only tokens the grammar allows
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, what to add to its logit), as OpenAI's
    # The prompt's own logprobs (each token given those before it), with this many alternatives:
    # None: not computed. The prompt is then prefilled by tokens, alone, without the prefix cache.
    prompt_logprobs: int | None = None
    # OpenAI's Predicted Outputs: the tokens the client expects the output to be, or to be close to;
    # verified as drafts (engine/speculative.py), so the output is what it would be without them
    prediction: tuple[int, ...] = field(default=(), repr=False)
    # Anthropic's cache_control: the prompt's stored prefix is kept from eviction this many seconds (0: not)
    cache_ttl_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError("top_k must be >= 0 and min_p in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.top_logprobs <= 20 or not 0 <= (self.prompt_logprobs or 0) <= 20:
            raise ValueError("top_logprobs and prompt_logprobs must be in [0, 20]")
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether sampling looks at the tokens generated so far (penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )




def prefix_key(prompt: PromptInputs, media_ids: frozenset[int],
               last_run_marks: frozenset[int] = frozenset()) -> list[int] | None:
    """The prompt's token ids with each image's placeholder runs written as one id of its own, made
    from the image's content hash (negative: never a real token), so that a cached prefix matches
    only up to the first position where a token or an image differs. An image is one run, or where
    ``last_run_marks`` is given (SmolVLM's tiles), every run up to the one right after a mark. None
    where the images have no hash each or their runs do not pair with them (a clip whose frames are
    runs of their own: Qwen3-VL's, Qwen3.5's and Gemma 4's time-stamped groups)."""
    if not prompt.has_images:
        return prompt.input_ids
    if not media_ids or len(prompt.images) != prompt.num_images or prompt.has_audio:
        return None  # a clip has no content hash here: a prompt with audio is never keyed (nor reused)
    if prompt.has_videos and "pixel_values" in prompt.arrays:
        return None  # items are images, then videos: runs of both kinds would not pair in prompt order
    return _image_runs_keyed(prompt, media_ids, last_run_marks)


def _image_runs_keyed(prompt: PromptInputs, media_ids: frozenset[int], marks: frozenset[int]) -> list[int] | None:
    key: list[int] = []
    images, previous, pseudo, open_image = iter(prompt.images), -1, 0, False
    for token in prompt.input_ids:
        media = token in media_ids
        if media and previous not in media_ids:
            if not open_image:  # a new image's first run
                item = next(images, None)
                if item is None:
                    return None
                pseudo = -1 - int(item.key[:15], 16)
            # without marks every run is an image; with them, the run right after a mark ends its image
            open_image = bool(marks) and previous not in marks
        key.append(pseudo if media else token)
        previous = token
    return key if next(images, None) is None and not open_image else None


def text_key(prompt: PromptInputs, media_ids: frozenset[int]) -> list[int] | None:
    """The key under which the text store may serve a prompt with images: its tokens before its first
    media token, then one id no stored prompt holds (-1), so that a cached prefix is reused up to the
    first image whole, never past it. None where no token is known to be an image's."""
    first = next((i for i, token in enumerate(prompt.input_ids) if token in media_ids), None)
    return None if first is None else [*prompt.input_ids[:first], -1]


def pixel_count(arrays: dict[str, HostArray] | dict[str, np.ndarray]) -> int:
    """How many pixel values a prompt's (or one image's or video's) arrays hold: the vision tower's work."""
    count = 0
    for key in ("pixel_values", "pixel_values_videos"):
        pixels = arrays.get(key)
        if pixels is not None:
            count += sum(a.size for a in pixels) if isinstance(pixels, tuple) else int(pixels.size)
    return count
