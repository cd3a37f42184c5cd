"""The scheduler with plain fake requests: admission, the encoder and token budgets, prompts split by
tokens and by layers, exact counts per step, the results of a step, finishing. No MLX."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import PrefillChunk, RunnerOutput, Sample, SchedulerOutput
from vlmserve.engine.request import Request, RequestStatus
from vlmserve.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from vlmserve.inputs import ImageItem, PromptInputs


def _req(rid: str, prompt_len: int = 10, max_tokens: int = 5, eos: frozenset[int] = frozenset({2}),
         chunkable: bool = True, images: tuple[str, ...] = ()) -> Request:
    """A request; ``images`` are image keys (a prompt with pixel values, one item per key)."""
    arrays = {"pixel_values": np.zeros((len(images), 3))} if images else {}
    items = tuple(ImageItem(k, {}) for k in images)
    prompt = PromptInputs(list(range(prompt_len)), arrays, len(images), items)
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos)
    req.chunkable = chunkable
    return req


def _config(batch: int = 8, budget: int = 512, **kw: object) -> SchedulerConfig:
    return SchedulerConfig(max_batch_size=batch, prefill_chunk=budget, **kw)  # type: ignore[arg-type]


def _scheduler(*reqs: Request, batch: int = 8, budget: int = 512, caches: object = None, **kw: object) -> Scheduler:
    s = Scheduler(_config(batch, budget, **kw), caches=caches)  # type: ignore[arg-type]
    for r in reqs:
        s.add(r)
    return s


MEDIA = 1000  # an image's placeholder token in the fake prompts


class FakeCaches:
    """The caches' bookkeeping as the scheduler asks it: a text prefix store and a set of image keys."""

    def __init__(self, prefixes: dict[tuple[int, ...], str] | None = None, images: set[str] | None = None) -> None:
        self.prefixes = prefixes or {}
        self.images = images or set()
        self.reserved: dict[str, str] = {}  # what the runner would take, by request id

    def reuses(self, prompt: PromptInputs) -> bool:
        return not prompt.has_images  # as the default: the image-keyed cache is opt-in

    def reserve_prefix(self, request_id: str, prompt: PromptInputs) -> int:
        tokens = prompt.input_ids
        if prompt.has_images:  # the text before its first image (MEDIA), whole; none: nothing
            tokens = [*tokens[:tokens.index(MEDIA)], -1] if MEDIA in tokens else []
        for n in range(len(tokens) - 1, 0, -1):  # at least one token is left to compute
            if tuple(tokens[:n]) in self.prefixes:
                self.reserved[request_id] = self.prefixes[tuple(tokens[:n])]
                return n
        return 0

    def drop_prefix(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)

    def uncached_images(self, prompt: PromptInputs) -> tuple[int, int]:
        """Images to encode, and their pixel values: here 3 per image."""
        n = sum(item.key not in self.images for item in prompt.images) if prompt.images else prompt.num_images
        return n, 3 * n

    def held_bytes(self) -> int:
        return 0  # the stores' share of the KV budget: tested on the real caches (test_engine_mm_prefix.py)

    def release(self, n_bytes: int) -> None:
        raise AssertionError("nothing is held, so nothing is ever released")


