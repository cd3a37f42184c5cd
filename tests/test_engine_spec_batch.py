"""Speculative decoding while prompts enter the batch together (issue 58): every drafter, drafting on
every step (``adaptive: false``), gives each request mlx-vlm's greedy tokens for its prompt alone, and
no request fails.

The drafters: ngram lookups (on Gemma 4 and Qwen3.5), Gemma 4's assistant (it reads the target's KV),
Qwen3.5's MTP (a KV of its own, filled from the target's hidden states at every prompt position) and a
DFlash drafter for Qwen3.5 (a KV of its own from two target layers' states, a block of drafts a forward)
and a draft model for Qwen2.5-VL (a text model of its tokenizer, a KV of its own from each row's text),
and an EAGLE-3 drafter for Gemma 4 (the MTP's pairs over three target layers' states, a hot vocabulary; on the
e2b variant, whose six layers give it three to read).
2-4 text and image prompts of different lengths enter at once (``_at_once`` holds the worker while they
are posted) through each way in: one grouped left-padded prefill; pieces beside a decoding row (layer
pieces where the family splits image prompts by layers, Gemma's; token chunks where it chunks them,
Qwen's); ``n`` > 1 forks; a prefix reused from memory and one read back from disk; and a row that
leaves the batch in the step others join. A spy on the runner (``_recording``) checks that each path
was taken, and that a drafter model drafts for each row what it drafts for its prompt alone (the MTP's
own KV, as each row joins, too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Result, gather, scene
from test_families import Family, _start, _stop

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import SchedulerOutput
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.inputs import PromptInputs
from vlmserve.testing import build_model

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
TEXT = "one two three four, one two three four, say it again: one two three four"
RED, BLUE = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220), size=80)
WHOLE = {"prefill_chunk": 512, "stream_prefill_chunk": 512}  # every prompt here whole in one step
PIECES = {"prefill_chunk": 512, "stream_prefill_chunk": 16}  # ...but 16 prompt tokens a step while rows decode


# -- the drafters ------------------------------------------------------------------------------

def _assistant(tmp: pytest.TempPathFactory, target: Path) -> Path:
    from vlmserve.testing.gemma4 import build_assistant
    return Path(build_assistant(target, tmp.getbasetemp() / "gemma4-assistant"))


def _mtp(tmp: pytest.TempPathFactory, target: Path) -> Path:
    """Qwen3.5's test MTP drafter, made to read the target's hidden state as well as the next token's
    embedding (the builder's drops it): a prompt's hidden states that came in wrong change its KV here."""
    import shutil

    import mlx.core as mx

    from vlmserve.testing.qwen3_5 import build_mtp

    out = tmp.getbasetemp() / "qwen3_5-mtp-hidden"
    if not out.exists():
        shutil.copytree(build_mtp(target, tmp.getbasetemp() / "qwen3_5-mtp"), out)
        weights = mx.load(str(out / "model.safetensors"))
        size = weights["fc.weight"].shape[0]
        weights["fc.weight"] = mx.concatenate([weights["fc.weight"][:, :size], 0.5 * mx.eye(size)], axis=1)
        mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def _dflash(tmp: pytest.TempPathFactory, target: Path) -> Path:
    from vlmserve.testing.qwen3_5 import build_dflash
    return build_dflash(target, tmp.getbasetemp() / f"{target.name}-dflash")


def _draft_model(tmp: pytest.TempPathFactory, target: Path) -> Path:
    """A draft model of the target's tokenizer: its first layer of two (a row decodes long enough beside the
    prompts that come in pieces; the one of every layer drafts the target's tokens, test_engine_draft_model.py)."""
    from vlmserve.testing.draft_model import build_draft_model
    return build_draft_model(target, tmp.getbasetemp() / f"{target.name}-draft-model", layers=1)


def _eagle3(tmp: pytest.TempPathFactory, target: Path) -> Path:
    from vlmserve.testing.eagle3 import build_eagle3
    return build_eagle3(target, tmp.getbasetemp() / f"{target.name}-eagle3")


# name -> (the target's family[:variant], its drafter model's builder; None: ngram lookups); the name's first
# word is the method (the assistant's is mtp's)
KINDS: dict[str, tuple[str, Callable[[pytest.TempPathFactory, Path], Path] | None]] = {
    "ngram-gemma4": ("gemma4", None), "ngram-qwen3_5": ("qwen3_5", None),
    "assistant-gemma4": ("gemma4", _assistant), "mtp-qwen3_5": ("qwen3_5", _mtp),
    "dflash-qwen3_5": ("qwen3_5", _dflash), "dflash-gemma4": ("gemma4", _dflash),
    "draft_model-qwen2_5_vl": ("qwen2_5_vl", _draft_model), "eagle3-gemma4": ("gemma4:e2b", _eagle3)}


@dataclass(slots=True, frozen=True)
class Kind:
    target: Path
    config: SpeculativeConfig

    def start(self, **config: Any) -> Family:
        return _start(self.target, speculative=self.config, **config)


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Kind:
    arch, build = KINDS[request.param]
    arch, _, variant = arch.partition(":")
    target = Path(build_model(arch, "micro", variant=variant))
    if build is None:
        return Kind(target, SpeculativeConfig(prompt_lookup_min=1, adaptive=False))  # a draft wherever a token repeats
    method = {"assistant": "mtp"}.get(word := request.param.split("-")[0], word)
    return Kind(target, SpeculativeConfig(method=method, model=str(build(tmp_path_factory, target)), adaptive=False))


@pytest.fixture(scope="module")
def plain(kind: Kind) -> Iterator[Family]:
    """An engine without prefix caches (every prompt starts at position 0, so whole prompts group)."""
    started = kind.start(prefix_cache=False, **WHOLE)
    yield started
    _stop(started)


# -- prompts, and how they arrive ------------------------------------------------------------

def _prompt(family: Family, tag: str, text: str, images: list[Any] = ()) -> PromptInputs:
    """A prompt of its own: ``tag`` opens it, so that no other test's cached prefix fits it."""
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    return family.engine.prompter.build([{"role": "system", "content": f"{tag}: answer briefly."},
                                         {"role": "user", "content": parts}], list(images))


def _four(family: Family, tag: str) -> list[PromptInputs]:
    """Two texts and two images, of four lengths."""
    return [_prompt(family, tag, TEXT), _prompt(family, tag, "hi"), _prompt(family, tag, "describe it", [RED]),
            _prompt(family, tag, "what is this? " + TEXT, [BLUE])]


async def _at_once(family: Family, requests: list[Awaitable[Any]]) -> list[Any]:
    """The requests, posted while the worker waits: its next step takes them all."""
    gate = threading.Event()
    family.engine.worker.submit(gate.wait)
    tasks = [asyncio.ensure_future(r) for r in requests]
    await asyncio.sleep(0)  # each task runs to its post (a ready prompt has no phase 1 to wait for)
    gate.set()
    return list(await asyncio.gather(*tasks))


def _params(family: Family, prompts: list[PromptInputs], lengths: list[int] | None = None) -> list[SamplingParams]:
    """Greedy, ``lengths`` tokens each (10 by default). Without a drafter model, every other request
    also predicts its output (one token wrong, one left out): token drafts on most of its steps, beside
    rows that draft only where a token repeats (ngram lookups)."""
    params = [dataclasses.replace(GREEDY, max_tokens=n) for n in lengths or [GREEDY.max_tokens] * len(prompts)]
    if family.engine.loaded.drafter is not None:
        return params
    return [dataclasses.replace(q, prediction=_edited(family.reference(p, q.max_tokens))) if i % 2 else q
            for i, (p, q) in enumerate(zip(prompts, params))]


def _edited(tokens: list[int]) -> tuple[int, ...]:
    return (*tokens[:3], *[(t + 1) % 100 for t in tokens[3:4]], *tokens[4:7], *tokens[8:])


async def _result(family: Family, request_id: str, prompt: PromptInputs, params: SamplingParams) -> Result:
    return await gather(family.engine.generate(request_id, prompt, params))


def _all_at_once(family: Family, tag: str, prompts: list[PromptInputs], params: list[SamplingParams]) -> list[Result]:
    """The prompts as requests ``{tag}{i}``, at once; each one's result."""
    return family.run(_at_once(family, [_result(family, f"{tag}{i}", *a) for i, a in enumerate(zip(prompts, params))]))


async def _forked(family: Family, request_id: str, prompt: PromptInputs, n: int, params: SamplingParams
                  ) -> list[Result]:
    """``n`` rows of one prompt: the request, then its forks (``{request_id}-{i}``)."""
    forks = [(f"{request_id}-{i}", params) for i in range(1, n)]
    first = family.engine.generate(request_id, prompt, params, forks)
    head = await first.__anext__()  # the prompt reached the engine: the forks' streams exist
    rows = await asyncio.gather(gather(first), *(gather(family.engine.follow(f, p)) for f, p in forks))
    rows[0].token_ids[:0] = head.token_ids
    return list(rows)


def _check(family: Family, prompts: list[PromptInputs], params: list[SamplingParams], results: list[Result]) -> None:
    """No request failed, and each gave mlx-vlm's greedy tokens for its prompt alone."""
    assert [r.error for r in results] == [None] * len(results)
    assert [r.token_ids for r in results] == [family.reference(p, q.max_tokens) for p, q in zip(prompts, params)]


# -- what the runner and the drafter did -------------------------------------------------------

@dataclass(slots=True)
class _Step:
    plan: SchedulerOutput
    before: list[str]  # the decode batch's rows as the step began
    after: list[str]

    @property
    def joined(self) -> set[str]:
        return set(self.after) - set(self.before)

    @property
    def left(self) -> set[str]:
        return set(self.before) - set(self.after)


@dataclass(slots=True)
class _Record:
    steps: list[_Step] = field(default_factory=list)
    drafts: dict[str, list[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)  # per request: input, draft
    kv: dict[str, np.ndarray] = field(default_factory=dict)  # the MTP's own KV of each row as it joined


@contextmanager
def _recording(family: Family, after: Callable[[_Step], None] | None = None) -> Iterator[_Record]:
    """Each step the runner executes while open (``after``, on the worker, once each is done), each
    drafter model's drafts, and the MTP's rows as they join. The real methods run; the worker is idle
    between the tests' scenarios, when the spies are put in and taken out."""
    core, drafter, record = family.engine.core, family.engine.loaded.drafter, _Record()
    assert core is not None
    runner = core.runner
    execute = runner.execute

    def step(plan: SchedulerOutput) -> Any:
        before = list(runner.batch.request_ids)
        out = execute(plan)
        record.steps.append(done := _Step(plan, before, list(runner.batch.request_ids)))
        record.kv.update({rid: _own_kv(runner.batch, rid) for rid in done.joined if runner.batch.draft is not None})
        if after is not None:
            after(done)
        return out

    runner.execute = step  # type: ignore[method-assign]
    if drafter is not None:
        draft = drafter.draft

        def drafted(batch: Any, rows: list[int], inputs: list[int], k: int) -> Any:
            out = draft(batch, rows, inputs, k)
            for i, d in out.items():
                record.drafts.setdefault(batch.request_ids[i], []).append((inputs[i], tuple(d)))
            return out

        drafter.draft = drafted  # type: ignore[method-assign]
    try:
        yield record
    finally:
        del runner.execute
        if drafter is not None:
            del drafter.draft


def _own_kv(batch: Any, request_id: str) -> np.ndarray:
    """A row's entries in the MTP drafter's KV, in the order written: ``[layers, kv heads, entries, dim]``."""
    rows, i = getattr(batch.draft, "kv", batch.draft), batch.request_ids.index(request_id)  # a draft model's: .kv
    valid = np.asarray(rows.valid[i, :rows.size])
    return np.stack([np.asarray(k[i, :, :rows.size])[:, valid] for k in rows.keys])


def _same_drafting(alone: _Record, together: _Record, pairs: dict[str, str]) -> None:
    """A drafter model drafts for a row in a batch what it drafts for its prompt alone, and the MTP's
    own KV of the row is the lone prompt's (``pairs``: the batched request -> the lone one). A batch
    drafts as many tokens as its widest row may keep: the first ones agree."""
    def cut(calls: list[Any], other: list[Any]) -> list[Any]:
        return [(i, d[:len(e)]) for (i, d), (_, e) in zip(calls, other)]

    for batched, lone in pairs.items():
        ours, theirs = together.drafts.get(batched, []), alone.drafts.get(lone, [])
        assert len(ours) == len(theirs) and cut(ours, theirs) == cut(theirs, ours), (batched, ours, theirs)
        if lone in alone.kv:  # float32 from target forwards of other shapes (a prompt in chunks: 2.1e-5 apart)
            np.testing.assert_allclose(together.kv[batched], alone.kv[lone], rtol=1e-4, atol=1e-4, err_msg=batched)


def _alone(family: Family, prompts: list[PromptInputs], params: list[SamplingParams]) -> _Record:
    """Each prompt alone (``a{i}``), checked against the reference: what its drafter did. Rows drafted
    (with a drafter model, each one with room for a draft)."""
    m0 = family.engine.metrics
    with _recording(family) as record:
        results = [family.run(_result(family, f"a{i}", p, q)) for i, (p, q) in enumerate(zip(prompts, params))]
    _check(family, prompts, params, results)
    m = family.engine.metrics
    assert m is not None and m0 is not None and m.spec_drafts > m0.spec_drafts
    if family.engine.loaded.drafter is not None:
        assert all(record.drafts.get(f"a{i}") for i, q in enumerate(params) if q.max_tokens > 2), record.drafts
    return record


# -- the ways in ---------------------------------------------------------------------------------

def test_prompts_prefilled_in_one_grouped_forward(plain: Family) -> None:
    """The issue's crash: two texts and two images at once, whole prompts in left-padded forwards."""
    prompts = _four(plain, "grouped")
    params = _params(plain, prompts)
    alone = _alone(plain, prompts, params)
    with _recording(plain) as together:
        results = _all_at_once(plain, "g", prompts, params)
    _check(plain, prompts, params, results)
    _same_drafting(alone, together, {f"g{i}": f"a{i}" for i in range(4)})
    groups = [g for s in together.steps for g in s.plan.prefill_groups]
    assert {"g0", "g1"} in map(set, groups) and {"g2", "g3"} in map(set, groups), groups  # images: a step later


def test_prompts_in_pieces_beside_a_decoding_row(kind: Kind) -> None:
    """A row decodes while a text and two images come: each step gives them 16 prompt tokens, so they
    go in pieces (by layers where the family splits image prompts so, else by tokens) and their rows
    wait for each other at the join gate."""
    family = kind.start(prefix_cache=False, **PIECES)
    try:
        prompts = _four(family, "pieces")
        params = _params(family, prompts, [30, 10, 10, 10])
        alone = _alone(family, prompts, params)

        async def scenario() -> list[Result]:
            first = family.engine.generate("p0", prompts[0], params[0])
            head = await first.__anext__()  # it decodes now: the others get the streaming budget
            rest = await _at_once(family, [_result(family, f"p{i}", prompts[i], params[i]) for i in (1, 2, 3)])
            tail = await gather(first)
            tail.token_ids[:0] = head.token_ids
            return [tail, *rest]

        with _recording(family) as together:
            results = family.run(scenario())
        _check(family, prompts, params, results)
        _same_drafting(alone, together, {f"p{i}": f"a{i}" for i in range(4)})
        by_layers = not family.engine.loaded.adapter.can_chunk(prompts[2])
    finally:
        _stop(family)
    chunks = [c for s in together.steps for c in s.plan.prefill]
    for image in ("p2", "p3"):
        pieces = [c for c in chunks if c.request_id == image]
        assert len(pieces) > 1 and (not by_layers or not pieces[0].final), pieces
    assert any(s.plan.join for s in together.steps)  # rows held at the join gate, then joined


def test_forks_enter_with_other_prompts(plain: Family) -> None:
    """``n`` > 1 beside other prompts, at once: a text with 3 rows, an image with 2, an image with 1."""
    prompts = _four(plain, "forks")[1:]
    params = _params(plain, prompts)
    alone = _alone(plain, prompts, params)

    async def scenario() -> list[list[Result]]:
        return await _at_once(plain, [_forked(plain, f"f{i}", p, n, q)
                                      for i, (p, n, q) in enumerate(zip(prompts, (3, 2, 1), params))])

    with _recording(plain) as together:
        forked = plain.run(scenario())
    for p, q, rows in zip(prompts, params, forked):
        _check(plain, [p] * len(rows), [q] * len(rows), rows)
    _same_drafting(alone, together, {row: f"a{i}" for i, n in enumerate((3, 2, 1))
                                     for row in [f"f{i}", *(f"f{i}-{j}" for j in range(1, n))]})
    assert {"f0-1", "f0-2", "f1-1"} <= {f for s in together.steps for c in s.plan.prefill for f in c.forks}


def _turn_two(family: Family, tag: str, text: str, images: list[Any]) -> tuple[PromptInputs, PromptInputs]:
    """A chat's first prompt, and its second after the greedy reply: it reuses the first's prefix."""
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    first = [{"role": "system", "content": f"{tag}: answer briefly."}, {"role": "user", "content": parts}]
    turn1 = family.engine.prompter.build(first, list(images))
    reply = family.engine.prompter.detokenize(family.reference(turn1, 8))
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "again, " + TEXT}]
    return turn1, family.engine.prompter.build(second, list(images))


