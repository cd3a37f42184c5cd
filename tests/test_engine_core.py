"""EngineCore on the real worker thread with a fake runner: what the core plans, in which order, and
what it publishes. Admission, the budgets, aborts mid-encode and mid-prefill, the KV budget, faults
and shutdown, without a model."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vlmserve.engine.core import EngineCore
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.memory import KVFootprint
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import RunnerOutput, Sample, SchedulerOutput
from vlmserve.engine.request import AbortRequest, AddRequest, StepOutput, StepOutputs
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.inputs import PromptInputs

EOS = 2


@dataclass
class FakeAdapter:
    """What the core reads of a family: image prompts cannot be split by tokens, as Gemma's."""

    num_layers: int = 4
    num_vision_blocks: int = 0
    reuses_prefix: bool = True
    vision_cache: bool = False
    mm_prefix_exact: bool = False
    text_prefix_exact: bool = False
    mm_prefix_limit: int | None = None
    trims_cache: bool = True
    verifies_drafts: bool = True

    def can_chunk(self, prompt: PromptInputs) -> bool:
        return not prompt.has_images

    def media_token_ids(self) -> frozenset[int]:
        return frozenset()

    def last_run_marks(self, processor: Any) -> frozenset[int]:
        return frozenset()

    def can_batch(self, prompt: PromptInputs) -> bool:
        return True

    def layer_starts(self) -> tuple[int, ...] | None:
        return None

    def text_tail(self, prompt: PromptInputs) -> int | None:
        return None


@dataclass
class FakeRunner:
    """Executes plans as a model would, without one: each prompt's first token when its last chunk
    ends, then one token per decode row (100, 101... per request); ``fail`` names requests whose
    prefill raises. Checks the plan's order: nothing before it entered, nothing after it was forgotten."""

    fail: set[str] = field(default_factory=set)
    plans: list[SchedulerOutput] = field(default_factory=list)
    live: dict[str, int] = field(default_factory=dict)  # request -> tokens given
    lengths: dict[str, int] = field(default_factory=dict)  # request -> prompt positions
    gate: threading.Event = field(default_factory=threading.Event)  # every step waits for it
    hold_at: int = 0  # the step (1, 2...) that stops, once ``held`` is set, until ``release`` is
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.gate.wait(10)
        self.plans.append(plan)
        if len(self.plans) == self.hold_at:
            self.held.set()
            self.release.wait(10)
        for request_id in plan.finished:
            self.live.pop(request_id, None)
        lengths = {}
        for new in plan.new:
            self.live[new.request_id] = 0
            lengths[new.request_id] = len(new.prompt.input_ids)
        out = RunnerOutput(prompt_lengths={r: lengths.get(r, 0) for r in plan.encode_ids})
        touched = [*plan.encode_ids, *plan.decode, *(c.request_id for c in plan.prefill)]
        assert all(r in self.live for r in touched), "the plan touches a request the runner does not hold"
        for chunk in plan.prefill:
            if chunk.request_id in self.fail:
                out.errors[chunk.request_id] = "RuntimeError: simulated kernel failure"
                out.faults += 1
            elif chunk.final and chunk.end == self.lengths[chunk.request_id]:  # the prompt's last chunk
                out.samples[chunk.request_id] = Sample(self._token(chunk.request_id))
        for request_id in plan.decode:
            out.samples[request_id] = Sample(self._token(request_id))
        return out

    def _token(self, request_id: str) -> int:
        self.live[request_id] += 1
        return 99 + self.live[request_id]

    def chunks(self, request_id: str) -> list[tuple[int, int, int, int | None]]:
        return [(c.start, c.end, c.first_layer, c.last_layer) for p in self.plans for c in p.prefill
                if c.request_id == request_id]