def _step(s: Scheduler, sampled: dict[str, int] | None = None, errors: dict[str, str] | None = None,
          lengths: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """One engine step: plan, then apply what a runner would return (a token for each row that
    decodes, each prompt that ends and its forks, unless ``sampled`` says otherwise)."""
    plan = s.schedule()
    ends = {c.request_id for c in plan.prefill if c.final and c.end >= _prompt_len(s, c.request_id)}
    forks = {f for c in plan.prefill if c.request_id in ends for f in c.forks}  # n > 1: sampled with the prompt
    tokens = {rid: 7 for rid in ends | forks | set(plan.decode)} if sampled is None else sampled
    out = RunnerOutput({k: Sample(v) for k, v in tokens.items()}, lengths or {}, errors or {})
    return plan, s.update_from_output(plan, out)


def _prompt_len(s: Scheduler, request_id: str) -> int:
    req = s.get(request_id)
    return req.num_prompt_tokens if req is not None else 0


def _admitted(s: Scheduler) -> list[str]:
    return [n.request_id for n in s.schedule().new]


def _chunks(plan: SchedulerOutput) -> dict[str, tuple[int, int, int, int | None]]:
    return {c.request_id: (c.start, c.end, c.first_layer, c.last_layer) for c in plan.prefill}


def test_admits_up_to_batch_size_each_step():
    reqs = [_req(f"r{i}") for i in range(3)]
    s = _scheduler(*reqs, batch=2)
    plan = s.schedule()
    assert [n.request_id for n in plan.new] == ["r0", "r1"] == plan.encode_ids  # text prompts: embed and prefill
    assert [c.request_id for c in plan.prefill] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 1 and reqs[2].status is RequestStatus.WAITING


def test_a_freed_slot_is_filled_at_the_next_step_and_the_runner_told_to_forget():
    a, b = _req("a"), _req("b")
    s = _scheduler(a, b, batch=1)
    _step(s)
    plan, _ = _step(s)
    assert plan.decode == ["a"] and plan.num_scheduled_tokens == {"a": 1}
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    plan, _ = _step(s)
    assert plan.finished == ["a"] and [c.request_id for c in plan.prefill] == ["b"] and plan.decode == []
    assert b.status is RequestStatus.RUNNING and s.schedule().finished == []  # said once


def test_decode_and_prefill_share_a_step():
    a, b = _req("a"), _req("b")
    s = _scheduler(a)
    _step(s)
    s.add(b)
    plan, _ = _step(s)
    assert plan.decode == ["a"] and [c.request_id for c in plan.prefill] == ["b"]
    assert plan.num_scheduled_tokens == {"a": 1, "b": 10}


def test_two_long_prompts_share_the_budget_exactly():
    """Two 300-token prompts against a 512 budget: 300 + 212, then the last 88."""
    a, b = _req("a", prompt_len=300), _req("b", prompt_len=300)
    s = _scheduler(a, b, budget=512, holds_rows=False)  # the budget alone (the join gate: below)
    plan, updates = _step(s)
    assert plan.num_scheduled_tokens == {"a": 300, "b": 212} and plan.num_prefill_tokens == 512
    assert (a.num_computed_tokens, b.num_computed_tokens) == (300, 212)
    assert [u.request.request_id for u in updates] == ["a"]  # only a finished its prompt
    plan, _ = _step(s)
    assert plan.decode == ["a"] and plan.num_scheduled_tokens == {"a": 1, "b": 88}


def test_budget_limits_requests_per_step():
    reqs = [_req(f"r{i}", prompt_len=10) for i in range(5)]
    plan, _ = _step(_scheduler(*reqs, budget=25))
    assert plan.num_scheduled_tokens == {"r0": 10, "r1": 10, "r2": 5}


def test_an_unsplittable_prompt_over_budget_goes_by_layers():
    """700 positions through 6 layers, 512 tokens a step: 4 layers (467 tokens' worth), then the last 2."""
    big, small = _req("big", prompt_len=700, chunkable=False), _req("small", prompt_len=10)
    s = _scheduler(big, small, budget=512, num_layers=6, holds_rows=False)
    plan, updates = _step(s)
    assert _chunks(plan) == {"big": (0, 700, 0, 4), "small": (0, 10, 0, None)}  # small fits in the 45 left
    assert (big.num_computed_layers, big.num_computed_tokens, big.prefill_done) == (4, 0, False)
    assert [u.request.request_id for u in updates] == ["small"]  # no token for a piece
    plan, updates = _step(s)
    assert _chunks(plan) == {"big": (0, 700, 4, None)} and plan.decode == ["small"]
    assert big.prefill_done and big.num_computed_layers == 0 and {u.request.request_id for u in updates} == {
        "big", "small"}


def test_a_layer_piece_runs_at_least_one_layer_and_only_starts_where_allowed():
    big = _req("big", prompt_len=5000, chunkable=False)
    s = _scheduler(big, budget=16, num_layers=6, layer_starts=(0, 1, 2))
    pieces = []
    while not big.prefill_done:
        plan, _ = _step(s)
        pieces += [(c.first_layer, c.last_layer) for c in plan.prefill]
    assert pieces == [(0, 1), (1, 2), (2, None)]  # shared-KV readers run with what they read


def test_an_unsplittable_prompt_after_a_reused_prefix_goes_whole():
    """Layer pieces start at position 0; after a cached prefix the rest runs whole, alone if need be."""
    req = _req("r", prompt_len=100, chunkable=False)
    s = _scheduler(req, budget=16, num_layers=4, caches=FakeCaches({tuple(range(40)): "kv"}))
    plan, _ = _step(s)
    assert _chunks(plan) == {"r": (40, 100, 0, None)}


def test_an_unsplittable_prompt_gives_up_a_prefix_shorter_than_a_steps_floor_to_go_by_layers():
    """A chat template's opening before an image (8 tokens) is computed again while a stream decodes: kept,
    it would leave the rest to run whole in one step. With nothing decoding it is kept."""
    caches = FakeCaches({tuple(range(8)): "kv"})
    s = _scheduler(budget=512, stream_prefill_chunk=16, num_layers=4, caches=caches)
    _decoding(s)
    s.add(req := _req("r", prompt_len=100, chunkable=False))
    plan, _ = _step(s)
    assert plan.new[0].num_cached == 0 and caches.reserved == {} and _chunks(plan)["r"] == (0, 100, 0, 1)
    idle = _scheduler(_req("r", prompt_len=100, chunkable=False), num_layers=4, caches=FakeCaches({tuple(range(8)): "kv"}))
    plan, _ = _step(idle)
    assert plan.new[0].num_cached == 8 and _chunks(plan) == {"r": (8, 100, 0, None)}
    assert req.num_cached_tokens == 0


def test_one_prompt_goes_by_layers_at_a_time():
    a, b = _req("a", prompt_len=600, chunkable=False), _req("b", prompt_len=600, chunkable=False)
    s = _scheduler(a, b, budget=300, num_layers=4)
    plan, _ = _step(s)
    assert _chunks(plan) == {"a": (0, 600, 0, 2)}
    plan, _ = _step(s)
    assert _chunks(plan) == {"a": (0, 600, 2, None)}  # b would fit the 0 left by no layer
    plan, _ = _step(s)
    assert _chunks(plan) == {"b": (0, 600, 0, 2)}


def test_an_unsplittable_prompt_that_does_not_fit_waits_and_nobody_overtakes_it():
    image, text = _req("image", prompt_len=300, chunkable=False), _req("text", prompt_len=5)
    s = _scheduler(_req("head", prompt_len=500), image, text, budget=512, num_layers=6)
    plan, _ = _step(s)
    assert plan.num_scheduled_tokens == {"head": 500}  # 12 left: not one of image's 50-token layers


def _decoding(s: Scheduler) -> Request:
    """A text stream that is decoding: the scheduler's steps are bounded from now on."""
    stream = _req("stream", prompt_len=4, max_tokens=1000)
    s.add(stream)
    _step(s)
    assert stream.prefill_done
    return stream


def test_while_nothing_decodes_every_image_is_encoded_and_the_full_budget_runs():
    reqs = [_req(f"i{i}", images=(f"k{i}",)) for i in range(3)]
    s = _scheduler(*reqs, budget=512, stream_prefill_chunk=16, encoder_budget=1)
    plan, _ = _step(s)
    assert plan.encode_ids == ["i0", "i1", "i2"]
    plan, _ = _step(s)
    assert plan.num_prefill_tokens == 30 and plan.prefill_groups == [["i0", "i1", "i2"]]


def test_while_a_stream_decodes_steps_take_the_stream_budgets():
    s = _scheduler(budget=512, stream_prefill_chunk=16, encoder_budget=1)
    _decoding(s)
    reqs = [_req(f"i{i}", prompt_len=12, images=(f"k{i}",)) for i in range(3)]
    text = _req("text", prompt_len=40)
    for r in (*reqs, text):
        s.add(r)
    plan, _ = _step(s, lengths={"i0": 12})
    assert plan.decode == ["stream"] and plan.encode_ids == ["text", "i0"]  # one image; text costs none
    assert _chunks(plan) == {"text": (0, 16, 0, None)}
    assert reqs[0].encoded and reqs[0].num_prompt_tokens == 12  # the embedding's length is the prompt's
    plan, _ = _step(s)
    assert plan.encode_ids == ["i1"] and _chunks(plan) == {"i0": (0, 12, 0, None), "text": (16, 20, 0, None)}
    plan, _ = _step(s)
    assert plan.encode_ids == ["i2"] and s.stream_tokens == 16


def test_a_burst_goes_at_the_full_budget_while_its_first_prompts_decode():
    """Prompts ready before a stream's first token are its cohort and do not bound its steps; a prompt
    that arrived after it does, and the cohort's work counts against it."""
    reqs = [_req(f"r{i}", prompt_len=40) for i in range(4)]
    s = _scheduler(*reqs, budget=100, stream_prefill_chunk=16, holds_rows=False)
    plan, _ = _step(s)
    assert plan.num_scheduled_tokens == {"r0": 40, "r1": 40, "r2": 20}
    late = _req("late", prompt_len=40)  # after r0's and r1's first tokens
    s.add(late)
    plan, _ = _step(s)
    assert plan.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 20, "r3": 40}  # late: 16 - 60 spent, waits
    plan, _ = _step(s)
    assert plan.decode == ["r0", "r1", "r2", "r3"] and _chunks(plan) == {"late": (0, 16, 0, None)}


