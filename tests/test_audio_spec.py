"""Audio prompts through speculative decoding on the real worker and MLX: Gemma 4's audio build with each of its
drafters drafting on every step (``adaptive: false``): ngram lookups, its assistant (the MTP drafter that reads the
target's KV) and a DFlash drafter (its own KV from two target layers' states). An audio prompt, alone and batched
with an image row and a text row, gives mlx-vlm's greedy tokens, which are the answer without drafts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import scene
from test_audio import Audio, tone

from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.testing import build_model

SAY = "one two three four, one two three four, say it again: one two three four"  # repeats: ngram drafts


def _assistant(tmp: pytest.TempPathFactory, target: Path) -> Path:
    from vlmserve.testing.gemma4 import build_assistant
    return Path(build_assistant(target, tmp.getbasetemp() / "gemma4-audio-assistant"))


def _dflash(tmp: pytest.TempPathFactory, target: Path) -> Path:
    from vlmserve.testing.qwen3_5 import build_dflash
    return build_dflash(target, tmp.getbasetemp() / f"{target.name}-dflash")


KINDS: dict[str, Callable[[pytest.TempPathFactory, Path], Path] | None] = {
    "ngram": None, "mtp": _assistant, "dflash": _dflash}


@pytest.fixture(scope="module", params=list(KINDS))
def drafted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Audio]:
    build = KINDS[request.param]
    if build is None:
        config = SpeculativeConfig(prompt_lookup_min=1, adaptive=False)  # a draft wherever a token repeats
    else:
        target = Path(build_model("gemma4", "micro", variant="audio"))
        config = SpeculativeConfig(method=request.param, model=str(build(tmp_path_factory, target)), adaptive=False)
    started = Audio(speculative=config)
    yield started
    started.loop.run_until_complete(started.engine.shutdown())
    started.loop.close()


def test_an_audio_prompt_with_drafts_is_greedy_alone_and_beside_image_and_text_rows(drafted: Audio) -> None:
    red = scene("circle", (220, 30, 30))
    prompts = [drafted.prompt(SAY, [tone(330, 0.8)]), drafted.prompt(SAY, [], [red]),
               drafted.prompt(SAY, [tone(660, 1.5)], [red]), drafted.prompt(SAY)]
    before = drafted.loop.run_until_complete(drafted.engine.stats())
    first = drafted.loop.run_until_complete(drafted.tokens("alone0", prompts[0]))
    after = drafted.loop.run_until_complete(drafted.engine.stats())
    assert after.spec_drafts > before.spec_drafts  # the audio row alone was drafted for
    alone = [first, *(drafted.loop.run_until_complete(drafted.tokens(f"alone{i}", p)) for i, p in
                      enumerate(prompts[1:], 1))]
    assert alone == [drafted.reference(p) for p in prompts]

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(drafted.tokens(f"t{i}", p) for i, p in enumerate(prompts))))

    assert drafted.loop.run_until_complete(together()) == alone