class Harness:
    """A core with a fake runner on a real MLXWorkerThread; outputs collected per request."""

    def __init__(self, config: EngineConfig, runner: FakeRunner) -> None:
        self.runner = runner
        self.worker = MLXWorkerThread(name="core-test")
        self.worker.start()
        loaded = SimpleNamespace(eos_token_ids=frozenset({EOS}), max_context=1 << 20, adapter=FakeAdapter(),
                                 processor=None, drafter=None)
        self.steps: queue.SimpleQueue[StepOutputs] = queue.SimpleQueue()
        self.core = self.worker.call(EngineCore, loaded, self.worker, self.steps.put, config, runner)
        self.worker.set_stepper(self.core)
        self.outputs: dict[str, list[StepOutput]] = {}

    def add(self, request_id: str, prompt_len: int = 8, max_tokens: int = 3, images: int = 0) -> None:
        arrays = {"pixel_values": np.zeros((images, 3))} if images else {}
        prompt = PromptInputs(list(range(10, 10 + prompt_len)), arrays, images)
        self.runner.lengths[request_id] = prompt_len
        self.core.post(AddRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    def pump(self) -> None:
        """Take one step's outputs."""
        for out in self.steps.get(timeout=10).outputs:
            self.outputs.setdefault(out.request_id, []).append(out)

    def until_finished(self, *request_ids: str) -> None:
        while not all(self.finish(r) for r in request_ids):
            self.pump()

    def finish(self, request_id: str) -> StepOutput | None:
        outs = self.outputs.get(request_id, [])
        return outs[-1] if outs and outs[-1].finish_reason else None

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.token_ids]

    def close(self) -> None:
        self.runner.gate.set()
        self.runner.release.set()
        self.worker.shutdown()


@pytest.fixture
def harness() -> Iterator[Any]:
    made: list[Harness] = []

    def make(runner: FakeRunner | None = None, **config: Any) -> Harness:
        runner = runner or FakeRunner()
        runner.gate.set()
        made.append(Harness(EngineConfig(**{"max_batch_size": 4, "prefill_chunk": 16, **config}), runner))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_a_text_request_is_embedded_prefilled_in_chunks_and_decoded(harness: Any) -> None:
    h = harness()
    h.add("a", prompt_len=40, max_tokens=3)
    h.until_finished("a")
    assert h.runner.chunks("a") == [(0, 16, 0, None), (16, 32, 0, None), (32, 40, 0, None)]
    assert h.tokens("a") == [100, 101, 102] and h.finish("a").finish_reason == "length"
    assert h.finish("a").num_prompt_tokens == 40
    first = next(p for p in h.runner.plans if p.new)
    assert first.encode_ids == ["a"] and first.prefill[0].request_id == "a"  # a text prompt starts at once


def test_an_image_prompt_that_cannot_be_split_by_tokens_goes_by_layers(harness: Any) -> None:
    h = harness()
    h.add("img", prompt_len=32, max_tokens=2, images=1)
    h.until_finished("img")
    # Encoded in one step, then 32 positions through 4 layers at 16 tokens a step: 2 layers a step.
    assert h.runner.chunks("img") == [(0, 32, 0, 2), (0, 32, 2, None)]
    encode_step = next(i for i, p in enumerate(h.runner.plans) if p.encode_ids == ["img"])
    assert not h.runner.plans[encode_step].prefill  # its length is the embedding's: known after encoding
    assert h.tokens("img") == [100, 101]


def test_images_are_encoded_one_per_step_while_a_stream_decodes(harness: Any) -> None:
    h = harness(max_batch_size=8, prefill_chunk=512, stream_prefill_chunk=16)
    h.add("stream", prompt_len=4, max_tokens=100_000)
    while not h.tokens("stream"):
        h.pump()
    for i in range(4):
        h.add(f"i{i}", prompt_len=64, max_tokens=2, images=1)
    h.until_finished("i0", "i1", "i2", "i3")
    h.core.post(AbortRequest("stream"))
    h.until_finished("stream")
    burst = [p for p in h.runner.plans if any(r.startswith("i") for r in [*p.encode_ids, *p.decode])]
    for plan in burst:
        assert len(plan.encode) <= 1  # the encoder budget
        assert "stream" in plan.decode  # the stream decoded every step
        # 64-position prompts split by layers: 16 tokens' worth of work a step, one layer of four
        assert sum(c.num_tokens * ((c.last_layer or 4) - c.first_layer) for c in plan.prefill) <= 16 * 4
    assert [c[2:] for c in h.runner.chunks("i0")] == [(0, 1), (1, 2), (2, 3), (3, None)]