def test_images_of_a_burst_encode_together_and_a_later_one_waits_for_the_stream_budget():
    s = _scheduler(budget=512, stream_prefill_chunk=16, encoder_budget=1)
    burst = [_req(f"b{i}", images=(f"k{i}",)) for i in range(3)]  # ready before the stream's first token
    _decoding(s)
    late = _req("late", images=("z",))
    for r in (*burst, late):
        s.add(r)
    plan, _ = _step(s, lengths={"b0": 10, "b1": 10, "b2": 10})
    assert plan.decode == ["stream"] and plan.encode_ids == ["b0", "b1", "b2"]
    plan, _ = _step(s)
    assert plan.num_prefill_tokens == 30 and plan.encode_ids == []  # the burst's prompts; late: 16 - 30 left
    plan, _ = _step(s)
    assert plan.encode_ids == ["late"] and plan.decode == ["stream", "b0", "b1", "b2"]


def test_while_a_stream_decodes_one_image_goes_a_few_tower_blocks_a_step():
    """An image costs 64 tokens' time over 8 blocks; 16 tokens a step pay for 2 blocks, and nothing
    else is encoded or prefilled in those steps."""
    s = _scheduler(stream_prefill_chunk=16, vision_blocks=8)
    s.pixel_tokens = 64 / 3  # the fake's images have 3 pixel values
    _decoding(s)
    a, b = _req("a", images=("x",)), _req("b", images=("y",))
    s.add(a)
    s.add(b)
    pieces = []
    while not a.encoded:
        plan, _ = _step(s)
        assert plan.decode == ["stream"] and not plan.prefill
        pieces += [(c.request_id, c.first_block, c.last_block) for c in plan.encode]
    assert pieces == [("a", 0, 2), ("a", 2, 4), ("a", 4, 6), ("a", 6, None)]
    plan, _ = _step(s)
    assert _chunks(plan) == {"a": (0, 10, 0, None)} and plan.encode == []  # a first; 6 tokens pay for no block
    plan, _ = _step(s)
    assert [(c.request_id, c.first_block, c.last_block) for c in plan.encode] == [("b", 0, 2)]


