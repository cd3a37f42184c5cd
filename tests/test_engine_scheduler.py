"""The scheduler with plain fake requests: admission, exact token counts per step, the results
of a step, finishing. No MLX."""

from __future__ import annotations

from vlmserve.engine.params import PromptInputs, SamplingParams
from vlmserve.engine.request import Request, RequestStatus
from vlmserve.engine.scheduler import Scheduler, SchedulerConfig


def _req(rid: str, prompt_len: int = 10, max_tokens: int = 5, eos: frozenset[int] = frozenset({2}),
         chunkable: bool = True) -> Request:
    req = Request(rid, PromptInputs(list(range(prompt_len))), SamplingParams(max_tokens=max_tokens), eos)
    req.chunkable = chunkable
    return req


def _scheduler(*reqs: Request, batch: int = 8, budget: int = 512) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_batch_size=batch, prefill_chunk=budget))
    for r in reqs:
        s.add(r)
    return s


def _step(s: Scheduler, sampled: dict[str, int] | None = None, failed: dict[str, str] | None = None):
    """One engine step as the core runs it: admit, plan, apply what the runner would return."""
    s.admit()
    plan = s.schedule()
    done = {r.request_id for r in plan.prefill
            if r.num_computed_tokens + plan.num_scheduled_tokens[r.request_id] >= r.num_prompt_tokens}
    tokens = {rid: 7 for rid in done | {r.request_id for r in plan.decode}} if sampled is None else sampled
    return plan, s.update_from_output(plan, tokens, failed or {})


def test_admits_up_to_batch_size_each_step():
    reqs = [_req(f"r{i}") for i in range(3)]
    s = _scheduler(*reqs, batch=2)
    assert s.admit() == reqs[:2]
    assert [r.request_id for r in s.schedule().prefill] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 1 and reqs[2].status is RequestStatus.WAITING


def test_a_freed_slot_is_filled_at_the_next_step():
    a, b = _req("a"), _req("b")
    s = _scheduler(a, b, batch=1)
    _step(s)
    plan, _ = _step(s)
    assert plan.decode == [a] and plan.num_scheduled_tokens == {"a": 1}
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    plan, _ = _step(s)
    assert plan.prefill == [b] and plan.decode == [] and b.status is RequestStatus.RUNNING


def test_decode_and_prefill_share_a_step():
    a, b = _req("a"), _req("b")
    s = _scheduler(a)
    _step(s)
    s.add(b)
    plan, _ = _step(s)
    assert plan.decode == [a] and plan.prefill == [b]
    assert plan.num_scheduled_tokens == {"a": 1, "b": 10}


def test_two_long_prompts_share_the_budget_exactly():
    """Two 300-token prompts against a 512 budget: 300 + 212, then the last 88."""
    a, b = _req("a", prompt_len=300), _req("b", prompt_len=300)
    s = _scheduler(a, b, budget=512)
    plan, updates = _step(s)
    assert plan.num_scheduled_tokens == {"a": 300, "b": 212} and plan.num_prefill_tokens == 512
    assert (a.num_computed_tokens, b.num_computed_tokens) == (300, 212)
    assert [u.request.request_id for u in updates] == ["a"]  # only a finished its prompt
    plan, _ = _step(s)
    assert plan.decode == [a] and plan.num_scheduled_tokens == {"a": 1, "b": 88}


def test_budget_limits_requests_per_step():
    reqs = [_req(f"r{i}", prompt_len=10) for i in range(5)]
    plan, _ = _step(_scheduler(*reqs, budget=25))
    assert plan.num_scheduled_tokens == {"r0": 10, "r1": 10, "r2": 5}


def test_an_unsplittable_prompt_goes_whole_and_alone_when_over_budget():
    big, small = _req("big", prompt_len=700, chunkable=False), _req("small", prompt_len=10)
    plan, _ = _step(_scheduler(big, small, budget=512))
    assert plan.num_scheduled_tokens == {"big": 700}  # nothing else: the step is already over budget


def test_an_unsplittable_prompt_waits_for_a_step_with_room():
    first, image = _req("first", prompt_len=400), _req("image", prompt_len=300, chunkable=False)
    s = _scheduler(first, image, budget=512)
    plan, _ = _step(s)
    assert plan.num_scheduled_tokens == {"first": 400}  # 300 do not fit in the 112 left
    plan, _ = _step(s)
    assert plan.num_scheduled_tokens == {"first": 1, "image": 300}


