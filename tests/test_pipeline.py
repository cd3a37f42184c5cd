"""One model across two ranks: ``mlx.launch --backend ring -n 2 -- vlmserve serve`` on loopback.

Each family's model runs split (rank 1 the first layers, rank 0 the rest, the vision tower and the
head) beside a single-process server on the same model, prefix cache off on both: greedy tokens
must be the single process's, alone and in a batch of 8. Then the faults: a rank killed or stopped
mid-stream, ranks that disagree, and SIGTERM's drain.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from conftest import scene
from PIL import Image
from server_utils import PipelineProcess, free_port, image_data_url, start_pipeline, start_server, wait_for

from vlmserve.engine.caches import EngineCaches
from vlmserve.engine.loader import load_model
from vlmserve.engine.models import Embedded
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.pipeline import PipelineError, Stage, split_layers
from vlmserve.engine.pipeline_runner import STOP, Follower, Leader, Link, StepMessage, Watch, for_followers
from vlmserve.engine.plan import EncodeChunk, NewRequest, PrefillChunk, SchedulerOutput
from vlmserve.engine.runner import ModelRunner
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.inputs import ImageItem, PromptInputs
from vlmserve.preprocess.prompt import PromptBuilder
from vlmserve.testing import build_family, build_model
from vlmserve.testing.build import ARCHS

# (build, size): every family's micro model, and a Gemma 4 whose last 2 of 6 layers read layers 2 and 3's KV
# (E2B/E4B's shared KV)
FAMILIES = [*((arch, "micro") for arch in ARCHS), ("gemma4/e2b", "small")]
ONE_IMAGE = {"paligemma", "llava_next"}  # what these families' mlx-vlm models take
ROOT = Path(__file__).resolve().parents[1]
IMAGES = [image_data_url(scene("circle", (220, 30, 30))), image_data_url(scene("square", (30, 30, 220)))]


def _id(family: tuple[str, str]) -> str:
    name, size = family
    return f"{name.replace('/', '-')}-{size}"


@pytest.fixture(scope="module", params=FAMILIES, ids=_id)
def pair(request, tmp_path_factory):
    """A two-rank server and a single-process one on the same model."""
    name, size = request.param
    path = str(build_family(name, size))
    logs = tmp_path_factory.mktemp(f"pipeline-{_id(request.param)}")
    single = start_server(["--model", path, "--no-prefix-cache"], logs / "single.log")
    try:
        split = start_pipeline(["--model", path], logs / "split.log")
    except BaseException:
        single.stop()  # a launch that failed must not leave the other server behind
        raise
    yield path, single, split, 1 if name in ONE_IMAGE else 2
    single.stop()
    assert split.stop() == 0, split.log


def _chat(server: Any, model: str, text: str, images: int = 0, max_tokens: int = 16) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": IMAGES[i]}} for i in range(images)]
    body = {"model": model, "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"tokens": [t["token"] for t in choice["logprobs"]["content"]],
            "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
            "text": (choice["message"].get("reasoning_content") or "") + (choice["message"]["content"] or "")}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same greedy tokens; logprobs equal to float noise (Qwen3.5's differ by ~1e-6 in a batch)."""
    close = len(a["logprobs"]) == len(b["logprobs"]) and np.allclose(a["logprobs"], b["logprobs"], atol=1e-4)
    return a["tokens"] == b["tokens"] and a["text"] == b["text"] and close


@pytest.mark.parametrize("images", [0, 1, 2])
def test_greedy_tokens_equal_the_single_process_engine(pair, images):
    model, single, split, most = pair
    if images > most:
        pytest.skip(f"the family takes at most {most} image")
    text = ["Say something about the weather.", "What is in the picture?", "Compare the two pictures."][images]
    alone, across = _chat(single, model, text, images), _chat(split, model, text, images)
    assert alone["tokens"], alone
    assert _same(across, alone), (across, alone)