def test_an_image_costs_by_its_pixels():
    """The tower's time follows pixel values: a four times bigger picture goes in smaller pieces."""
    s = _scheduler(stream_prefill_chunk=16, vision_blocks=8)
    s.pixel_tokens = 64 / 3  # a 3-value image costs 64 tokens' time
    _decoding(s)
    small, big = _req("small", images=("x",)), _req("big", images=("y",))
    big.prompt.arrays["pixel_values"] = np.zeros((1, 12))
    for r in (small, big):
        s.add(r)
    plan, _ = _step(s)
    assert [(c.first_block, c.last_block) for c in plan.encode] == [(0, 2)]  # 16 tokens: 2 of 8 blocks
    while not small.encoded:
        _step(s)
    _step(s)  # small's prefill
    plan, _ = _step(s)
    assert [(c.request_id, c.first_block, c.last_block) for c in plan.encode] == [("big", 0, 1)]  # 256: 1 block


def test_an_image_the_vision_cache_holds_costs_no_encoder_budget():
    s = _scheduler(encoder_budget=1, caches=FakeCaches(images={"seen"}))
    _decoding(s)
    for r in (_req("a", images=("x",)), _req("b", images=("seen", "seen")), _req("c", images=("y",))):
        s.add(r)
    assert s.schedule().encode_ids == ["a", "b"]


