"""[any] Training chats -> token ids, answer positions and padded batches, built as inference does.

Every prompt comes from ``vlmserve.preprocess.prompt.build_prompt``: the same chat template,
tokenizer call and image processor the server uses, so the model learns exactly the inputs it
will be served. A chat of several turns is encoded once, in full; each turn's prompt must be a
prefix of the next (checked), and every answer token of every turn is a target.

Examples of similar length share a batch (sorted within a pool of batches), since padding all
to one length multiplied the tokens in an early experiment.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from vlmserve.preprocess.prompt import build_prompt, tokenizer_of
from vlmserve.testing.demo.dialogues import END_OF_TURN, TOOL_HANDOVER, Chat, sample_chat

POOL_BATCHES = 16  # batches sorted by length together


@dataclass(frozen=True, slots=True)
class Encoded:
    """One chat as the model sees it: its tokens, which of them are learned, its image."""

    input_ids: list[int]
    targets: list[int]  # indices into input_ids of answer tokens
    weights: list[float]  # per target: each answer (turn) shares 1, so a "Yes." weighs as much as a caption
    pixel_values: np.ndarray | None = None  # [1, 3, H, W]
    mm_token_type_ids: np.ndarray | None = None  # [len(input_ids)]; 0 = text, so causal


@dataclass(frozen=True, slots=True)
class HostBatch:
    """A padded batch in numpy; ``train.py`` turns it into MLX arrays on its own thread."""

    input_ids: np.ndarray  # [B, L-1]: the last token is only ever a target
    arrays: dict[str, np.ndarray]  # pixel_values [n_images, 3, H, W], mm_token_type_ids [B, L-1]
    positions: np.ndarray  # flat indices into [B * (L-1)] of the states that predict targets
    targets: np.ndarray  # the token ids to predict there
    weights: np.ndarray  # each answer's tokens share 1/B: the loss is a mean per answer, summed per chat

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)


def encode_chat(processor: Any, chat: Chat) -> Encoded:
    """Tokenize a chat turn by turn through ``build_prompt``; answers are the targets."""
    tokenizer = tokenizer_of(processor)
    messages = list(chat.prefix)
    sequence: list[int] = []
    targets: list[int] = []
    weights: list[float] = []
    prompt = None
    for new_messages, answer in chat.turns:
        messages.extend(new_messages)
        prompt = build_prompt(processor, messages, list(chat.images), list(chat.tools) or None)
        if prompt.input_ids[: len(sequence)] != sequence:
            raise ValueError(f"the chat template re-renders earlier turns differently: {chat}")
        encoded = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
        answer_ids = encoded["input_ids"]
        # the tokens inside ``given`` (what a grammar forces) are context, not targets
        skip = sum(1 for _, end in encoded["offset_mapping"] if end <= len(chat.given)) if not targets else 0
        learned = len(answer_ids) - skip
        targets.extend(range(len(prompt) + skip, len(prompt) + len(answer_ids)))
        weights.extend([1.0 / learned] * learned)
        sequence = prompt.input_ids + answer_ids
        content = answer.removesuffix(END_OF_TURN).removesuffix(TOOL_HANDOVER)
        messages.append({"role": "assistant", "content": content})
    assert prompt is not None, "a chat needs at least one turn"
    return Encoded(sequence, targets, weights, *_image_arrays(prompt.arrays, len(sequence)))


def _image_arrays(arrays: dict[str, np.ndarray], length: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    unknown = set(arrays) - {"pixel_values", "mm_token_type_ids"}
    assert not unknown, f"the processor returned arrays training does not batch: {unknown}"
    types = arrays.get("mm_token_type_ids")
    if types is not None:
        # answer tokens are text (type 0): they stay causal under Gemma 4's vision overlay
        types = np.pad(types.reshape(-1), (0, length - types.size))
    return arrays.get("pixel_values"), types


def make_batch(examples: list[Encoded], pad_id: int) -> HostBatch:
    """Right-pad to the longest example; padding only ever comes after every target."""
    length = max(len(e.input_ids) for e in examples)
    ids = np.full((len(examples), length), pad_id, dtype=np.int32)
    types = np.zeros((len(examples), length), dtype=np.int32)
    positions, targets, weights = [], [], []
    for row, example in enumerate(examples):
        ids[row, : len(example.input_ids)] = example.input_ids
        if example.mm_token_type_ids is not None:
            types[row, : len(example.input_ids)] = example.mm_token_type_ids
        positions += [row * (length - 1) + t - 1 for t in example.targets]
        targets += [example.input_ids[t] for t in example.targets]
        weights += [w / len(examples) for w in example.weights]
    arrays: dict[str, np.ndarray] = {}
    pixels = [e.pixel_values for e in examples if e.pixel_values is not None]
    if pixels:
        arrays = {"pixel_values": np.concatenate(pixels), "mm_token_type_ids": types[:, :-1]}
    return HostBatch(
        input_ids=ids[:, :-1],
        arrays=arrays,
        positions=np.array(positions, dtype=np.int32),
        targets=np.array(targets, dtype=np.int32),
        weights=np.array(weights, dtype=np.float32),
    )


def batch_stream(processor: Any, rng: np.random.Generator, batch_size: int) -> Iterator[HostBatch]:
    """Endless batches of fresh random training chats, grouped by length, in shuffled order."""
    pad_id = tokenizer_of(processor).pad_token_id
    while True:
        pool = [encode_chat(processor, sample_chat(rng)) for _ in range(batch_size * POOL_BATCHES)]
        # pictures of one size batch together (their arrays stack), then by length; stable: ties
        # keep their (seeded) order
        pool.sort(key=lambda e: (_picture_size(e), len(e.input_ids)))
        chunks = []
        for _, group in itertools.groupby(pool, key=_picture_size):
            same = list(group)
            chunks += [same[i : i + batch_size] for i in range(0, len(same), batch_size)]
        for index in rng.permutation(len(chunks)):
            yield make_batch(chunks[index], pad_id)


def _picture_size(example: Encoded) -> tuple[int, ...]:
    return () if example.pixel_values is None else tuple(example.pixel_values.shape)


T = TypeVar("T")


def prefetch(items: Iterator[T], depth: int = 4) -> Iterator[T]:
    """``items`` made ahead on a background thread, in order (so a seeded stream stays the same).

    Only host work (numpy, Pillow, the tokenizer) may run in ``items``: no MLX, whose arrays
    belong to the thread that makes them. Pillow and numpy release the GIL, so drawing the next
    batch overlaps the training step.
    """
    ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        ready.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            ready.put((False, exc))

    thread = threading.Thread(target=produce, name="demo-data", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = ready.get()
            if not ok:
                raise item
            yield item
    finally:
        stop.set()