def test_admission_keeps_arrival_order_and_the_batch_size(harness: Any) -> None:
    h = harness(max_batch_size=2)
    h.runner.gate.clear()
    for r in ("a", "b", "c"):
        h.add(r, prompt_len=4, max_tokens=2)
    h.runner.gate.set()
    h.until_finished("a", "b", "c")
    admitted = [n.request_id for p in h.runner.plans for n in p.new]
    assert admitted == ["a", "b", "c"]
    c_in = next(i for i, p in enumerate(h.runner.plans) if any(n.request_id == "c" for n in p.new))
    assert set(h.runner.plans[c_in].finished) & {"a", "b"}  # c took a freed slot
    assert all(sum(1 for r in p.decode) <= 2 for p in h.runner.plans)


def test_an_abort_mid_prefill_frees_the_request_at_the_next_step(harness: Any) -> None:
    h = harness(FakeRunner(hold_at=3), prefill_chunk=4)
    h.add("long", prompt_len=400, max_tokens=5)
    h.runner.held.wait(10)
    h.core.post(AbortRequest("long"))
    h.runner.release.set()
    h.until_finished("long")
    assert h.finish("long").finish_reason == "abort" and h.tokens("long") == []
    h.add("next", prompt_len=4, max_tokens=1)
    h.until_finished("next")
    forgot = next(i for i, p in enumerate(h.runner.plans) if "long" in p.finished)
    assert forgot == 3 and len(h.runner.chunks("long")) == 3  # the step after the abort
    assert not any(c.request_id == "long" for p in h.runner.plans[forgot:] for c in p.prefill)
    assert "long" not in h.runner.live


def test_an_abort_mid_encode_never_encodes(harness: Any) -> None:
    h = harness(FakeRunner(hold_at=3), encoder_budget=1)
    h.add("stream", prompt_len=4, max_tokens=30)  # while it decodes, one image a step
    while not h.tokens("stream"):
        h.pump()
    h.runner.gate.clear()
    h.add("first", prompt_len=8, max_tokens=1, images=1)
    h.add("second", prompt_len=8, max_tokens=1, images=1)
    h.runner.gate.set()
    h.runner.held.wait(10)
    h.core.post(AbortRequest("second"))
    h.runner.release.set()
    h.until_finished("first", "second", "stream")
    assert [r for p in h.runner.plans for r in p.encode_ids] == ["stream", "first"]
    assert h.finish("second").finish_reason == "abort"


def test_a_prefill_fault_ends_just_its_request(harness: Any) -> None:
    h = harness(FakeRunner(fail={"bad"}))
    h.add("bad", prompt_len=4)
    h.add("good", prompt_len=4, max_tokens=2)
    h.until_finished("bad", "good")
    assert h.finish("bad").finish_reason == "error" and "simulated kernel failure" in h.finish("bad").error
    assert h.tokens("good") == [100, 101]
    assert h.worker.call(h.core.snapshot).step_errors >= 1


def test_the_kv_budget_holds_a_request_until_memory_frees(harness: Any) -> None:
    h = harness(kv_cache_bytes=1000)
    h.core.kv.footprint = KVFootprint(per_position=10)  # a row of 60 positions: 600 bytes
    h.runner.gate.clear()
    h.add("a", prompt_len=50, max_tokens=10)
    h.add("b", prompt_len=50, max_tokens=10)
    h.runner.gate.set()
    h.until_finished("a", "b")
    b_in = next(i for i, p in enumerate(h.runner.plans) if any(n.request_id == "b" for n in p.new))
    assert "a" in h.runner.plans[b_in].finished  # two rows would take 1200 bytes


def test_shutdown_fails_every_request_and_the_runner_lets_go(harness: Any) -> None:
    h = harness(FakeRunner(hold_at=2), max_batch_size=1, prefill_chunk=4)
    h.runner.gate.clear()
    h.add("running", prompt_len=400, max_tokens=5)
    h.add("waiting", prompt_len=4)
    h.runner.gate.set()
    h.runner.held.wait(10)
    done = h.worker.submit(h.core.fail_all, "server is shutting down")  # runs right after this step
    h.runner.release.set()
    done.result(10)
    h.until_finished("running", "waiting")
    assert {h.finish(r).error for r in ("running", "waiting")} == {"server is shutting down"}
    assert h.runner.live == {}