def test_the_first_image_prompt_goes_whatever_its_cost():
    s = _scheduler(encoder_budget=2)
    _decoding(s)
    s.add(_req("many", images=("a", "b", "c")))
    s.add(_req("one", images=("d",)))
    assert s.schedule().encode_ids == ["many"]


def test_a_text_prefix_is_looked_up_at_admission_and_stored_at_the_end_of_its_prompt():
    """The plan says how much is cached (ids and counts); the caches hold the prefix for the runner."""
    caches = FakeCaches({tuple(range(6)): "kv"})
    text, image = _req("text", prompt_len=10), _req("image", prompt_len=10, images=("k",))
    s = _scheduler(text, image, budget=2, caches=caches, holds_rows=False)
    plan = s.schedule()
    assert [(n.request_id, n.num_cached) for n in plan.new] == [("text", 6), ("image", 0)]
    assert caches.reserved == {"text": "kv"}
    assert text.num_cached_tokens == text.num_computed_tokens == 6
    assert plan.prefill == [PrefillChunk("text", 6, 8)]
    s.update_from_output(plan, RunnerOutput())
    plan = s.schedule()
    assert plan.prefill == [PrefillChunk("text", 8, 10, store_prefix=True)]


def test_an_image_prompt_reuses_the_text_before_its_image_and_stores_nothing_without_its_own_store():
    """The caches decide how much of a prompt with images a stored text prefix serves (the text before its
    first image): the scheduler asks them for every prompt, and plans no store where the prompt's own store
    is off (the image-keyed cache is opt-in)."""
    req = _req("image", prompt_len=10, images=("k",))
    req.prompt = replace(req.prompt, input_ids=[0, 1, 2, 3, 4, 5, 6, MEDIA, MEDIA, 9])
    caches = FakeCaches({tuple(range(7)): "kv"})
    s = _scheduler(req, caches=caches)
    plan, _ = _step(s)
    assert [(n.request_id, n.num_cached) for n in plan.new] == [("image", 7)]
    assert caches.reserved == {"image": "kv"} and plan.encode_ids == ["image"]
    plan, _ = _step(s)
    assert plan.prefill == [PrefillChunk("image", 7, 10, store_prefix=False)]


def test_whole_prompts_starting_together_share_a_forward():
    a, b, c, d = _req("a", 4), _req("b", 6), _req("c", 600), _req("d", 3)
    d.batchable = False
    plan = _scheduler(a, b, c, d, budget=512).schedule()
    assert plan.prefill_groups == [["a", "b"]]  # c is cut by the budget, d may not share


def test_results_of_a_step_update_each_request():
    a, b, c = _req("a", max_tokens=2), _req("b"), _req("c")
    s = _scheduler(a, b, c)
    _, updates = _step(s, sampled={"a": 5, "b": 2}, errors={"c": "RuntimeError: boom"})
    by_id = {u.request.request_id: u for u in updates}
    assert (by_id["a"].token_id, by_id["a"].finish) == (5, None)
    assert (by_id["b"].token_id, by_id["b"].finish) == (None, RequestStatus.FINISHED_STOPPED)  # EOS is not output
    assert (by_id["c"].finish, by_id["c"].error) == (RequestStatus.FINISHED_ERROR, "RuntimeError: boom")
    assert s.running == [a] and a.output_token_ids == [5]
    plan, updates = _step(s, sampled={"a": 6})
    assert sorted(plan.finished) == ["b", "c"]
    assert updates[0].finish is RequestStatus.FINISHED_LENGTH and not s.has_unfinished()


