"""[worker] The pipeline's ranks: rank 0 sends each step to every rank; each runs it on its slice.

Every rank runs one ``ModelRunner`` and the same ``execute`` on the same plan; its ``Rank`` says how
it takes part. Rank 0's ``Leader``, once the step's prompts are embedded (the vision tower is rank 0's
alone), sends the other ranks the plan as they run it (``for_followers``), the new prompts'
embeddings (with their per-prompt keywords and decode state) and the decode batch's input tokens.
Every other rank's ``Follower`` runs each plan it receives, taking those at the same point. Then
every rank runs the same join, decode and prefill code in the same order; the hidden state hops from
rank to rank inside the forward (pipeline.py), and rank 0 alone samples (the others have no head).
Every rank keeps the same prompt rows and decode batch, so every cache operation (join, fork,
filter) happens alike on every rank.

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
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import mlx.core as mx
import numpy as np

from vlmserve.engine.models import Embedded
from vlmserve.engine.pipeline import Stage
from vlmserve.engine.plan import NewRequest, RunnerOutput, SchedulerOutput
from vlmserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)

STEP, PING, STOP = "step", "ping", "stop"


@dataclass(slots=True)
class StepMessage:
    """What rank 0 sends every rank for one step (``kind`` step), a heartbeat (ping) or the end (stop)."""

    kind: str = STEP
    plan: SchedulerOutput = field(default_factory=SchedulerOutput)  # as the other ranks run it (for_followers)
    embedded: dict[str, Embedded] = field(default_factory=dict)  # the prompts rank 0 embedded this step
    tokens: list[int] | None = None  # the decode batch's inputs, when the step decodes


def for_followers(plan: SchedulerOutput, failed: Collection[str]) -> SchedulerOutput:
    """The step as the other ranks run it once rank 0 has entered and embedded its prompts: without the
    requests that ``failed`` there, nothing to encode (the embeddings go with it), and each new request
    with its token ids and sampling, no pixels and no grammar (rank 0 samples). (No plan reuses a
    prefix: the prefix caches are off across ranks.)"""
    def stripped(new: NewRequest) -> NewRequest:
        prompt = replace(new.prompt, arrays={k: np.zeros(0) for k in new.prompt.arrays}, images=())
        forks = tuple((rid, replace(p, guide=None)) for rid, p in new.forks)
        return replace(new, prompt=prompt, params=replace(new.params, guide=None), forks=forks)

    return replace(plan, new=[stripped(n) for n in plan.new if n.request_id not in failed], encode=[],
                   prefill=[c for c in plan.prefill if c.request_id not in failed],
                   prefill_groups=[[r for r in g if r not in failed] for g in plan.prefill_groups])


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


# -- the ranks ----------------------------------------------------------------------------


class Leader:
    """Rank 0: samples, and sends each step to the other ranks before the language model runs. From
    then on a fault would leave the ranks' states apart: it ends the pipeline, not one request."""

    samples = True

    def __init__(self, stage: Stage, watch: Watch) -> None:
        self.stage = stage
        self.link = Link(stage)
        self.watch = watch
        self.sent = False  # this step went out to the other ranks

    def share(self, runner: ModelRunner, plan: SchedulerOutput, out: RunnerOutput) -> None:
        """Send the plan as the others run it, the prompts embedded this step and the decode batch's
        inputs (read now: this waits for the step that computes them)."""
        self.watch.start("a step")  # not before: the vision tower, rank 0's alone, may take its time
        tokens = None
        if plan.decode and runner.batch.tokens is not None:
            tokens = cast(list[int], runner.batch.tokens.tolist())
        embedded = {rid: row.embedded for rid in out.prompt_lengths if rid not in out.errors
                    for row in [runner.prompts.get(rid)] if row is not None and row.embedded is not None}
        self.link.send(StepMessage(STEP, for_followers(plan, out.errors), embedded, tokens))
        self.sent = True

    def on_fault(self, exc: Exception) -> None:
        if self.sent:  # every rank runs this part too
            raise exc

    def done(self) -> None:
        self.sent = False
        self.watch.done()

    def heartbeat(self) -> None:
        """Ping every rank (between steps, on the worker) under the watchdog."""
        with self.watch.waiting("a heartbeat"):
            self.link.heartbeat()

    def close(self) -> None:
        """Tell every rank to stop (after the last step)."""
        self.link.send(StepMessage(STOP))
        self.stage.bell.close()


class Follower:
    """A rank other than 0: runs each step rank 0 sends, on its slice; samples nothing (it has no head),
    and any fault ends the pipeline (rank 0 ran the part already: it cannot be one request's)."""

    samples = False

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.link = Link(stage)
        self.step: StepMessage | None = None  # the step being run, as rank 0 sent it

    def follow(self, runner: ModelRunner) -> None:
        """Run every step rank 0 sends until it says stop (raises when a rank is lost)."""
        while (message := self.link.receive()).kind != STOP:
            if message.kind == STEP:
                self.step = message
                runner.execute(message.plan)

    def share(self, runner: ModelRunner, plan: SchedulerOutput, out: RunnerOutput) -> None:
        """Take what rank 0 sent with the step: the prompts it embedded, the decode batch's inputs."""
        assert self.step is not None and self.step.plan is plan
        for request_id, embedded in self.step.embedded.items():
            runner.prompts[request_id].embedded = embedded
        if self.step.tokens is not None:
            runner.batch.tokens = mx.array(self.step.tokens, dtype=mx.int32)

    def on_fault(self, exc: Exception) -> None:
        raise exc

    def done(self) -> None:
        self.step = None
