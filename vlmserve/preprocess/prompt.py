"""[pool] Chat messages and decoded images -> token ids and numpy arrays for the worker."""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import os
import queue
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.inputs import AUDIO_KEYS, HostArray, ImageItem, PromptInputs
from vlmserve.preprocess.audio import clip_items
from vlmserve.preprocess.control import ControlTokens
from vlmserve.preprocess.image_items import image_items, picture_hash
from vlmserve.preprocess.image_sizes import ProcessorLimit
from vlmserve.preprocess.template import TemplateInfo, adapt_messages, inspect_template
from vlmserve.preprocess.video import Video, VideoSampling, processor_sampling

log = logging.getLogger(__name__)
SLOW_PREPROCESS_S = 1.0
REASONING_PROBES = 64  # sets of template variables whose probe render is kept
# What video processors return about the frames besides the arrays the model takes (Gemma 4's counts)
VIDEO_BOOKKEEPING = frozenset({"num_frames_per_video", "num_soft_tokens_per_frame", "num_soft_tokens_per_video",
                               "frame_timestamps"})


@dataclass(slots=True, frozen=True)
class CacheHints:
    """What the engine's prefix caches need of phase 1 for one model (nothing by default)."""

    stems: bool = False  # where the next turn's prompt parts from this one (``PromptInputs.stem``): recurrent caches
    picture_keys: bool = False  # images whose arrays do not split per image keyed by their pictures (the image cache)


class PromptError(ValueError):
    """The messages cannot be turned into a prompt (bad template input, image count...)."""


def tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def templater_of(processor: Any) -> Any:
    """Whichever object carries the checkpoint's chat template: the processor, else its tokenizer. A
    processor's template that is only its class's built-in default yields to the tokenizer's, which the
    checkpoint ships (mlx-vlm's InternVLChatProcessor brings one that loses string content's words)."""
    template = getattr(processor, "chat_template", None)
    tokenizer = tokenizer_of(processor)
    if not template or (template == _default_template(processor) and getattr(tokenizer, "chat_template", None)):
        return tokenizer
    return processor


def _default_template(processor: Any) -> str | None:
    """The chat template a processor's class sets when none is given (its ``__init__`` default)."""
    try:
        parameter = inspect.signature(type(processor).__init__).parameters.get("chat_template")
    except (TypeError, ValueError):  # a builtin or C-level __init__: no signature to read
        return None
    default = getattr(parameter, "default", None)
    return default if isinstance(default, str) else None


def render_chat(
    processor: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    videos: bool = False,
) -> str:
    """Render the model's own chat template; images stay as ``{"type": "image"}`` parts, videos as
    ``{"type": "video"}``. ``template_kwargs`` are the template's own variables (``enable_thinking``...).

    With ``videos``, the tokenizer renders the processor's template: mlx-vlm's Gemma 4 processor
    renders through its own message builder, which drops a video part that carries no file."""
    templater = templater_of(processor)
    extra = dict(template_kwargs or {})
    if videos and templater is not tokenizer_of(processor):
        extra["chat_template"] = templater.chat_template
        templater = tokenizer_of(processor)
    try:
        text: str = templater.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
        )
        return text
    except Exception as exc:  # noqa: BLE001 - jinja errors are the caller's input
        raise PromptError(f"chat template failed: {exc}") from exc