def test_prefixes_reused_from_memory_and_from_disk(kind: Kind, tmp_path: Path) -> None:
    """Two chats' second turns reuse their first turns' KV beside two fresh prompts, at once: from
    memory, then on a restarted engine from the files the first wrote at shutdown (``prefix_cache_dir``)."""
    config = {"mm_prefix_cache": True, "prefix_cache_dir": str(tmp_path), **WHOLE}
    family = kind.start(**config)
    try:
        (text1, text2), (image1, image2) = _turn_two(family, "chat", TEXT, []), _turn_two(family, "chat", "hi", [RED])
        params = _params(family, [text1, image1])
        _check(family, [text1, image1], params, _all_at_once(family, "t", [text1, image1], params))
        prompts = [text2, image2, _prompt(family, "fresh", "hi"), _prompt(family, "fresh", "what? " + TEXT, [BLUE])]
        params = _params(family, prompts)
        hits = _all_at_once(family, "m", prompts, params)
        _check(family, prompts, params, hits)
    finally:
        _stop(family)
    family = kind.start(**config)
    try:
        prompts = [text2, image2, _prompt(family, "fresh2", TEXT), _prompt(family, "fresh2", "describe it", [BLUE])]
        params = _params(family, prompts)
        again = _all_at_once(family, "d", prompts, params)
        _check(family, prompts, params, again)
        disk = family.run(family.engine.stats()).disk
    finally:
        _stop(family)
    # the chats reuse their first turns from memory, then nearly all of themselves from disk; the fresh
    # prompts at most their template's opening
    assert [r.num_cached_tokens >= len(t) - 4 for r, t in zip(hits, [text1, image1])] == [True, True]
    assert [r.num_cached_tokens >= 0.9 * r.num_prompt_tokens for r in again[:2]] == [True, True]
    assert max(r.num_cached_tokens for r in [*hits[2:], *again[2:]]) < 16
    assert disk is not None and disk.hits >= 2