def test_nobody_overtakes_a_waiting_prompt():
    image, text = _req("image", prompt_len=300, chunkable=False), _req("text", prompt_len=5)
    s = _scheduler(_req("head", prompt_len=500), image, text, budget=512)
    plan, _ = _step(s)
    assert plan.num_scheduled_tokens == {"head": 500}


def test_results_of_a_step_update_each_request():
    a, b, c = _req("a", max_tokens=2), _req("b"), _req("c")
    s = _scheduler(a, b, c)
    _, updates = _step(s, sampled={"a": 5, "b": 2}, failed={"c": "RuntimeError: boom"})
    by_id = {u.request.request_id: u for u in updates}
    assert (by_id["a"].token_id, by_id["a"].finish) == (5, None)
    assert (by_id["b"].token_id, by_id["b"].finish) == (None, RequestStatus.FINISHED_STOPPED)  # EOS is not output
    assert (by_id["c"].finish, by_id["c"].error) == (RequestStatus.FINISHED_ERROR, "RuntimeError: boom")
    assert s.running == [a] and a.output_token_ids == [5]
    _, updates = _step(s, sampled={"a": 6})
    assert updates[0].finish is RequestStatus.FINISHED_LENGTH and not s.has_unfinished()


def test_finish_removes_waiting_and_running_requests():
    a, b = _req("a"), _req("b")
    s = _scheduler(a, b, batch=1)
    s.admit()
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and a.status.finished and b.status.finished
    assert s.get("a") is None


def test_append_token_stops_on_eos_stop_ids_and_length():
    r = _req("r", max_tokens=3)
    assert r.append_token(5) is None
    assert r.append_token(2) is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5]
    r = Request("s", PromptInputs([1]), SamplingParams(max_tokens=9, stop_token_ids=(9,)))
    assert r.append_token(9) is RequestStatus.FINISHED_STOPPED
    r = _req("t", max_tokens=2)
    assert r.append_token(4) is None and r.append_token(4) is RequestStatus.FINISHED_LENGTH


def test_ignore_eos_and_context_limit():
    r = Request("r", PromptInputs([1, 1]), SamplingParams(max_tokens=9, ignore_eos=True), frozenset({2}))
    assert r.append_token(2) is None
    r.max_context = 4
    assert r.append_token(3) is RequestStatus.FINISHED_LENGTH


def test_the_kv_budget_bounds_rows_times_the_longest_need_and_keeps_order():
    from vlmserve.engine.memory import KVBudget, KVFootprint

    # 10 bytes per position; a batch costs rows x the longest need (prompt + max_tokens).
    budget = KVBudget(300, KVFootprint(per_position=10))
    small, big, after = _req("small", 5, 5), _req("big", 10, 10), _req("after", 2, 3)
    s = Scheduler(SchedulerConfig(max_batch_size=8), budget)
    for r in (small, big, after):
        s.add(r)
    assert s.admit() == [small]  # small + big would be 2 x 20 positions x 10 B = 400 > 300
    assert s.kv_reserved_bytes == 100
    assert s.admit() == []  # "after" would fit, but nobody overtakes the head of the queue
    s.finish(small, RequestStatus.FINISHED_LENGTH)
    assert s.admit() == [big]  # big + after: 2 rows x 20 positions (the longest) x 10 B = 400 > 300
    assert s.kv_reserved_bytes == 200
    s.finish(big, RequestStatus.FINISHED_STOPPED)
    assert s.admit() == [after] and s.kv_reserved_bytes == 50


def test_one_request_is_always_admitted_whatever_the_budget():
    """The API refuses a request that could never fit; the scheduler never deadlocks on one."""
    from vlmserve.engine.memory import KVBudget, KVFootprint

    s = Scheduler(SchedulerConfig(max_batch_size=8), KVBudget(1, KVFootprint(per_position=10)))
    s.add(_req("r", 10, 10))
    assert [r.request_id for r in s.admit()] == ["r"]


def test_a_footprint_counts_windows_and_fixed_state():
    from vlmserve.engine.memory import KVBudget, KVFootprint

    f = KVFootprint(per_position=4, windows=((2, 100),), fixed=1000)
    assert f.row_bytes(50) == 4 * 50 + 2 * 50 + 1000
    assert f.row_bytes(500) == 4 * 500 + 2 * 100 + 1000
    assert KVBudget(10_000, f).refusal(3000) is not None and KVBudget(10_000, f).refusal(10) is None
    assert KVBudget(None, f).refusal(10**9) is None