def encode(processor: Any, text: str, images: Sequence[Image.Image] = (),
           image_kwargs: Mapping[str, int] | None = None, videos: Sequence[Video] = (),
           picture_keys: bool = False, audio: Sequence[np.ndarray] = ()) -> PromptInputs:
    """Tokenize a rendered prompt and preprocess its images and videos with the model's processor.

    Processors are called with nothing but text, images and the tensor type (mlx-vlm's LLaVA
    processors pass any other keyword to the image processor, which rejects it), and a request's
    ``image_kwargs`` (``min_pixels``/``max_pixels``, for the processors that take them: Qwen's).
    Videos go as mlx-vlm's ``prepare_inputs`` sends them: the frames, and each clip's sampled ``fps``
    and frame metadata to the processors whose call names them (Qwen3-VL's timestamps, Gemma 4's).
    With ``picture_keys``, images whose arrays do not split per image get items keyed by the pictures.
    ``audio``: mono clips at the feature extractor's rate (its ``input_features`` join the arrays).
    """
    text = _without_doubled_bos(tokenizer_of(processor), text)
    if not images and not videos and not audio:
        ids = tokenizer_of(processor)(text)["input_ids"]
        return PromptInputs(input_ids=[int(i) for i in ids])
    kwargs: dict[str, Any] = dict(image_kwargs or {})
    if videos:
        declared = inspect.signature(processor.__call__).parameters
        kwargs["videos"] = [v.frames for v in videos]
        if "fps" in declared:
            kwargs["fps"] = [v.sampled_fps for v in videos]
        if "video_metadata" in declared:
            kwargs["video_metadata"] = [v.metadata() for v in videos]
    if audio:
        kwargs["audio"] = list(audio)
    out = processor(text=[text], images=list(images) or None, return_tensors="np", **kwargs)
    arrays: dict[str, HostArray] = {}
    for key, value in out.items():
        host = _to_host(value) if key not in ("input_ids", "attention_mask", *VIDEO_BOOKKEEPING) else None
        if host is not None:
            arrays[key] = host
    ids = [int(i) for i in np.asarray(out["input_ids"]).reshape(-1)]
    pictures = {k: v for k, v in arrays.items() if k not in AUDIO_KEYS}  # a clip is no image item
    items = image_items(pictures, len(images), len(ids), len(videos))
    if picture_keys and not items and images and not videos:  # arrays that do not split per image (tiles)
        items = tuple(ImageItem(picture_hash(image, image_kwargs), {}) for image in images)
    return PromptInputs(input_ids=ids, arrays=arrays, num_images=len(images) + len(videos), images=items,
                        clips=clip_items(audio, arrays) if audio else ())


# The history the next turn renders: this prompt's messages, a reply and a question (placeholders)
NEXT_TURN: tuple[dict[str, Any], ...] = (
    {"role": "assistant", "content": "vlmserve next reply"}, {"role": "user", "content": "vlmserve next turn"})
# After a tool's result, an agent's next turn is a call and its result: were it a question, Qwen3.5's template
# would re-render without their think blocks the replies since the last question, and the stem would end there
_CALL = {"id": "vlmservenext", "type": "function", "function": {"name": "vlmserve_next", "arguments": {}}}
NEXT_CALL: tuple[dict[str, Any], ...] = (
    {"role": "assistant", "content": "", "tool_calls": [_CALL]},
    {"role": "tool", "tool_call_id": "vlmservenext", "name": "vlmserve_next", "content": "vlmserve next result"})


def _stem(processor: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
          template_kwargs: Mapping[str, Any] | None, videos: bool, ids: list[int], text: str) -> int | None:
    """How many of the prompt's ``ids`` the next turn's prompt repeats: the part of ``text`` the next
    turn's rendering of the history begins with (the template re-renders the reply after it: Qwen3.5's
    without the think block the generation prompt opened; LFM2-VL's exactly as the prompt ends), where
    the rest of ``text`` tokenizes on its own to the tokens that end ``ids``. A prompt the history
    repeats whole keeps its last token out (it may merge with the reply's first characters). None where
    the template renders neither way."""
    history = _next_history(processor, messages, tools, template_kwargs, videos)
    if history is None:  # a template that refuses the placeholder turns: no snapshot, the request goes on
        return None
    shared = len(os.path.commonprefix([text, history]))
    if shared == len(text):
        return len(ids) - 1
    rest = [int(i) for i in tokenizer_of(processor)(text[shared:], add_special_tokens=False)["input_ids"]]
    if not rest or len(rest) >= len(ids) or ids[-len(rest):] != rest:
        return None
    return len(ids) - len(rest)


def _next_history(processor: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                  template_kwargs: Mapping[str, Any] | None, videos: bool) -> str | None:
    """The history as the next turn likely renders it: a call and its result after a tool's result (a
    template that refuses those placeholders: a reply and a question), else a reply and a question."""
    turns = [NEXT_CALL, NEXT_TURN] if messages and messages[-1]["role"] == "tool" else [NEXT_TURN]
    for turn in turns:
        try:
            return render_chat(processor, [*messages, *turn], tools, False, template_kwargs, videos)
        except PromptError:
            continue
    return None


