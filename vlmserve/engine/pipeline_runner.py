"""[worker] The pipeline's runners: rank 0 sends each step to every rank; each runs it on its slice.

Rank 0's ``LeaderRunner`` is the single-process runner with one more act per step: once the step's
prompts are embedded (the vision tower is rank 0's alone), it sends the other ranks what they need
to run the same step: the requests that end and enter, the embeddings (with their per-prompt
keywords and decode state), the decode batch's input tokens, the prefill chunks and groups. Then
every rank runs the same decode and prefill code in the same order; the hidden state hops from rank
to rank inside the forward (pipeline.py), and rank 0 samples. The other ranks' ``FollowerRunner``
keeps the same prompt rows and decode batch, so every cache operation (join, fork, filter) happens
alike on every rank.

Messages go over the group itself (``send``/``recv``, relayed rank to rank), so a Thunderbolt link
(``jaccl``) carries them too. Faults: a rank that dies makes its neighbours' ``recv`` raise; one that
hangs blocks them forever, so rank 0's ``Watch`` notices a step or a heartbeat that waits too long.
Once a step has gone out, any fault on rank 0 would leave the ranks' states apart: it ends the
pipeline instead of one request.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import mlx.core as mx
import numpy as np

from vlmserve.engine.caches import EngineCaches
from vlmserve.engine.loader import LoadedModel
from vlmserve.engine.models import Embedded
from vlmserve.engine.pipeline import Stage
from vlmserve.engine.plan import NewRequest, PrefillChunk, RunnerOutput, Sample, SchedulerOutput
from vlmserve.engine.runner import ModelRunner, PromptRow
from vlmserve.engine.sampler import RowState

log = logging.getLogger(__name__)

STEP, PING, STOP = "step", "ping", "stop"


@dataclass(slots=True)
class StepMessage:
    """What rank 0 sends every rank for one step (``kind`` step), a heartbeat (ping) or the end (stop)."""

    kind: str = STEP
    finished: list[str] = field(default_factory=list)
    new: list[NewRequest] = field(default_factory=list)  # prompts without pixels, params without grammars
    failed: list[str] = field(default_factory=list)  # requests rank 0 could not enter or embed
    embedded: dict[str, Embedded] = field(default_factory=dict)
    tokens: list[int] | None = None  # the decode batch's inputs, when the step decodes
    prefill: list[PrefillChunk] = field(default_factory=list)
    prefill_groups: list[list[str]] = field(default_factory=list)


# -- the wire -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where an array went: its place in the message's array list."""

    index: int


_DTYPES = {str(v): v for v in vars(mx).values() if isinstance(v, mx.Dtype)}  # "mlx.core.bool" -> mx.bool_


