"""The prompt's own logprobs (``SamplingParams.prompt_logprobs``, what /v1/completions' echo with
logprobs and lm-evaluation-harness read): chunk by chunk on the real worker, they equal one whole
forward of mlx-vlm's model, and the request's generated tokens are those it makes without them."""

from __future__ import annotations

import asyncio

import pytest
from conftest import running_engine

from vlmserve.engine.params import SamplingParams
from vlmserve.inputs import PromptInputs
from vlmserve.testing import build_model
from vlmserve.testing.reference import reference_prompt_logprobs

TEXT = "Once upon a time there were three shapes: a red circle, a blue square and a green triangle. " * 2


@pytest.mark.parametrize("arch", ["gemma4", "qwen2_5_vl", "qwen3_5"])
def test_prompt_logprobs_equal_one_whole_forward_and_leave_the_answer_alone(arch):
    async def scenario():
        async with running_engine(build_model(arch, "micro"), prefill_chunk=16) as engine:
            ids = engine.prompter.tokenize(TEXT, True)
            prompt = PromptInputs(ids)
            want = engine.worker.call(reference_prompt_logprobs, engine.loaded.model, prompt)
            scored, plain = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=3), \
                SamplingParams(max_tokens=6, ignore_eos=True)
            got, tokens = None, {}
            for name, params in (("scored", scored), ("plain", plain)):
                tokens[name] = []
                async for out in engine.generate(f"{arch}-{name}", prompt, params):
                    got = out.prompt_logprobs if out.prompt_logprobs is not None else got
                    tokens[name] += out.token_ids
            return ids, want, got, tokens

    ids, want, got, tokens = asyncio.run(scenario())
    assert len(ids) > 40  # several 16-token chunks
    assert got is not None and len(got) == len(ids) and got[0] is None
    for position, (lp, expected) in enumerate(zip(got[1:], want[1:]), start=1):
        assert lp.token_id == ids[position]
        assert lp.logprob == pytest.approx(expected, abs=2e-3), position
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.logprob - 1e-6 and lp.top == tuple(sorted(lp.top, key=lambda t: -t[1]))
    assert tokens["scored"] == tokens["plain"]
