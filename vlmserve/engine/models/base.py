"""[worker] The default model adapter: what most mlx-vlm families share.

An adapter is the one place that knows how a family's mlx-vlm model wants to be called:
which cache it needs, how a prompt becomes embeddings, which per-request state decode
needs on every step, whether an image prompt may be prefilled in chunks, and which
tool-call format the family speaks when its chat template does not say.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache
from mlx_vlm.generate.ar import (
    _is_sequence_aligned_prompt_kwarg,
    _make_cache,
    _merge_prefill_prompt_kwargs,
    _slice_sequence_aligned_prompt_kwarg,
    _split_prompt_kwargs_per_row,
    _unpad_batch_prompts,
)
from mlx_vlm.models.cache import make_prompt_cache
from mlx_vlm.speculative.cache_state import commit_speculative_round
from mlx_vlm.speculative.common import verify_forward

from vlmserve.engine.kv_quant import KVQuant
from vlmserve.inputs import AUDIO_KEYS, ImageItem, PromptInputs
from vlmserve.preprocess.image_sizes import ProcessorLimit, limit_of, sized_limit

PIXEL_KEYS = ("pixel_values", "pixel_values_videos")  # what the vision tower reads; never language-model keywords
# What only the vision tower reads besides: never a language-model keyword either. SmolVLM's mask is
# [1, images, H, W]: kept, it failed the left-padded batch of prompts with different image counts.
VISION_ONLY_KEYS = (*PIXEL_KEYS, "pixel_attention_mask", *AUDIO_KEYS)  # and what only the audio tower reads


@dataclass(slots=True)
class Embedded:
    """One prompt after the vision tower: embeddings, prefill keywords, per-row decode state.

    ``lm_kwargs`` are whole-prompt arrays the language model slices per chunk by its cache
    offset (``position_ids``, ``per_layer_inputs``...). ``row_state`` holds ``[1, ...]`` arrays
    the model needs on every decode step; the decode batch stacks them row by row.
    """

    inputs_embeds: mx.array
    lm_kwargs: dict[str, Any] = field(default_factory=dict)
    row_state: dict[str, mx.array] = field(default_factory=dict)


class ModelAdapter:
    """The default: ``get_input_embeddings`` then the language model, causal image tokens."""

    model_types: ClassVar[tuple[str, ...]] = ()
    # Is the family tested here (parity, batching, caches)? Not for a model_type no adapter names.
    tested: ClassVar[bool] = True
    # May an image prompt be prefilled over several steps? Only if its image tokens attend causally.
    chunk_images: ClassVar[bool] = True
    # The family's tool-call format when its chat template does not reveal one.
    tool_format: ClassVar[str | None] = "hermes"
    # Images one prompt may carry; None: no limit of the family's own.
    max_images: ClassVar[int | None] = None
    # May a cached text prefix's KV serve a longer prompt? Not where earlier tokens attend to later ones.
    reuses_prefix: ClassVar[bool] = True
    # May whole prompts that start in one step prefill together, left-padded into one forward?
    batch_prefill: ClassVar[bool] = True
    # May image prompts admitted in one step be embedded together (one vision forward for all
    # their images)? Only where mlx-vlm's get_input_embeddings takes a padded batch (tested).
    batch_embed: ClassVar[bool] = False
    # May one image's vision features be computed alone (``encode_image``) and handed to mlx-vlm's
    # ``get_input_embeddings`` as ``cached_image_features`` (``join_features``)? Then the vision
    # cache keeps them across requests (engine/vision_cache.py).
    vision_cache: ClassVar[bool] = False
    # May one audio clip's features be computed alone (``encode_clip``) and handed to ``embed`` as
    # ``cached_audio_features``? Then the vision cache keeps them too, keyed by the clip's samples.
    encodes_clips: ClassVar[bool] = False
    # May one prompt carry images and videos together? Not where mlx-vlm's merge takes one kind.
    mixes_media: ClassVar[bool] = True
    # May a video go as its frames, each an image, where the processor has a video token but no video
    # processor (SmolVLM2 was trained so)? Not for a family whose own video layout is another (GLM's).
    video_as_frames: ClassVar[bool] = True
    # Does a decoder layer return a tuple (hidden state first), not the hidden state alone? (Gemma 4's
    # return their KV and offset, for the layers that share it.) A pipeline rank's stand-ins must match.
    layer_returns_tuple: ClassVar[bool] = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.language_model = model.language_model
        # Can a cache be cut back to a shorter prefix? Not recurrent or convolution state (Qwen3.5,
        # LFM2-VL): a cached prefix must then be a snapshot taken at exactly the position it ends at.
        self.trims_cache = bool(can_trim_prompt_cache(self.make_cache()))
        # Tokens inside an image's placeholder span besides its image token (set by the loader from the
        # processor: Pixtral's row breaks), so that a span is one run however it is laid out
        self.span_token_ids: frozenset[int] = frozenset()
        # Quantized KV (--kv-bits; engine/kv_quant.py), set by the loader where the family allows it
        self.kv_quant: KVQuant | None = None
        # While a drafter reads the target's hidden states (engine/mtp.py, engine/dflash.py): each forward's, in order
        self.hidden_sink: list[mx.array] | None = None
        # ...of these decoder layers, side by side (DFlash's ``target_layer_ids``); None: the final, normed state
        self.hidden_layers: tuple[int, ...] | None = None

    @property
    def mm_prefix_exact(self) -> bool:
        """Does a restored prefix of an image prompt (the opt-in image-keyed cache) continue exactly as
        a whole prefill would? Only where tested (``tests/test_engine_mm_prefix.py``): off by default."""
        return False

    @property
    def text_prefix_exact(self) -> bool:
        """Does a prompt with images continue exactly from a restored prefix that ends before its first image
        (the text store's, ``caches.text_for_images``)? Where an image prefix does; only where tested
        (``tests/test_engine_text_before_image.py``)."""
        return self.mm_prefix_exact

    @property
    def packs_kv(self) -> str | None:
        """Why this family's KV cannot be quantized (``--kv-bits``), or None where it can: its attention
        must read a packed cache through mlx-vlm's quantized attention."""
        return None

    @property
    def verifies_drafts(self) -> bool:
        """May decode verify a draft: several positions per row in one forward, then each row's cache cut
        back to what it accepted (mlx-vlm's speculative cache transaction)? Tested per family."""
        return True

    @property
    def exact_verifier(self) -> bool:
        """Does the language model verify drafts with its own exact verifier (``speculative_verify``)?
        Qwen3.5 and LFM2-VL do: it records their recurrent and convolution states at each position, so a
        row's state after its last accepted token can be kept (``rollback_speculative_cache``). By default:
        where the language model has ``speculative_verify_logits`` (Qwen3.5's); LFM2-VL's adapter says so."""
        return callable(getattr(self.language_model, "speculative_verify_logits", None))

    @property
    def mm_prefix_limit(self) -> int | None:
        """The longest image prompt whose prefix may be reused (None: any); sliding-window layers keep
        only their window, so beyond it a restored prefix is not what a whole prefill computes."""
        window = getattr(getattr(self.model.config, "text_config", None), "sliding_window", None)
        return int(window) if isinstance(window, int) else None

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        """How much of an image the family's processor keeps, so that decoding may stop there (None:
        decoded whole). Read from the processor alone, before any model: by default its size fields."""
        return limit_of(processor, sized_limit)

    @property
    def decoder(self) -> Any | None:
        """The language model's decoder, whose ``layers`` a pipeline stage splits: ``language_model.model``,
        or the language model itself where it holds them; None where neither does."""
        for inner in (getattr(self.language_model, "model", None), self.language_model):
            if isinstance(getattr(inner, "layers", None), list):
                return inner
        return None

    def media_token_ids(self) -> frozenset[int]:
        """The image (and video) placeholder token ids the model's config names, and the tokens its
        processor puts inside a span (``span_token_ids``)."""
        config = self.model.config
        ids = {getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")}
        return frozenset(i for i in ids if isinstance(i, int)) | self.span_token_ids

    def last_run_marks(self, processor: Any) -> frozenset[int]:
        """Tokens right before an image's last run of placeholders, where an image's span holds several runs
        with text between them (SmolVLM's tiles, rows broken by newlines): the image-keyed store's key
        pairs them all with the one image. Empty: each run is one image."""
        return frozenset()

    def make_cache(self) -> list[Any]:
        """One request's KV cache (mlx-vlm's fallback where the model has no ``make_cache``)."""
        return make_prompt_cache(self.language_model)

    def can_batch(self, prompt: PromptInputs) -> bool:
        return self.batch_prefill

    def can_chunk(self, prompt: PromptInputs) -> bool:
        if getattr(self.model, "no_chunked_prefill", False) or getattr(self.language_model, "no_chunked_prefill", False):
            return False
        return self.chunk_images or not prompt.has_images

    def text_tail(self, prompt: PromptInputs) -> int | None:
        """Where a prompt that cannot be split by tokens may be, after a reused prefix reaching this far:
        past its last media token, where only causal text is left (None: nowhere). Off by default."""
        return None

    def embed(self, input_ids: mx.array, arrays: dict[str, Any], cached: dict[str, mx.array] | None = None) -> Embedded:
        """The vision tower and the merge, as mlx-vlm's ``generate_step`` calls them; with ``cached``
        (``join_features``'s keywords) the tower is skipped."""
        arrays = dict(arrays)
        pixel_values = arrays.pop("pixel_values", None)
        videos = {k: arrays.pop(k) for k in PIXEL_KEYS[1:] if k in arrays}
        mask = mx.ones(input_ids.shape, dtype=mx.int32)  # one unpadded row, like the processor's
        features = self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **arrays, **videos,
                                                   **(cached or {}))
        extra = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
        text = {k: v for k, v in arrays.items() if k not in VISION_ONLY_KEYS}
        return Embedded(features.inputs_embeds, {**text, **extra}, self.row_state(extra))

    def embed_rows(self, input_ids: list[mx.array], arrays: list[dict[str, mx.array]]) -> list[Embedded]:
        """Several image prompts through one ``get_input_embeddings`` call (one vision forward for all
        their images), left-padded, then cut back into one ``Embedded`` per prompt."""
        lengths = [i.shape[1] for i in input_ids]
        longest = max(lengths)
        ids = mx.concatenate([mx.pad(i, [(0, 0), (longest - i.shape[1], 0)]) for i in input_ids])
        mask = mx.array([[0] * (longest - n) + [1] * n for n in lengths], dtype=mx.int32)
        merged = {k: _stack_rows([a[k] for a in arrays], lengths, longest) for k in arrays[0]}
        pixel_values = merged.pop("pixel_values", None)
        features = self.model.get_input_embeddings(ids, pixel_values, mask=mask, **merged)
        rows = _split_prompt_kwargs_per_row({k: v for k, v in features.to_dict().items() if v is not None}, len(lengths))
        _, rows = _unpad_batch_prompts(ids, mask, rows)
        out = []
        for row, own in zip(rows, arrays):
            extra = {k: v for k, v in row.items() if k != "inputs_embeds"}
            own = {k: v for k, v in own.items() if k not in VISION_ONLY_KEYS}
            out.append(Embedded(row["inputs_embeds"], {**own, **extra}, self.row_state(extra)))
        return out

    def encode_image(self, arrays: dict[str, mx.array]) -> mx.array:
        """One image's (or video's) features in the language model's space (vision tower and projector)."""
        raise NotImplementedError(f"{type(self).__name__} has no vision cache")

    def encode_clip(self, arrays: dict[str, mx.array]) -> mx.array:
        """One audio clip's features in the language model's space, its valid frames only ``[1, frames, hidden]``."""
        raise NotImplementedError(f"{type(self).__name__} encodes no clip alone")

    def join_features(self, items: tuple[ImageItem, ...], features: list[mx.array]) -> dict[str, mx.array]:
        """The prompt's images' features (``items``' order), as ``get_input_embeddings``' keywords."""
        return {"cached_image_features": mx.concatenate(features, axis=0)}

    def row_state(self, features: dict[str, Any]) -> dict[str, mx.array]:
        """Per-request state decode needs on every step; none by default."""
        return {}

    def prefill(self, input_ids: mx.array, embedded: Embedded, start: int, end: int, cache: list[Any],
                every_position: bool = False) -> mx.array:
        """Run prompt tokens ``[start, end)`` into ``cache``; returns the last position's logits
        ``[1, vocab]``, or with ``every_position`` each position's ``[end - start, vocab]``."""
        # Gemma 4 computes the head for the last position only with logits_to_keep=1; others ignore it
        keep = {} if every_position else {"logits_to_keep": 1}
        out = self._forward(
            input_ids[:, start:end],
            inputs_embeds=embedded.inputs_embeds[:, start:end],
            cache=cache,
            **keep,
            **embedded.lm_kwargs,
        )
        self.settle(cache)
        logits: mx.array = out.logits[0] if every_position else out.logits[:, -1, :]
        return logits

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """The language model's forward; while ``hidden_sink`` is a list, its final hidden states ``[B, L, H]``
        go there, as mlx-vlm hands them to its own MTP drafter (``return_hidden``: the text model's output,
        whichever way it ran: Qwen3.5's runs each row of a left-padded batch on its own, its norm once per row)."""
        if self.hidden_sink is None:
            return self.language_model(*args, **kwargs)
        if self.hidden_layers is not None:
            if kwargs.get("speculative_verify"):  # the family's exact verifier runs no layer module: it records them
                out = self.language_model(*args, capture_layer_ids=list(self.hidden_layers), **kwargs)
                self.hidden_sink.append(mx.concatenate(out.hidden_states[:len(self.hidden_layers)], axis=-1))
                return out
            with self.layers_recorded(args[0].shape, kwargs.get("cache")):
                return self.language_model(*args, **kwargs)
        out = self.language_model(*args, return_hidden=True, **kwargs)
        self.hidden_sink.append(out.hidden_states[-1])
        return out

    @contextmanager
    def layers_recorded(self, shape: tuple[int, ...], cache: list[Any] | None) -> Iterator[None]:
        """While open, one forward of ``shape`` (``[B, L]``) records the outputs of ``hidden_layers``, side by side
        ``[B, L, layers * H]``, into ``hidden_sink``. Taps on the layers, not mlx-vlm's ``capture_layer_ids``, so that
        the forward takes the path it takes without a drafter (Qwen3.5's runs a left-padded batch row by row,
        unless asked to capture: then it runs it whole, another computation)."""
        assert self.hidden_layers is not None and self.hidden_sink is not None and self.decoder is not None
        decoder, wanted = self.decoder, sorted(self.hidden_layers)  # mlx-vlm captures in the layers' order
        offset = next((c.offset for c in cache or () if isinstance(getattr(c, "offset", None), mx.array)
                       and c.offset.ndim == 1), None)  # a batch cache's, before the forward moves it
        layers = decoder.layers
        taps = {i: _LayerTap(layers[i], None, capture=True, every=True) for i in wanted}
        decoder.layers = [taps.get(i, layer) for i, layer in enumerate(layers)]
        try:
            yield
        finally:
            decoder.layers = layers
        self.hidden_sink.append(mx.concatenate([_by_row(taps[i].outputs, shape, offset) for i in wanted], axis=-1))

    def settle(self, cache: list[Any]) -> None:
        """After a forward: with quantized KV on, pack each layer that now holds enough positions."""
        if self.kv_quant is not None:
            self.kv_quant.settle(cache)

    def prefill_rows(self, input_ids: list[mx.array], embedded: list[Embedded],
                     split_last: bool) -> tuple[mx.array, list[Any]]:
        """Whole prompts in one left-padded forward into a new batch cache (mlx-vlm's own merging of
        per-row keywords); returns the last positions' logits ``[B, vocab]`` and the cache.

        ``split_last``: the last column in a forward of its own, so the head runs for it alone.
        """
        lengths = [e.inputs_embeds.shape[1] for e in embedded]
        longest = max(lengths)
        rows: list[dict[Any, Any] | None] = [{"inputs_embeds": e.inputs_embeds, **e.lm_kwargs} for e in embedded]
        embeds, kwargs = _merge_prefill_prompt_kwargs(rows, [[0] * n for n in lengths])
        ids = mx.concatenate([mx.pad(i, [(0, 0), (longest - i.shape[1], 0)]) for i in input_ids])
        # mlx-vlm leaves _make_cache unannotated
        cache = _make_cache(self.language_model, [longest - n for n in lengths])  # type: ignore[no-untyped-call]
        start = 0
        if split_last and longest > 1:
            self._forward_columns(ids, embeds, kwargs, cache, 0, longest - 1)
            start = longest - 1
        return self._forward_columns(ids, embeds, kwargs, cache, start, longest), cache

    @property
    def num_layers(self) -> int:
        """The language model's decoder layers: the pieces a prompt split by layers can go in."""
        layers = getattr(getattr(self.language_model, "model", None), "layers", None)
        return len(layers) if isinstance(layers, list) and layers else 1

    def layer_starts(self) -> tuple[int, ...] | None:
        """Layers a piece may start at (None: any). A layer that reads another's KV within the
        forward (Gemma 4's shared KV) must run in the same piece as it."""
        return None

    def prefill_layers(self, input_ids: mx.array, embedded: Embedded, cache: list[Any], first: int, last: int,
                       hidden: mx.array | None) -> tuple[mx.array, mx.array]:
        """The whole prompt through layers ``[first, last)`` only, from ``hidden`` (the state after
        layer ``first - 1``); returns the logits (meaningful when ``last`` is the last layer) and the
        state after layer ``last - 1``.

        mlx-vlm's own forward runs, so masks, scaling and per-layer inputs are what a whole prefill
        makes; the layers outside the piece write to throwaway caches, and since nothing evaluated
        depends on them, MLX never computes them. The piece's first layer takes ``hidden`` instead
        of its input. Same operations on the same values: the KV equals a whole prefill's, bitwise.
        """
        assert all(getattr(c, "offset", 0) == 0 for c in cache[first:last]), "a prompt split by layers starts at 0"
        text_model = self.language_model.model
        scratch = self.make_cache()
        # One cache per layer that keeps KV: fewer than the layers where later ones read earlier ones' (Gemma 4's
        # shared KV); the model gives those none
        caches = [cache[i] if first <= i < last else scratch[i] for i in range(len(cache))]
        with tapped(text_model, "layers", first, last, hidden) as exit_tap:
            logits = self.prefill(input_ids, embedded, 0, input_ids.shape[1], caches)
        self.settle(cache)  # the piece's layers are filled now (``prefill`` settled its own list)
        assert exit_tap.output is not None
        return logits, exit_tap.output

    def vision_blocks(self) -> tuple[Any, str] | None:
        """The vision tower's block list, as (its owner, the attribute), where one image may be encoded
        a few blocks a step (the same tap as ``prefill_layers``); None where the tower is not split:
        a family whose merge reads blocks' outputs other than the last (DeepStack, LLaVA's
        ``vision_feature_layer``) would read blocks a piece never evaluated."""
        return None

    @property
    def num_vision_blocks(self) -> int:
        blocks = self.vision_blocks()
        return len(getattr(blocks[0], blocks[1])) if blocks is not None else 0

    def _forward_columns(self, ids: mx.array, embeds: mx.array, kwargs: dict[str, Any], cache: list[Any],
                         start: int, end: int) -> mx.array:
        width = embeds.shape[1]
        window = {k: _slice_sequence_aligned_prompt_kwarg(k, v, start, end)
                  if isinstance(v, mx.array) and _is_sequence_aligned_prompt_kwarg(k, v, width) else v
                  for k, v in kwargs.items()}
        out = self._forward(ids[:, start:end], inputs_embeds=embeds[:, start:end], cache=cache, logits_to_keep=1,
                            **window)
        self.settle(cache)
        logits: mx.array = out.logits[:, -1, :]
        return logits

    def decode(self, tokens: mx.array, cache: list[Any], row_state: dict[str, mx.array]) -> mx.array:
        """One token per batch row (``tokens``: ``[B, 1]``); returns logits ``[B, vocab]``."""
        out = self._forward(tokens, cache=cache, **row_state)
        logits: mx.array = out.logits[:, -1, :]
        return logits

    def verify(self, tokens: mx.array, cache: list[Any], row_state: dict[str, mx.array]) -> tuple[mx.array, Any]:
        """Every row's input and draft (``tokens``: ``[B, W]``) in one forward inside mlx-vlm's
        speculative cache transaction; returns each position's logits ``[B, W, vocab]`` and the
        transaction, for ``commit``."""
        lm = self.language_model
        if self.exact_verifier:  # the family's own exact verifier (Qwen3.5's, LFM2's): recurrent state kept
            out = self._forward(tokens, cache=cache, speculative_verify=True, **row_state)
            transaction = out.gdn_states
        elif self.hidden_sink is not None and self.hidden_layers is not None:  # a DFlash drafter reads its layers
            with self.layers_recorded(tokens.shape, cache):
                out, transaction = verify_forward(lm, tokens, cache, **row_state)  # type: ignore[no-untyped-call]
        else:
            out, transaction = verify_forward(lm, tokens, cache, **row_state)  # type: ignore[no-untyped-call]
        logits: mx.array = out.logits
        return logits, transaction

    def commit(self, transaction: Any, cache: list[Any], accepted: list[int], width: int) -> None:
        """Keep each row's input and its first ``accepted[row]`` draft positions of a ``width``-wide
        verify, in every cache (trimmed, rolled back, or its recorded states picked)."""
        commit_speculative_round(self.language_model, cache, transaction, accepted, width)  # type: ignore[no-untyped-call]


def _stack_rows(values: list[mx.array], lengths: list[int], longest: int) -> mx.array:
    """One processor array for a padded batch: per-token ones ``[1, L]`` left-padded, per-image ones concatenated."""
    if all(v.ndim == 2 and v.shape == (1, n) for v, n in zip(values, lengths)):
        return mx.concatenate([mx.pad(v, [(0, 0), (longest - v.shape[1], 0)]) for v in values])
    return mx.concatenate(values)


@contextmanager
def tapped(owner: Any, attr: str, first: int, last: int, hidden: mx.array | None) -> Iterator[_LayerTap]:
    """While open, the blocks ``owner.<attr>[first:last]`` run as one piece of a forward: block
    ``first`` takes ``hidden`` (the state after block ``first - 1``) instead of its input, and the
    yielded tap keeps block ``last - 1``'s output. Blocks outside the piece still build their part
    of MLX's lazy graph, but nothing evaluated depends on it, so it never runs."""
    blocks = getattr(owner, attr)
    assert (hidden is not None) == (first > 0) and 0 <= first < last <= len(blocks)
    exit_tap = _LayerTap(blocks[last - 1], hidden if first == last - 1 else None, capture=True)
    taps = list(blocks)
    taps[last - 1] = exit_tap
    if first < last - 1 and hidden is not None:
        taps[first] = _LayerTap(blocks[first], hidden, capture=False)
    setattr(owner, attr, taps)
    try:
        yield exit_tap
    finally:
        setattr(owner, attr, blocks)


class _LayerTap:
    """Stands in for one decoder layer during a layer piece: feeds it the carried hidden state
    and/or keeps what it returns (``every``: each call's, in ``outputs``). Everything else
    (``layer_type``...) reads through to the layer."""

    def __init__(self, layer: Any, hidden: mx.array | None, capture: bool, every: bool = False) -> None:
        self.__dict__.update(layer=layer, hidden=hidden, capture=capture, output=None, outputs=[] if every else None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["layer"], name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(self.hidden if self.hidden is not None else h, *args, **kwargs)
        if self.capture:
            self.__dict__["output"] = out[0] if isinstance(out, tuple) else out
            if self.outputs is not None:
                self.outputs.append(self.output)
        return out


def _by_row(outputs: list[mx.array], shape: tuple[int, ...], offset: mx.array | None) -> mx.array:
    """A tapped layer's output for a ``[B, L]`` forward: its one call's, or, where the model ran a left-padded
    batch row by row (Qwen3.5), each row's call left-padded back to ``L``. A row is all padding where its
    cache ``offset`` is ``-L`` or less (it had no call: zeros, as mlx-vlm gives it)."""
    rows, width = shape[0], shape[1]
    if len(outputs) == 1 and outputs[0].shape[0] == rows:
        return outputs[0]
    assert offset is not None and all(o.shape[0] == 1 for o in outputs), [o.shape for o in outputs]
    pads = [min(max(-p, 0), width) for p in cast(list[int], offset.tolist())]
    calls, like = iter(outputs), outputs[0]
    parts = [mx.zeros((1, width, like.shape[-1]), like.dtype) if pad == width else next(calls) for pad in pads]
    assert next(calls, None) is None and all(p.shape[1] == width - pad for p, pad in zip(parts, pads) if pad < width)
    return mx.concatenate([mx.pad(p, [(0, 0), (width - p.shape[1], 0), (0, 0)]) for p in parts])