def test_a_row_leaves_the_batch_in_the_step_others_join(plain: Family) -> None:
    """A row of two tokens joins the batch; one, two or three steps later a text and an image arrive,
    and join together a step after (the image is encoded first): in the step they join, the row's last
    token comes, or the row leaves the batch."""
    prompts = _four(plain, "leave")[1:]
    params = _params(plain, prompts, [2, 10, 10])
    alone = _alone(plain, prompts, params)
    seen = set()
    for wait in (1, 2, 3):
        with _recording(plain, after := _Pause(plain, "l0", wait)) as together:
            results = plain.run(_arriving(plain, after, prompts, params))
        _check(plain, prompts, params, results)
        _same_drafting(alone, together, {f"l{i}": f"a{i}" for i in range(3)})
        (join,) = [s for s in together.steps if s.joined >= {"l1", "l2"}]
        seen |= {"last token"} if "l0" in join.before and "l0" in join.after else set()
        seen |= {"left"} if join.left == {"l0"} else set()
    assert seen == {"last token", "left"}


class _Pause:
    """After the step ``wait`` steps into ``row``'s life in the batch, the worker waits while the loop
    posts more requests (``resume`` lets it go on)."""

    def __init__(self, family: Family, row: str, wait: int) -> None:
        self.row, self.wait, self.steps = row, wait, -1
        self.loop = family.loop
        self.paused: asyncio.Future[None] = family.loop.create_future()
        self.resume = threading.Event()

    def __call__(self, step: _Step) -> None:  # on the worker
        if self.row in step.joined or self.steps >= 0:
            self.steps += 1
        if self.steps == self.wait - 1:
            self.loop.call_soon_threadsafe(self.paused.set_result, None)
            self.resume.wait()


async def _arriving(family: Family, pause: _Pause, prompts: list[PromptInputs], params: list[SamplingParams]
                    ) -> list[Result]:
    row = asyncio.ensure_future(_result(family, "l0", prompts[0], params[0]))
    await asyncio.wait([pause.paused, row], return_when=asyncio.FIRST_COMPLETED)
    assert pause.paused.done(), "the row ended before its pause"
    later = [asyncio.ensure_future(_result(family, f"l{i}", p, q)) for i, (p, q) in enumerate(zip(prompts, params))
             if i]
    await asyncio.sleep(0)  # posted
    pause.resume.set()
    return [await row, *await asyncio.gather(*later)]