def _without_doubled_bos(tokenizer: Any, text: str) -> str:
    """A template that writes BOS, for a tokenizer that adds one too (Gemma, Llama): keep one."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None or not text.startswith(bos):
        return text
    adds_bos = tokenizer("a")["input_ids"][:1] == [bos_id]
    return text[len(bos):] if adds_bos else text


def build_prompt(
    processor: Any,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Image.Image] = (),
    tools: Sequence[dict[str, Any]] | None = None,
    template: TemplateInfo = TemplateInfo(),
    instructions: str = "",
    request_id: str = "-",
    control: ControlTokens = ControlTokens(),
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    image_kwargs: Mapping[str, int] | None = None,
    videos: Sequence[Video] = (),
    video_frames: bool = False,
    hints: CacheHints = CacheHints(),
    audio: Sequence[np.ndarray] = (),
) -> PromptInputs:
    """Phase 1 for one request: template, tokenize, preprocess images, videos and audio; logs when slow.

    ``instructions`` (e.g. "answer in JSON") join the system message, wherever this template keeps it.
    With ``video_frames``, a video goes as its frames, each an image (``frames_as_images``); ``hints``
    say what the engine's prefix caches need besides.
    """
    start = time.perf_counter()
    for kind, given in (("image", len(images)), ("video", len(videos)), ("audio", len(audio))):
        count = sum(_count_parts(m, kind) for m in messages)
        if count != given:
            raise PromptError(f"{count} {kind} parts in the messages but {given} {kind}s given")
    if videos and video_frames:
        messages, images, videos = *frames_as_images(messages, images, videos), ()
    refused = control.refusal(messages, tools, instructions)
    if refused is not None:
        raise PromptError(refused)
    messages, tools = adapt_messages(messages, tools, template, instructions)
    text = render_chat(processor, messages, tools, add_generation_prompt, template_kwargs, bool(videos))
    try:
        prompt = encode(processor, text, images, image_kwargs, videos, hints.picture_keys, audio)
    except Exception as exc:  # noqa: BLE001 - e.g. image tokens typed into the text: the input's fault
        raise PromptError(f"could not process the prompt: {type(exc).__name__}: {exc}") from exc
    if hints.stems and add_generation_prompt:
        prompt = replace(prompt, stem=_stem(processor, messages, tools, template_kwargs, bool(videos), prompt.input_ids,
                                            text))
    if videos and "pixel_values_videos" not in prompt.arrays:
        raise PromptError("the chat template wrote no video placeholder for the video")
    if audio and "input_features" not in prompt.arrays:  # mlx-vlm #903: a processor without its extractor
        raise PromptError("the processor made no audio features (no feature extractor)")
    elapsed = time.perf_counter() - start
    if elapsed > SLOW_PREPROCESS_S:
        log.warning("slow preprocessing: request %s, %d tokens, %.2f s", request_id, len(prompt), elapsed)
    return prompt


@dataclass(slots=True, frozen=True)
class PromptBuilder:
    """One model's phase 1: its processor, and what its chat template needs (probed once).

    Hugging Face processors and tokenizers are not documented as thread-safe (transformers #47085;
    mlx-vlm serializes its preprocessing with a lock). Each ``build`` borrows a private copy of the
    processor and gives it back: pool threads never share one, and none waits on a lock while
    another tokenizes a long prompt. ``processor`` itself is only read (its template, its tokens).
    """

    processor: Any
    template: TemplateInfo = TemplateInfo()
    control: ControlTokens = ControlTokens()
    image_limit: ProcessorLimit | None = None  # what its processor keeps of an image: decoding stops there
    media_token_ids: frozenset[int] = frozenset()  # image, video and audio placeholders: only phase 1 writes them
    video_sampling: VideoSampling | None = None  # the frames its video processor asks for; None: it takes no video
    video_frames: bool = False  # a video goes as its frames, each an image (SmolVLM2: no video processor)
    hints: CacheHints = CacheHints()
    audio_rate: int | None = None  # the sampling rate its feature extractor takes clips at; None: it has none
    # Copies, not a lock (measured): a copy is 1-6 ms here, ~0.6 s and 24 MiB for a 200k vocabulary, once at start-up;
    # one lock made 4 threads' image prompts 1.45x slower (2 cores) and a decode wait ~0.5 s behind 140k-token ones.
    spares: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue, compare=False, repr=False)
    reasoning_probes: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def for_processor(cls, processor: Any, copies: int = 0, hints: CacheHints = CacheHints(),
                      limit: ProcessorLimit | None = None, video_as_frames: bool = True) -> PromptBuilder:
        """The builder, with ``copies`` processor copies made now (one per pool thread: a copy of a
        large vocabulary's tokenizer is worth making before the first request, not during it).
        ``limit``: what the processor keeps of an image, the model adapter's fact (None: decoded whole);
        ``video_as_frames``: whether a video may go as its frames where the processor has no video processor
        (the adapter's fact: else such a processor takes no video)."""
        # A video token but no video processor: SmolVLM2, which was trained on videos as time-stamped frames
        video_token = isinstance(getattr(processor, "video_token", None), str)
        frames = video_token and getattr(processor, "video_processor", None) is None
        takes_video = video_token and (video_as_frames or not frames)
        builder = cls(processor, inspect_template(templater_of(processor)),
                      ControlTokens.of(processor, tokenizer_of(processor)), limit,
                      media_token_ids(processor), processor_sampling(processor) if takes_video else None,
                      frames and takes_video, hints, _audio_rate(processor))
        for _ in range(copies):
            builder.spares.put(copy.deepcopy(processor))
        return builder

    def build(self, messages: Sequence[dict[str, Any]], images: Sequence[Image.Image] = (),
              tools: Sequence[dict[str, Any]] | None = None, instructions: str = "",
              request_id: str = "-", add_generation_prompt: bool = True,
              template_kwargs: Mapping[str, Any] | None = None,
              image_kwargs: Mapping[str, int] | None = None, videos: Sequence[Video] = (),
              audio: Sequence[np.ndarray] = ()) -> PromptInputs:
        with self._borrowed() as processor:
            return build_prompt(processor, messages, images, tools, self.template, instructions, request_id,
                                self.control, add_generation_prompt, template_kwargs, image_kwargs, videos,
                                self.video_frames, self.hints, audio)

    def opens_reasoning_with(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether a prompt rendered with these template variables ends inside ``<think>``: a probe
        conversation rendered once per set of variables."""
        if not template_kwargs:
            return self.template.opens_reasoning
        key = json.dumps(template_kwargs, sort_keys=True, default=str)
        opens = self.reasoning_probes.get(key)
        if opens is None:
            try:
                probe = render_chat(self.processor, [{"role": "user", "content": "hi"}], None, True, template_kwargs)
            except PromptError:
                probe = ""  # the request's own render will say what is wrong
            if len(self.reasoning_probes) >= REASONING_PROBES:
                self.reasoning_probes.clear()  # clients choose the variables: keep a few sets, not all
            opens = self.reasoning_probes[key] = probe.rstrip().endswith("<think>")
        return opens

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A plain text's token ids, as the model's tokenizer gives them (no template)."""
        with self._borrowed() as processor:
            return [int(i) for i in tokenizer_of(processor)(text, add_special_tokens=add_special_tokens)["input_ids"]]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        with self._borrowed() as processor:
            text: str = tokenizer_of(processor).decode(list(token_ids))
            return text

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token as the vocabulary writes it (vLLM's ``token_strs``)."""
        with self._borrowed() as processor:
            return [str(t) for t in tokenizer_of(processor).convert_ids_to_tokens(list(token_ids))]

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's class and configuration (its special tokens as
        text) and the chat template requests are rendered with (lm-eval's remote tokenizer reads them)."""
        with self._borrowed() as processor:
            tokenizer = tokenizer_of(processor)
            info = {k: plain for k, v in tokenizer.init_kwargs.items()
                    if k not in _LOCAL and (plain := _plain(v)) is not None}
            for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
                info[name] = getattr(tokenizer, name, None)
            info["model_max_length"] = _plain(getattr(tokenizer, "model_max_length", None))
            info["tokenizer_class"] = type(tokenizer).__name__
            info["chat_template"] = getattr(templater_of(processor), "chat_template", None)
            return info

    @contextmanager
    def _borrowed(self) -> Iterator[Any]:
        """A private copy of the processor for the body, given back after."""
        try:
            processor = self.spares.get_nowait()
        except queue.Empty:  # more threads than copies: one more, kept for later
            processor = copy.deepcopy(self.processor)
        try:
            yield processor
        finally:
            self.spares.put(processor)


def _audio_rate(processor: Any) -> int | None:
    """The sampling rate of the processor's audio feature extractor (mlx-vlm #903: a conversion lacking it
    drops audio silently), where it has one and an audio placeholder to expand."""
    extractor = getattr(processor, "feature_extractor", None)
    rate = getattr(extractor, "sampling_rate", None)
    return int(rate) if isinstance(rate, int) and isinstance(getattr(processor, "audio_token", None), str) else None


def media_token_ids(processor: Any) -> frozenset[int]:
    """The ids of the processor's image, video and audio placeholder tokens (those it has)."""
    tokenizer, found = tokenizer_of(processor), set()
    for owner in (processor, tokenizer):
        for name in ("image_token", "video_token", "audio_token"):
            token = getattr(owner, name, None)
            token_id = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
            if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
                found.add(token_id)
            given = getattr(owner, f"{name}_id", None)
            if isinstance(given, int):
                found.add(given)
    return frozenset(found)


# SmolVLM2's video prompt, as transformers' SmolVLMProcessor writes it (DEFAULT_VIDEO_INTRO and the rest:
# the frame count in words, the length as H:MM:SS, each frame's time as MM:SS)
VIDEO_INTRO = "You are provided the following series of {count} frames from a {duration} [H:MM:SS] video.\n"
FRAME_STAMP = "\nFrame from {stamp}:"
VIDEO_OUTRO = "\n\n"


def frames_as_images(messages: Sequence[dict[str, Any]], images: Sequence[Image.Image],
                     videos: Sequence[Video]) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """Each video part as the text SmolVLM2 was trained on (an intro with the clip's length, then each
    frame's time stamp and the frame as an image part), its frames joining the images in prompt order."""
    pictures, clips = iter(images), iter(videos)
    ordered: list[Image.Image] = []
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            if part.get("type") == "image":
                ordered.append(next(pictures))
                parts.append(part)
            elif part.get("type") == "video":
                clip = next(clips)
                length = timedelta(seconds=int(clip.source_frames / clip.source_fps))
                parts.append({"type": "text", "text": VIDEO_INTRO.format(count=_words(len(clip.indices)),
                                                                         duration=length)})
                for index, frame in zip(clip.indices, clip.frames):
                    minutes, seconds = divmod(int(index / clip.source_fps), 60)
                    parts.append({"type": "text", "text": FRAME_STAMP.format(stamp=f"{minutes:02d}:{seconds:02d}")})
                    parts.append({"type": "image"})
                    ordered.append(Image.fromarray(np.ascontiguousarray(frame.transpose(1, 2, 0))))
                parts.append({"type": "text", "text": VIDEO_OUTRO})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, ordered


_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def _words(n: int) -> str:
    """``n`` (0 to 9999) in English words, as ``num2words`` writes them: 32 is "thirty-two", 105 "one
    hundred and five"."""
    if n >= 1000:
        rest = n % 1000
        return f"{_words(n // 1000)} thousand" + ("" if not rest else f" and {_words(rest)}" if rest < 100
                                                  else f", {_words(rest)}")
    if n >= 100:
        rest = n % 100
        return f"{_ONES[n // 100]} hundred" + (f" and {_words(rest)}" if rest else "")
    if n >= 20:
        return _TENS[n // 10 - 2] + (f"-{_ONES[n % 10]}" if n % 10 else "")
    return _ONES[n]


def _count_parts(message: dict[str, Any], kind: str) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and part.get("type") == kind)


def _to_host(value: Any) -> HostArray | None:
    """A processor output as numpy: an array, a tuple of arrays (one per image, where their shapes
    differ: Gemma 4), or None for what the model does not take (strings, nested metadata)."""
    # Some mlx-vlm processors (Gemma 4) return mx.arrays built from host data: no graph,
    # no stream, so reading them back to numpy here is safe on any thread.
    if value is None or isinstance(value, (str, bytes)):
        return None
    if isinstance(value, (list, tuple)) and value and hasattr(value[0], "shape") and len(value[0].shape) > 0:
        return tuple(np.asarray(v) for v in value)
    if isinstance(value, list) and value and not isinstance(value[0], (int, float, list)):
        return None
    return np.asarray(value)


_LOCAL = frozenset({"name_or_path", "is_local", "local_files_only"})  # where the server keeps its files: not said


def _plain(value: Any) -> Any:
    """A tokenizer setting as JSON (an added token as its text); None where it has no JSON form."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) and abs(value) < 2**53 else None  # transformers' "no limit" is 1e30
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): v for k, item in value.items() if (v := _plain(item)) is not None}
    if isinstance(value, (list, tuple)):
        return [v for item in value if (v := _plain(item)) is not None]
    return None
