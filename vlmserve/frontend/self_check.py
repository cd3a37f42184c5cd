"""[loop] The start-up check of a family no adapter names: served only where it answers as mlx-vlm does.

For such a model nothing is known but that mlx-vlm loads it, so mlx-vlm's own answer is the truth. A few
probe turns (text, one picture, two) go through mlx-vlm's prompt path (``engine/oracle.py``) and through this
server's own (the chat template, the engine): the prompt ids must be the same, and each token the engine
decodes greedily must be mlx-vlm's model's greedy choice after the same ids and pixels, up to rounding (in
bf16 two orders of the same sums may pick either of two tokens a unit in the last place apart; a lost
image feature or a wrong position is far more). The model is refused, in one line, where either fails;
decode batching stays on only where the probes decoded together pass too. Probes that mlx-vlm's own path
cannot run are left out, and a prompt may then carry no more images than the probes that ran (a family that
takes one image: one; one whose processor mlx-vlm's path cannot call with a picture: none).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from vlmserve.engine.loader import LoadedModel
from vlmserve.engine.oracle import first_departure, mlx_vlm_prompt
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.frontend.output import RequestOutput
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.prompt import PromptBuilder

PROBE_TOKENS = 8
PROBES = (("Write one sentence about the sea.", 0), ("Describe this picture.", 1), ("Compare the two pictures.", 2))

Generate = Callable[[str, PromptInputs, SamplingParams], AsyncIterator[RequestOutput]]


@dataclass(frozen=True, slots=True)
class Verdict:
    refusal: str | None  # why the model is not served (None: it is)
    batches: bool  # did the probes decoded together each give their tokens alone?
    probes: int  # how many probes ran
    # Images a prompt may carry: as many as the probes mlx-vlm's own path could run (None: any)
    max_images: int | None = None


def pictures(n: int) -> list[Image.Image]:
    """``n`` distinct pictures, not square, with shapes a tower can tell apart."""
    out = []
    for i in range(n):
        image = Image.new("RGB", (112, 84), (40 + 90 * i, 160, 200 - 80 * i))
        draw = ImageDraw.Draw(image)
        draw.ellipse((10 + 30 * i, 10, 60 + 30 * i, 60), fill=(220, 40 * i, 30))
        out.append(image)
    return out


async def check(loaded: LoadedModel, prompter: PromptBuilder, pool: Executor, worker: MLXWorkerThread,
                generate: Generate) -> Verdict:
    """Run the probes: refuse the model at the first difference from mlx-vlm, then try them together."""
    loop = asyncio.get_running_loop()
    params = SamplingParams(max_tokens=PROBE_TOKENS, ignore_eos=True)
    ran: list[tuple[str, list[Any], PromptInputs]] = []
    for text, count in PROBES:
        images = pictures(count)
        try:
            want: list[int] = await worker.run(mlx_vlm_prompt, loaded, text, images)
        except Exception:  # noqa: BLE001 - mlx-vlm's own path cannot run this probe: nothing to hold us to
            continue
        parts: list[dict[str, Any]] = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
        prompt = await loop.run_in_executor(pool, prompter.build, [{"role": "user", "content": parts}], images)
        what = f"a turn with {count} image{'s' * (count > 1)}" if count else "a text turn"
        if prompt.input_ids != want:
            return Verdict(_differ("prompt ids", what, _first_difference(prompt.input_ids, want)), False, len(ran))
        got = await _tokens(generate, f"self-check-{len(ran)}", prompt, params)
        at = await worker.run(first_departure, loaded, text, images, got)
        if at is not None:
            return Verdict(_differ("greedy tokens", what, at), False, len(ran))
        ran.append((text, images, prompt))
    if not ran:
        return Verdict("mlx-vlm's own prompt path failed on every probe", False, 0)
    together = await asyncio.gather(*(_tokens(generate, f"self-check-b{i}", p, params) for i, (_, _, p) in enumerate(ran)))
    departed = [await worker.run(first_departure, loaded, text, images, got)
                for (text, images, _), got in zip(ran, together)]
    return Verdict(None, departed == [None] * len(ran), len(ran), _most_images([len(images) for _, images, _ in ran]))


async def _tokens(generate: Generate, request_id: str, prompt: PromptInputs, params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for step in generate(request_id, prompt, params):
        if step.error is not None:
            raise RuntimeError(step.error)
        out += step.token_ids
    return out


def _most_images(checked: list[int]) -> int | None:
    """The most images a prompt may carry, from the image counts of the probes that ran (None: any)."""
    run = 0
    while run < len(checked) and checked[run] == run:  # PROBES carry 0, 1, 2 images in turn
        run += 1
    return None if run == len(PROBES) else max(run - 1, 0)


def _first_difference(ours: list[int], theirs: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def _differ(what: str, probe: str, at: int) -> str:
    return f"its {what} on {probe} differ from mlx-vlm's own from position {at}"
