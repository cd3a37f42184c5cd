"""The scheduler with plain fake requests: admission, prefill budget, finishing. No MLX."""

from __future__ import annotations

from vlmserve.engine.params import PromptInputs, SamplingParams
from vlmserve.engine.request import Request, RequestStatus
from vlmserve.engine.scheduler import Scheduler, SchedulerConfig


def _req(rid: str, prompt_len: int = 10, max_tokens: int = 5, eos: frozenset[int] = frozenset({2})) -> Request:
    return Request(rid, PromptInputs(list(range(prompt_len))), SamplingParams(max_tokens=max_tokens), lambda _: None, eos)


def _prefilled(req: Request) -> Request:
    req.num_computed_tokens = req.num_prompt_tokens
    req.output_token_ids.append(7)
    return req


def test_admits_up_to_batch_size_each_step():
    s = Scheduler(SchedulerConfig(max_batch_size=2, prefill_chunk=1000))
    reqs = [_req(f"r{i}") for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert [r.request_id for r in plan.prefill] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 1 and reqs[2].status is RequestStatus.WAITING


def test_a_freed_slot_is_filled_at_the_next_step():
    s = Scheduler(SchedulerConfig(max_batch_size=1))
    a, b = _req("a"), _req("b")
    s.add(a)
    s.add(b)
    s.schedule()
    _prefilled(a)
    assert s.schedule().decode == [a]
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    plan = s.schedule()
    assert plan.prefill == [b] and plan.decode == [] and b.status is RequestStatus.RUNNING


def test_decode_and_prefill_share_a_step():
    s = Scheduler(SchedulerConfig(max_batch_size=4))
    a, b = _req("a"), _req("b")
    s.add(a)
    s.schedule()
    _prefilled(a)
    s.add(b)
    plan = s.schedule()
    assert plan.decode == [a] and plan.prefill == [b]


def test_prefill_token_budget_limits_requests_per_step():
    s = Scheduler(SchedulerConfig(max_batch_size=8, prefill_chunk=25))
    reqs = [_req(f"r{i}", prompt_len=10) for i in range(5)]
    for r in reqs:
        s.add(r)
    assert [r.request_id for r in s.schedule().prefill] == ["r0", "r1", "r2"]


def test_finish_removes_waiting_and_running_requests():
    s = Scheduler(SchedulerConfig(max_batch_size=1))
    a, b = _req("a"), _req("b")
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and a.status.finished and b.status.finished
    assert s.get("a") is None


def test_append_token_stops_on_eos_stop_ids_and_length():
    r = _req("r", max_tokens=3)
    assert r.append_token(5) is None
    assert r.append_token(2) is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5]
    r = Request("s", PromptInputs([1]), SamplingParams(max_tokens=9, stop_token_ids=(9,)), lambda _: None)
    assert r.append_token(9) is RequestStatus.FINISHED_STOPPED
    r = _req("t", max_tokens=2)
    assert r.append_token(4) is None and r.append_token(4) is RequestStatus.FINISHED_LENGTH


def test_ignore_eos_and_context_limit():
    r = Request("r", PromptInputs([1, 1]), SamplingParams(max_tokens=9, ignore_eos=True), lambda _: None, frozenset({2}))
    assert r.append_token(2) is None
    r.max_context = 4
    assert r.append_token(3) is RequestStatus.FINISHED_LENGTH