class Link:
    """This rank's end of the group for messages: pickled headers and the arrays they name."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    # -- rank 0

    def send(self, message: StepMessage) -> None:
        """To every other rank (relayed: rank 0 sends to rank 1, each rank to the next), each woken
        by its doorbell first."""
        self.stage.bell.ring()
        self._send_to(self.stage.rank + 1, *self._pack(message))

    def heartbeat(self) -> None:
        """A ping to every rank and the answer back from the last: each is alive and following."""
        self.send(StepMessage(PING))
        mx.eval(mx.distributed.recv((1,), mx.int32, self.stage.rank + 1))

    # -- other ranks

    def receive(self) -> StepMessage:
        """The next message from rank 0, passed on to the next rank first."""
        self.stage.bell.wait()  # asleep until rank 0 sends: MLX's recv would poll
        blob, arrays = self._recv_from(self.stage.rank - 1)
        if self.stage.rank + 1 < self.stage.size:
            self._send_to(self.stage.rank + 1, blob, arrays)
        message = self._unpack(blob, arrays)
        if message.kind == PING:  # the answer goes back down the line once every rank after this one has it
            if self.stage.rank + 1 < self.stage.size:
                mx.eval(mx.distributed.recv((1,), mx.int32, self.stage.rank + 1))
            mx.eval(mx.distributed.send(mx.array([self.stage.rank], dtype=mx.int32), self.stage.rank - 1))
        return message

    # -- both

    @staticmethod
    def _pack(message: StepMessage) -> tuple[bytes, list[mx.array]]:
        arrays: list[mx.array] = []

        def slot(value: Any) -> Any:
            if isinstance(value, mx.array):
                arrays.append(value)
                return _Slot(len(arrays) - 1)
            if isinstance(value, (list, tuple)):
                return type(value)(slot(v) for v in value)
            if isinstance(value, dict):
                return {k: slot(v) for k, v in value.items()}
            return value

        embedded = {rid: (slot(e.inputs_embeds), slot(e.lm_kwargs), slot(e.row_state))
                    for rid, e in message.embedded.items()}
        header = (replace(message, embedded={}), embedded, [(a.shape, str(a.dtype)) for a in arrays])
        return pickle.dumps(header), arrays

    @staticmethod
    def _unpack(blob: bytes, arrays: list[mx.array]) -> StepMessage:
        message, embedded, _ = pickle.loads(blob)

        def fill(value: Any) -> Any:
            if isinstance(value, _Slot):
                return arrays[value.index]
            if isinstance(value, (list, tuple)):
                return type(value)(fill(v) for v in value)
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            return value

        message.embedded = {rid: Embedded(fill(e), fill(kw), fill(state)) for rid, (e, kw, state) in embedded.items()}
        return cast(StepMessage, message)

    @staticmethod
    def _send_to(dst: int, blob: bytes, arrays: list[mx.array]) -> None:
        mx.eval(mx.distributed.send(mx.array([len(blob)], dtype=mx.int32), dst))
        mx.eval(mx.distributed.send(mx.array(np.frombuffer(blob, dtype=np.uint8)), dst))
        for array in arrays:
            if array.size:  # an empty array is made from the header alone
                mx.eval(mx.distributed.send(mx.contiguous(array), dst))

    @staticmethod
    def _recv_from(src: int) -> tuple[bytes, list[mx.array]]:
        length = mx.distributed.recv((1,), mx.int32, src)
        mx.eval(length)
        raw = mx.distributed.recv((cast(int, length.item()),), mx.uint8, src)
        mx.eval(raw)
        blob = bytes(np.array(raw))
        shapes = pickle.loads(blob)[2]
        arrays = []
        for shape, dtype in shapes:
            kind = _DTYPES[dtype]
            array = mx.distributed.recv(shape, kind, src) if int(np.prod(shape)) else mx.zeros(shape, kind)
            mx.eval(array)
            arrays.append(array)
        return blob, arrays


def _for_followers(new: NewRequest) -> NewRequest:
    """A new request as the other ranks need it: its token ids and sampling, no pixels (they get
    the embeddings), no grammar (rank 0 samples), no prefix (the prefix caches are off)."""
    prompt = replace(new.prompt, arrays={k: np.zeros(0) for k in new.prompt.arrays}, images=())
    forks = tuple((rid, replace(p, guide=None)) for rid, p in new.forks)
    return replace(new, prompt=prompt, params=replace(new.params, guide=None), prefix=None, forks=forks)


# -- the watchdog -------------------------------------------------------------------------


class Watch:
    """Rank 0's watchdog: a step or a heartbeat still waiting on the other ranks after ``timeout_s``
    means one of them hung (a stopped process, a lost link that never errors). ``on_hang`` gets one
    line naming it; ``grace_s`` later ``on_stuck`` runs: the worker is stuck in ``recv`` for good, and the
    process must end (server.py decides how)."""

    def __init__(self, stage: Stage, timeout_s: float, grace_s: float = 2.0) -> None:
        self.stage = stage
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.on_hang: Callable[[str], None] | None = None
        self.on_stuck: Callable[[], None] | None = None
        self._since: float | None = None
        self._what = ""
        self._fired = False
        self._thread = threading.Thread(target=self._watch, name="pipeline-watch", daemon=True)
        self._thread.start()

    def start(self, what: str) -> None:
        """From now on this rank waits on the others (``what``, for the message), until ``done``."""
        self._what, self._since = what, time.monotonic()

    def done(self) -> None:
        self._since = None

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        self.start(what)
        try:
            yield
        finally:
            self.done()

    def hang_message(self) -> str:
        return (f"pipeline: {self.stage.peers} did not answer {self._what} within {self.timeout_s:g} s (hung or stopped); "
                "ending every request and stopping")

    def _watch(self) -> None:
        while not self._fired:
            time.sleep(min(0.2, self.timeout_s / 4))
            since = self._since
            if since is None or time.monotonic() - since < self.timeout_s:
                continue
            self._fired = True
            message = self.hang_message()
            log.error(message)
            if self.on_hang is not None:
                self.on_hang(message)
            if self.on_stuck is not None:
                time.sleep(self.grace_s)  # the requests' errors go out first
                self.on_stuck()


# -- the runners --------------------------------------------------------------------------


class LeaderRunner(ModelRunner):
    """Rank 0: the single-process runner, which sends each step to the other ranks before the
    language model runs (``_share``)."""

    def __init__(self, loaded: LoadedModel, caches: EngineCaches, stage: Stage, watch: Watch) -> None:
        super().__init__(loaded, caches)
        self.stage = stage
        self.link = Link(stage)
        self.watch = watch
        self._shared = False

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        try:
            return super().execute(plan)
        finally:
            self._shared = False
            self.watch.done()

    def _share(self, plan: SchedulerOutput, out: RunnerOutput) -> None:
        self.watch.start("a step")  # not before: the vision tower, rank 0's alone, may take its time
        tokens = None
        if plan.decode and self.batch.tokens is not None:
            tokens = cast(list[int], self.batch.tokens.tolist())
        embedded = {rid: row.embedded for rid in out.prompt_lengths if rid not in out.errors
                    for row in [self.prompts.get(rid)] if row is not None and row.embedded is not None}
        self.link.send(StepMessage(STEP, list(plan.finished), [_for_followers(n) for n in plan.new],
                                   list(out.errors), embedded, tokens, list(plan.prefill),
                                   [list(g) for g in plan.prefill_groups]))
        self._shared = True

    def _guarded(self, out: RunnerOutput, request_ids: list[str], fn: Callable[..., object], *args: object) -> None:
        if self._shared:  # every rank runs this part too: a fault here leaves them apart, so it ends the pipeline
            fn(*args)
            return
        super()._guarded(out, request_ids, fn, *args)

    def heartbeat(self) -> None:
        """Ping every rank (between steps, on the worker) under the watchdog."""
        with self.watch.waiting("a heartbeat"):
            self.link.heartbeat()

    def close(self) -> None:
        """Tell every rank to stop (after the last step)."""
        self.link.send(StepMessage(STOP))
        self.stage.bell.close()


class FollowerRunner(ModelRunner):
    """A rank other than 0: runs rank 0's steps on its slice; samples nothing."""

    def __init__(self, loaded: LoadedModel, stage: Stage) -> None:
        super().__init__(loaded)
        self.stage = stage
        self.link = Link(stage)

    def follow(self) -> None:
        """Run every step rank 0 sends until it says stop (raises when a rank is lost)."""
        while True:
            message = self.link.receive()
            if message.kind == STOP:
                return
            if message.kind == STEP:
                self.run_step(message)

    def run_step(self, message: StepMessage) -> None:
        """The same parts as rank 0's ``execute``, in its order, from what rank 0 sent."""
        out = RunnerOutput(errors=dict.fromkeys(message.failed, "failed on rank 0"))
        self.remove(message.finished)
        for new in message.new:
            if new.request_id not in out.errors:
                self._enter(new)
        for request_id, embedded in message.embedded.items():
            self.prompts[request_id].embedded = embedded
        if message.tokens is not None:
            self.batch.tokens = mx.array(message.tokens, dtype=mx.int32)
            mx.eval(self.adapter.decode(self.batch.tokens[:, None], self.batch.cache or [], self.batch.row_state))
        self._prefill_all(SchedulerOutput(prefill=message.prefill, prefill_groups=message.prefill_groups), out)

    def _guarded(self, out: RunnerOutput, request_ids: list[str], fn: Callable[..., object], *args: object) -> None:
        fn(*args)  # rank 0 ran this part already: a fault here cannot be one request's

    def _prefill_scored(self, row: PromptRow, embedded: Embedded, chunk: PrefillChunk) -> mx.array:
        logits = self.adapter.prefill(row.input_ids, embedded, chunk.start, chunk.end, row.cache, every_position=True)
        last: mx.array = logits[-1:]
        return last

    def _sample_first(self, logits: mx.array, rows: list[PromptRow], forks: list[Any] | None = None
                      ) -> tuple[list[Sample], list[RowState]]:
        for row in rows:
            row.embedded, row.hidden = None, None
        n = len(rows) + len(forks or [])
        return [Sample(0)] * n, cast(list[RowState], [None] * n)  # rank 0 sends each step's tokens