def test_a_failed_encode_ends_its_request():
    img = _req("img", images=("k",))
    s = _scheduler(img)
    _, updates = _step(s, errors={"img": "ValueError: bad pixels"})
    assert [(u.finish, u.error) for u in updates] == [(RequestStatus.FINISHED_ERROR, "ValueError: bad pixels")]
    assert not img.encoded and not s.has_unfinished()


def test_finish_removes_waiting_and_running_requests():
    a, b = _req("a"), _req("b")
    s = _scheduler(a, b, batch=1)
    s.schedule()
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and a.status.finished and b.status.finished
    assert s.get("a") is None and s.schedule().finished == ["a"]  # b never reached the runner


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
    s = Scheduler(_config(), budget)
    for r in (small, big, after):
        s.add(r)
    assert _admitted(s) == ["small"]  # small + big would be 2 x 20 positions x 10 B = 400 > 300
    assert s.kv_reserved_bytes == 100
    assert _admitted(s) == []  # "after" would fit, but nobody overtakes the head of the queue
    s.finish(small, RequestStatus.FINISHED_LENGTH)
    assert _admitted(s) == ["big"]  # big + after: 2 rows x 20 positions (the longest) x 10 B = 400 > 300
    assert s.kv_reserved_bytes == 200
    s.finish(big, RequestStatus.FINISHED_STOPPED)
    assert _admitted(s) == ["after"] and s.kv_reserved_bytes == 50


def test_one_request_is_always_admitted_whatever_the_budget():
    """The API refuses a request that could never fit; the scheduler never deadlocks on one."""
    from vlmserve.engine.memory import KVBudget, KVFootprint

    s = Scheduler(_config(), KVBudget(1, KVFootprint(per_position=10)))
    s.add(_req("r", 10, 10))
    assert _admitted(s) == ["r"]


def test_a_footprint_counts_windows_and_fixed_state():
    from vlmserve.engine.memory import KVBudget, KVFootprint

    f = KVFootprint(per_position=4, windows=((2, 100),), fixed=1000)
    assert f.row_bytes(50) == 4 * 50 + 2 * 50 + 1000
    assert f.row_bytes(500) == 4 * 500 + 2 * 100 + 1000
    assert KVBudget(10_000, f).refusal(3000) is not None and KVBudget(10_000, f).refusal(10) is None
    assert KVBudget(None, f).refusal(10**9) is None


def _forked(rid: str, n: int, **kw: object) -> Request:
    """A request with ``n - 1`` forks (n > 1), as the core makes them."""
    req = _req(rid, **kw)  # type: ignore[arg-type]
    for i in range(1, n):
        fork = _req(f"{rid}-{i}", **kw)  # type: ignore[arg-type]
        fork.fork_of = rid
        req.forks.append(fork)
    return req


def test_a_request_with_forks_is_admitted_with_them_and_prefilled_once():
    big, small = _forked("n3", 3, prompt_len=40), _req("r")
    s = _scheduler(_req("first"), big, small, batch=3, budget=16)
    plan = s.schedule()
    assert [n.request_id for n in plan.new] == ["first"]  # n3 needs 3 slots, 2 are free; r may not overtake it
    assert s.num_running == 1
    _step(s)
    _step(s, {"first": 2})  # first ends (EOS): three slots free
    plan = s.schedule()
    assert [n.request_id for n in plan.new] == ["n3"] and s.num_running == 3 and plan.new[0].forks == (("n3-1", big.params), ("n3-2", big.params))
    assert [c.request_id for c in plan.prefill] == ["n3"] and "n3-1" not in plan.encode_ids  # forks are not prompts
    while not big.prefill_done:
        plan, updates = _step(s)
    (last,) = [c for c in plan.prefill if c.request_id == "n3"]
    assert last.forks == ("n3-1", "n3-2") and all(f.encoded and f.prefill_done for f in big.forks)
    assert {u.request.request_id for u in updates} >= {"n3", "n3-1", "n3-2"}
    plan, _ = _step(s)
    assert {"n3", "n3-1", "n3-2"} <= set(plan.decode)