def test_eight_mixed_requests_batched_across_ranks_match_each_alone(pair):
    model, single, split, most = pair
    mixed = [(f"Request {i}: " + "more words " * (3 * i), min(i % 3, most), 6 + 2 * i) for i in range(8)]
    alone = [_chat(single, model, *m) for m in mixed]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda m: _chat(split, model, *m), mixed))
    assert [_same(a, b) for a, b in zip(together, alone)] == [True] * 8


def test_prompt_logprobs_forks_and_grammars_match_across_ranks(pair):
    """The prompt's own logprobs (scored on rank 0, prefilled on every rank), n > 1 (rows forked from
    one prefill on every rank, seeded sampling on rank 0) and a JSON schema (rank 0's grammar)."""
    model, single, split, _ = pair

    def post(server: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(server.url + path, json={"model": model, **body}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    echo = {"prompt": "The quick brown fox jumps", "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    scored = [post(s, "/v1/completions", echo)["choices"][0]["logprobs"] for s in (single, split)]
    assert scored[0]["tokens"] == scored[1]["tokens"]
    assert np.allclose([x or 0 for x in scored[0]["token_logprobs"]], [x or 0 for x in scored[1]["token_logprobs"]],
                       atol=1e-4)
    forks = {"messages": [{"role": "user", "content": "Hi"}], "n": 3, "max_tokens": 8, "temperature": 0.9, "seed": 7}
    texts = [[c["message"]["content"] for c in post(s, "/v1/chat/completions", forks)["choices"]] for s in (single, split)]
    assert texts[0] == texts[1] and len(texts[1]) == 3
    schema = {"type": "object", "properties": {"k": {"type": "string", "enum": ["a", "b"]}}, "required": ["k"]}
    shaped = {"messages": [{"role": "user", "content": "Describe"}], "max_tokens": 30, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    answers = [post(s, "/v1/chat/completions", shaped)["choices"][0]["message"]["content"] for s in (single, split)]
    assert answers[0] == answers[1] and json.loads(answers[1])["k"] in ("a", "b")


def test_each_rank_holds_its_slice(pair):
    _, _, split, _ = pair
    lines = [line for line in split.log.splitlines() if "pipeline rank " in line and "layers" in line]
    assert len(lines) == 2, split.log
    assert any("rank 1/2: layers 0-" in line for line in lines) and any("rank 0/2: layers " in line for line in lines)


def test_three_ranks_relay_the_step_and_the_hidden_state(tmp_path):
    """Rank 0 sends each step to rank 1, which passes it on to rank 2; the hidden state comes back
    2 -> 1 -> 0. Greedy tokens as one process's."""
    model = str(build_model("qwen2_5_vl", "small"))
    single = start_server(["--model", model, "--no-prefix-cache"], tmp_path / "single.log")
    split = start_pipeline(["--model", model], tmp_path / "split.log", ranks=3)
    try:
        assert "rank 1/3: layers 2-3 of 6" in split.log, split.log
        for images in (0, 1):
            alone, across = _chat(single, model, "Tell me more.", images), _chat(split, model, "Tell me more.", images)
            assert _same(across, alone), (across, alone)
    finally:
        single.stop()
        assert split.stop() == 0, split.log


def test_the_readme_launch_line_serves_the_demo_model_split(tmp_path):
    """docs/scaling-out.md's local launch line, as written but for the port: the demo model on two ranks
    captions the README's picture as one process does."""
    page = (ROOT / "docs" / "scaling-out.md").read_text()
    line = next(ln for ln in page.splitlines() if ln.startswith("mlx.launch --backend ring -n 2 -- vlmserve serve"))
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1", "VLMSERVE_NO_OPENBLAS": "1"}
    log = tmp_path / "split.log"
    proc = subprocess.Popen(["bash", "-c", f"{line} --port {port}"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)
    split = PipelineProcess(proc, port, log, 2)
    try:
        wait_for(split, "/ready", 120)
        picture = image_data_url(Image.open(ROOT / "assets" / "example.png"))
        body = {"model": "demo-gemma4", "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "Describe the picture."}]}]}
        response = httpx.post(split.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.json()["choices"][0]["message"]["content"] == "A red circle, a blue triangle and a yellow star."
        assert "pipeline rank 1/2: layers 0-1 of 4" in split.log, split.log
    finally:
        assert split.stop() == 0, split.log


# -- faults --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def endless() -> str:
    """Special tokens silenced: every request runs to max_tokens."""
    return str(build_model("gemma4", "micro", ignore_eos=True))


def _stream_until(server: Any, model: str, after_chunks: int, act: Any) -> tuple[list[dict[str, Any]], float]:
    """Stream one endless request; after ``after_chunks`` tokens call ``act``; return every event and
    the seconds from ``act`` to the stream's end."""
    body = {"model": model, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 100000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events, acted = [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if acted is None and len(events) == after_chunks:
                act()
                acted = time.monotonic()
    assert acted is not None, events
    return events, time.monotonic() - acted


def test_a_rank_killed_mid_stream_ends_every_request_with_an_error(endless, tmp_path):
    split = start_pipeline(["--model", endless, "--pipeline-timeout", "5"], tmp_path / "split.log")
    try:
        events, took = _stream_until(split, endless, 20, lambda: os.kill(split.rank_pid(1), signal.SIGKILL))
        assert "error" in events[-1], events[-1]
        assert took < 15, took  # at once (recv raises), never a hang: the client's timeout is 60 s
        assert split.proc.wait(30) is not None
        assert "lost rank 1" in split.log or "Node with rank 1 exited" in split.log, split.log
    finally:
        split.kill_ranks()


def test_a_stopped_rank_is_noticed_within_the_timeout(endless, tmp_path):
    split = start_pipeline(["--model", endless, "--pipeline-timeout", "2"], tmp_path / "split.log")
    stopped = split.rank_pid(1)
    try:
        events, took = _stream_until(split, endless, 20, lambda: os.kill(stopped, signal.SIGSTOP))
        assert "rank 1 did not answer" in events[-1]["error"]["message"], events[-1]
        assert took < 20, took  # the 2 s timeout, then the error: never a hang (the client's timeout is 60 s)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "Node with rank 0 exited with code 1" not in split.log:
            time.sleep(0.1)
        assert "Node with rank 0 exited with code 1" in split.log, split.log
    finally:
        split.kill_ranks()


def test_a_rank_stopped_while_idle_makes_rank_0_unready(endless, tmp_path):
    split = start_pipeline(["--model", endless, "--pipeline-timeout", "2"], tmp_path / "split.log")
    try:
        os.kill(split.rank_pid(1), signal.SIGSTOP)
        deadline, ready = time.monotonic() + 10, True
        while time.monotonic() < deadline and ready:
            try:
                ready = httpx.get(split.url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                ready = False  # rank 0 already exited
            time.sleep(0.1)
        assert not ready
        assert "rank 1 did not answer a heartbeat" in split.log, split.log
    finally:
        split.kill_ranks()


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_rank_sleeps_instead_of_polling(endless, tmp_path):
    """MLX's ring recv polls (a core per waiting rank); rank 1 waits for each step on the doorbell."""
    split = start_pipeline(["--model", endless], tmp_path / "split.log")
    try:
        follower = split.rank_pid(1)
        before = _cpu_seconds(follower)
        time.sleep(4)  # idle, but for the heartbeats
        assert _cpu_seconds(follower) - before < 1.0  # polling took 2.8 s of CPU in 4 s (measured)
        assert "no doorbell" not in split.log, split.log
    finally:
        split.stop()


def test_rank_0_killed_stops_the_other_ranks(endless, tmp_path):
    split = start_pipeline(["--model", endless], tmp_path / "split.log")
    try:
        os.kill(split.rank_pid(0), signal.SIGKILL)
        split.proc.wait(30)
        assert "lost rank 0 or a neighbour" in split.log or "Node with rank 0 exited" in split.log, split.log
    finally:
        split.kill_ranks()


def test_sigterm_on_rank_0_drains_then_stops_every_rank(endless, tmp_path):
    split = start_pipeline(["--model", endless, "--shutdown-timeout", "30"], tmp_path / "split.log")
    body = {"model": endless, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 120,
            "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, split.url + "/v1/chat/completions", json=body, timeout=60)
        time.sleep(0.5)
        os.kill(split.rank_pid(0), signal.SIGTERM)
        response = running.result()
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert split.proc.wait(30) == 0
    assert "rank 0 stopped the group" in split.log, split.log


def test_ranks_that_disagree_about_the_model_refuse_to_start(tmp_path):
    a, b = str(build_model("gemma3", "micro")), str(build_model("gemma4", "micro"))
    split = start_pipeline([], tmp_path / "split.log", wait_ready=False, models_by_rank=(a, b))
    try:
        split.proc.wait(60)
        assert "ranks disagree about the model or vlmserve/MLX version: rank(s) [1] differ from rank 0" in split.log
    finally:
        split.kill_ranks()


# -- the parts, without a launch --------------------------------------------------------------


def test_layers_split_by_each_ranks_memory_the_last_rank_first():
    assert split_layers([1] * 8, [1, 1]) == [(4, 8), (0, 4)]
    assert split_layers([1] * 8, [3, 1]) == [(2, 8), (0, 2)]  # rank 0 has three times the memory
    assert split_layers([1] * 6, [1, 1, 1]) == [(4, 6), (2, 4), (0, 2)]
    assert split_layers([1] * 3, [100, 1]) == [(1, 3), (0, 1)]  # every rank keeps a layer
    assert split_layers([1] * 8, [-5, 1]) == [(7, 8), (0, 7)]  # no memory left for layers: still one


def test_layers_split_by_their_bytes():
    # the last layer weighs five: half the bytes is the first five layers
    assert split_layers([1, 1, 1, 1, 1, 5], [1, 1]) == [(5, 6), (0, 5)]


def test_a_slice_starts_only_where_shared_kv_allows():
    # Gemma 4 with shared KV: the readers' first source is layer 2, so a slice starts at 1 or 2
    assert split_layers([1] * 6, [1, 1], starts=(0, 1, 2)) == [(2, 6), (0, 2)]
    with pytest.raises(PipelineError, match="cannot be split 2 ways"):
        split_layers([1] * 6, [1, 1], starts=(0,))
    with pytest.raises(PipelineError, match="at most one rank per layer"):
        split_layers([1, 1], [1, 1, 1])


def test_a_step_message_carries_embeddings_and_plan_unchanged():
    embeds = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    embedded = Embedded(embeds, {"position_ids": mx.ones((3, 1, 3), dtype=mx.int32), "grid": [mx.zeros((0,))],
                                 "visual_pos_masks": mx.array([[True, False, True]])},
                        {"rope_deltas": mx.array([[2]], dtype=mx.int32)})
    plan = SchedulerOutput(new=[NewRequest("b", PromptInputs([1, 2, 3]), SamplingParams(seed=4))], decode=["d"],
                           prefill=[PrefillChunk("b", 0, 3)], prefill_groups=[["b", "c"]], finished=["a"])
    message = StepMessage(plan=plan, embedded={"b": embedded}, tokens=[5, 6])
    blob, arrays = Link._pack(message)
    back = Link._unpack(blob, arrays)
    assert (back.plan, back.tokens) == (plan, [5, 6])
    got = back.embedded["b"]
    assert mx.array_equal(got.inputs_embeds, embeds) and mx.array_equal(got.row_state["rope_deltas"], mx.array([[2]]))
    assert mx.array_equal(got.lm_kwargs["position_ids"], embedded.lm_kwargs["position_ids"])
    assert got.lm_kwargs["grid"][0].shape == (0,)
    assert got.lm_kwargs["visual_pos_masks"].dtype == mx.bool_


def test_followers_get_the_plan_without_pixels_grammars_or_what_failed_on_rank_0():
    pixels = {"pixel_values": np.ones((4, 3)), "image_grid_thw": np.array([[1, 2, 2]])}
    prompt = PromptInputs([1, 2, 3], pixels, 1, (ImageItem("k", pixels),))
    new = [NewRequest("a", prompt, SamplingParams(seed=1, guide=None), forks=(("a1", SamplingParams()),)),
           NewRequest("b", prompt, SamplingParams())]
    plan = SchedulerOutput(new=new, encode=[EncodeChunk("a"), EncodeChunk("b")], decode=["d"], finished=["f"],
                           prefill=[PrefillChunk("a", 0, 3), PrefillChunk("b", 0, 3), PrefillChunk("c", 0, 3)],
                           prefill_groups=[["a", "b", "c"]])
    theirs = for_followers(plan, {"b"})
    (a,) = theirs.new
    assert (a.request_id, a.params, a.forks, a.prompt.input_ids) == ("a", new[0].params, new[0].forks, [1, 2, 3])
    assert a.prompt.images == () and all(v.size == 0 for v in a.prompt.arrays.values())
    assert theirs.encode == [] and [c.request_id for c in theirs.prefill] == ["a", "c"]
    assert (theirs.prefill_groups, theirs.decode, theirs.finished) == ([["a", "c"]], ["d"], ["f"])
    assert len(plan.new) == 2 and plan.new[0].prompt.images  # rank 0's own plan is as it was


# -- every rank runs the same step, without a launch ------------------------------------------


class Wire:
    """Stands in for the group: what rank 0 sends goes through ``Link``'s packing, its arrays through the
    host (each rank's worker has arrays of its own), in order, to the other rank's ``receive``."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, list[tuple[np.ndarray, Any]]]] = []

    def send(self, message: StepMessage) -> None:
        blob, arrays = Link._pack(message)
        self.messages.append((blob, [(np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a), a.dtype)
                                     for a in arrays]))

    def receive(self) -> StepMessage:
        blob, arrays = self.messages.pop(0)
        return Link._unpack(blob, [mx.array(a).astype(dtype) for a, dtype in arrays])


@pytest.fixture(scope="module")
def ranks():
    """Rank 0's runner (``Leader``) and another rank's (``Follower``), each on the whole model on its own
    worker, joined by a ``Wire``; with a prompt builder."""
    workers = [MLXWorkerThread(name=f"rank{i}") for i in (0, 1)]
    for worker in workers:
        worker.start()
    path = str(build_model("qwen2_5_vl", "micro"))  # an image's M-RoPE state rides with its embeddings
    loaded = [worker.call(load_model, path) for worker in workers]
    layers = loaded[0].adapter.num_layers
    wire = Wire()
    leader = Leader(Stage(0, 2, 0, layers, layers), Watch(Stage(0, 2, 0, layers, layers), timeout_s=60))
    follower = Follower(Stage(1, 2, 0, layers, layers))
    leader.link = follower.link = wire  # type: ignore[assignment]
    runners = (workers[0].call(ModelRunner, loaded[0], EngineCaches(None, None), leader),
               workers[1].call(ModelRunner, loaded[1], None, follower))
    yield workers, runners, wire, PromptBuilder.for_processor(loaded[0].processor)
    for worker in workers:
        worker.shutdown()


def test_another_rank_runs_rank_0s_steps_into_the_same_batch_and_kv_and_samples_nothing(ranks):
    """An image prompt (embedded on rank 0 only), a scored prompt, a prompt with a fork (n > 1), two
    prompts in one forward, decode steps and an end: the same rows, KV and per-row state on both."""
    workers, (rank0, rank1), wire, prompter = ranks
    image = prompter.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
                           [scene("circle", (220, 30, 30))])
    text = [prompter.build([{"role": "user", "content": f"Say {w}."}]) for w in ("one", "two", "three", "four")]
    new = [NewRequest("img", image, SamplingParams()), NewRequest("scored", text[0], SamplingParams(prompt_logprobs=2)),
           NewRequest("n2", text[1], SamplingParams(temperature=0.9, seed=3),
                      forks=(("n2-1", SamplingParams(temperature=0.9, seed=4)),)),
           NewRequest("g1", text[2], SamplingParams()), NewRequest("g2", text[3], SamplingParams())]
    ids = [n.request_id for n in new]

    def lead() -> list[Any]:
        outs = [rank0.execute(SchedulerOutput(new=new, encode=[EncodeChunk(r) for r in ids]))]
        length = outs[0].prompt_lengths
        chunks = [PrefillChunk(r, 0, length[r], forks=("n2-1",) if r == "n2" else ()) for r in ids]
        outs.append(rank0.execute(SchedulerOutput(prefill=chunks, prefill_groups=[["g1", "g2"]])))
        rows = [*ids, "n2-1"]
        outs += [rank0.execute(SchedulerOutput(decode=rows)) for _ in range(3)]
        outs.append(rank0.execute(SchedulerOutput(decode=[r for r in rows if r != "scored"], finished=["scored"])))
        wire.send(StepMessage(STOP))
        return outs

    def follow() -> list[Any]:
        outs, execute = [], rank1.execute
        rank1.execute = lambda plan: outs.append(execute(plan)) or outs[-1]  # type: ignore[method-assign]
        rank1.rank.follow(rank1)
        return outs

    led = workers[0].call(lead)
    followed = workers[1].call(follow)
    assert not any(o.errors for o in led) and led[1].samples.keys() == {*ids, "n2-1"}
    assert led[1].samples["scored"].prompt_logprobs is not None and led[1].prefill_batches == 1
    assert len(followed) == len(led) and not any(o.samples or o.errors for o in followed)

    def state(runner: ModelRunner) -> Any:
        batch = runner.batch
        return batch.request_ids, [np.array(a) for c in batch.cache for a in c.state], \
            {k: np.array(v) for k, v in batch.row_state.items()}, [s.params for s in batch.sampling]

    (ids0, kv0, rows0, params0), (ids1, kv1, rows1, params1) = workers[0].call(state, rank0), workers[1].call(state, rank1)
    assert ids0 == ids1 and set(ids0) == {"img", "n2", "n2-1", "g1", "g2"} and params0 == params1
    assert len(kv0) == len(kv1) and all(np.array_equal(a, b) for a, b in zip(kv0, kv1))
    assert rows0.keys() == rows1.keys() == {"rope_deltas"} and np.array_equal(rows0["rope_deltas"], rows1["rope_deltas"])


def test_a_fault_ends_its_request_until_the_step_goes_out_then_the_pipeline(ranks):
    """Before rank 0 sends the step a fault is one request's (and the others never see it); after, every
    rank runs the part: the step raises. The watchdog stops waiting either way."""
    workers, (rank0, _), wire, _ = ranks
    alone = ModelRunner(rank0.loaded)
    bad = NewRequest("bad", PromptInputs([1, 2]), SamplingParams(prompt_logprobs=1), num_cached=1)  # a broken invariant
    ghost = SchedulerOutput(prefill=[PrefillChunk("ghost", 0, 1)])
    leader = rank0.rank
    assert isinstance(leader, Leader)

    out = workers[0].call(rank0.execute, SchedulerOutput(new=[bad]))
    assert "bad" in out.errors and wire.receive().plan.new == []
    assert workers[0].call(alone.execute, ghost).errors.keys() == {"ghost"}
    with pytest.raises(KeyError):
        workers[0].call(rank0.execute, ghost)
    assert wire.receive().plan.prefill == ghost.prefill and not leader.sent and leader.watch._since is None