def test_a_prompt_that_fails_before_it_forks_fails_its_forks():
    req = _forked("n2", 2, prompt_len=40)
    s = _scheduler(req, budget=16)
    s.schedule()
    plan, updates = _step(s, {}, errors={"n2": "boom"})
    assert [(u.request.request_id, u.finish) for u in updates] == [("n2", RequestStatus.FINISHED_ERROR),
                                                                  ("n2-1", RequestStatus.FINISHED_ERROR)]
    assert s.num_running == 0 and sorted(s.take_finished()) == ["n2", "n2-1"]


def test_a_cache_that_cannot_be_cut_back_is_stored_at_the_prompts_stem():
    """With ``snapshots`` (recurrent state), a prompt's chunk ends at its stem and stores there, once;
    the rest (its generation prompt) follows the next step. Without, the whole prompt stores at its end."""
    def stemmed(rid: str) -> Request:
        req = _req(rid, prompt_len=14)
        req.prompt = PromptInputs(req.prompt.input_ids, stem=10)
        return req

    caches = FakeCaches()
    s = _scheduler(stemmed("a"), caches=caches, snapshots=True)
    plan, _ = _step(s)
    assert [(c.start, c.end, c.store_prefix) for c in plan.prefill] == [(0, 10, True)]
    plan, _ = _step(s)
    assert [(c.start, c.end, c.store_prefix) for c in plan.prefill] == [(10, 14, False)]
    s = _scheduler(stemmed("b"), caches=caches)
    plan, _ = _step(s)
    assert [(c.start, c.end, c.store_prefix) for c in plan.prefill] == [(0, 14, True)]
    # a stem already computed (a reused prefix reaches past it), or a prompt without one: no snapshot
    caches.prefixes[tuple(range(12))] = "kv"
    s = _scheduler(stemmed("c"), _req("d", prompt_len=14), caches=caches, snapshots=True)
    plan, _ = _step(s)
    assert [(c.request_id, c.start, c.end, c.store_prefix) for c in plan.prefill] == [("c", 12, 14, False),
                                                                                     ("d", 12, 14, False)]


# -- the join gate and the aging budget (issue 46) --------------------------------------------------


def test_a_prompt_that_ends_before_the_others_of_its_burst_is_held_out_of_the_decode_batch():
    """Its first token goes out at once; its row joins the batch once the prompts that arrived before
    that token are in theirs, so their steps do not also decode it; the stream already running decodes
    every step meanwhile."""
    stream = _req("stream", max_tokens=50)
    s = _scheduler(stream, budget=40)
    _step(s)
    a, b = _req("a", prompt_len=30), _req("b", prompt_len=60)
    s.add(a)
    s.add(b)
    plan, updates = _step(s)
    assert [c.hold for c in plan.prefill] == [True, False] and plan.decode == ["stream"]
    assert {u.request.request_id: u.token_id for u in updates} == {"stream": 7, "a": 7}  # a's first token
    assert a.held and a.first_token_time is not None
    plan, _ = _step(s)  # b is still in its prompt: a waits, the stream decodes
    assert plan.decode == ["stream"] and plan.join == [] and a.held
    plan, _ = _step(s)
    assert plan.prefill[-1].request_id == "b" and plan.prefill[-1].end == 60 and not plan.prefill[-1].hold
    plan, _ = _step(s)  # b's prompt ended: a joins the batch, before this step's decode
    assert plan.join == ["a"] and plan.decode == ["stream", "a", "b"] and not a.held


def test_a_held_row_joins_after_its_limit_behind_a_long_prompt():
    """A long prompt behind it holds it at most HOLD_LIMIT times its own time to first token."""
    import time

    from vlmserve.engine.scheduler import HOLD_LIMIT

    short, long = _req("short", prompt_len=10), _req("long", prompt_len=10_000)
    s = _scheduler(short, long, budget=100)
    _step(s)
    assert short.held and long.num_computed_tokens == 90
    assert s.schedule().join == []
    ttft = short.first_token_time - short.arrival_time  # type: ignore[operator]
    short.first_token_time = time.monotonic() - HOLD_LIMIT * ttft - 0.01  # as if it had waited its limit
    short.arrival_time = short.first_token_time - ttft
    plan = s.schedule()
    assert plan.join == ["short"] and plan.decode == ["short"]


def test_rows_that_share_a_forward_are_not_held_and_the_gate_is_off_where_the_config_says():
    reqs = [_req(f"r{i}", prompt_len=20) for i in range(3)]
    s = _scheduler(*reqs, budget=50)
    plan, _ = _step(s)  # r0 and r1 whole (one forward), r2 in part
    assert plan.prefill_groups == [["r0", "r1"]] and not any(c.hold for c in plan.prefill)
    assert not reqs[0].held and _step(s)[0].decode == ["r0", "r1"]
    a, b = _req("a", prompt_len=30), _req("b", prompt_len=60)
    off = _scheduler(a, b, budget=40, holds_rows=False)
    _step(off)
    assert not a.held and _step(off)[0].decode == ["a"]


def test_an_aborted_held_row_is_freed_and_never_joins():
    a, b = _req("a", prompt_len=30), _req("b", prompt_len=60)
    s = _scheduler(a, b, budget=40)
    _step(s)
    assert a.held
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    plan, _ = _step(s)
    assert plan.finished == ["a"] and plan.join == [] and plan.decode == []


def test_the_prompt_share_grows_with_the_oldest_prompts_wait_up_to_its_maximum():
    from vlmserve.engine.costs import AGING_STEPS, StepCosts

    costs = StepCosts(share=2.0, floor=16, ceiling=512, max_share=4.0, prompt_token_s=0.001, decode_step_s=0.02)
    assert costs.stream_tokens() == 40  # 2 decode steps' time of 1 ms tokens
    assert costs.stream_tokens(AGING_STEPS * 0.02 / 2) == 60  # half-way to doubling
    assert costs.stream_tokens(AGING_STEPS * 0.02) == costs.stream_tokens(60.0) == 80  # capped at 4 decode steps
    slow = StepCosts(share=2.0, floor=16, ceiling=512, max_share=4.0, prompt_token_s=0.02, decode_step_s=0.1)
    assert slow.stream_tokens() == 16 and slow.stream_tokens(60.0) == 32  # the floor grows by the same factor


def test_the_scheduler_reports_the_oldest_prompt_still_in_its_prompt():
    import time

    a, b = _req("a", prompt_len=10), _req("b", prompt_len=300)
    s = _scheduler(a, b, budget=100)
    now = time.monotonic()
    a.arrival_time, b.arrival_time = now - 5.0, now - 2.0
    assert s.longest_wait(now) == 0.0  # nothing admitted yet
    _step(s)  # a's prompt ends, b's goes on
    assert s.longest_wait(now) == 2.0


def test_a_step_with_prompt_work_measures_the_prompt_token_and_leaves_the_decode_step_alone():
    """An underestimated prompt token must not read as a longer decode step (a larger budget, longer steps)."""
    from vlmserve.engine.costs import StepCosts

    costs = StepCosts(share=2.0, floor=16, ceiling=512, max_share=4.0, prompt_token_s=0.001, decode_step_s=0.02)
    for _ in range(40):
        costs.observe(0.02 + 50 * 0.003, 50, 0.0)  # prompt tokens cost 3 ms, not the 1 ms probed
    assert costs.decode_step_s == 0.02 and abs(costs.prompt_token_s - 0.003) < 1e-6
    costs.observe(0.03 + 0.01, 0, 0.01)  # a decode-only step, its vision work taken off
    assert abs(costs.decode_step_s - 0.022) < 1e-9
    costs.observe(0.5, 4, 0.0)  # too few prompt tokens to tell their cost from the step's overheads
    assert abs(costs.prompt_token_s - 0.003) < 1e-6
