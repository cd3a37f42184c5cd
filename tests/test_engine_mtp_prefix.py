"""Drafters that remember (issue 58): a drafter's own state (Qwen3.5's MTP, DFlash on Qwen3.5 and on
Gemma 4, whose caches can be cut back, a draft model on Qwen2.5-VL, whose too) is stored with a prompt's
prefix (engine/mtp_prefix.py), so a second turn that reuses the first from memory, or from disk after a
restart, drafts exactly as its cold prefill does: the same drafts at every step, the same acceptance, and
the drafter's own KV of the row equal to the cold one's (float32 from forwards of other shapes). A draft
model reads only the new text of a prompt whose prefix it remembers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_engine_spec_batch import (
    GREEDY,
    TEXT,
    WHOLE,
    _check,
    _dflash,
    _draft_model,
    _mtp,
    _recording,
    _result,
    _turn_two,
)
from test_families import Family, _start, _stop

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.inputs import PromptInputs
from vlmserve.testing import build_model

ASKED = SamplingParams(max_tokens=24, ignore_eos=True)  # long enough for a passage repeated to be drafted


def _turn(family: Family, request_id: str, prompt: PromptInputs) -> tuple[object, dict, int, int]:
    """One request alone: its result, what the drafter did for it, the draft tokens accepted, and the prompt
    tokens a draft model read for it (0 for any other drafter)."""
    m0, read = family.engine.metrics, _prefilled(family)
    with _recording(family) as record:
        result = family.run(_result(family, request_id, prompt, ASKED))
    m = family.engine.metrics
    assert m is not None and m0 is not None
    return result, record, m.spec_accepted_tokens - m0.spec_accepted_tokens, _prefilled(family) - read


def _prefilled(family: Family) -> int:
    return getattr(family.engine.loaded.drafter, "prefilled", 0)


KINDS = {"mtp-qwen3_5": ("qwen3_5", "mtp", _mtp), "dflash-qwen3_5": ("qwen3_5", "dflash", _dflash),
         "dflash-gemma4": ("gemma4", "dflash", _dflash),
         "draft_model-qwen2_5_vl": ("qwen2_5_vl", "draft_model", _draft_model)}


@pytest.fixture(scope="module", params=list(KINDS))
def drafted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SpeculativeConfig]:
    arch, method, build = KINDS[request.param]
    target = Path(build_model(arch, "micro"))
    return target, SpeculativeConfig(method=method, model=str(build(tmp_path_factory, target)), adaptive=False)


def test_a_reused_prefix_drafts_as_its_cold_prefill_from_memory_and_from_disk(drafted, tmp_path: Path) -> None:
    target, config = drafted
    settings = {"mm_prefix_cache": True, "prefix_cache_dir": str(tmp_path), **WHOLE}
    runs = []
    for restart in (False, True):  # memory, then the files the first engine wrote at shutdown
        family = _start(target, speculative=config, **settings)
        try:
            if not restart:  # the prompts as a caching engine builds them (where each one's snapshot is taken)
                first, second = _turn_two(family, "remember", TEXT, [])
                family.run(_result(family, "first", first, GREEDY))
            runs.append(_turn(family, "warm", second))
            disk = family.run(family.engine.stats()).disk
        finally:
            _stop(family)
        assert disk is not None and (disk.hits >= 1) == restart
    cold = _start(target, speculative=config, prefix_cache=False, **WHOLE)
    try:
        want, want_record, want_accepted, want_read = _turn(cold, "cold", second)
        _check(cold, [second], [ASKED], [want])
    finally:
        _stop(cold)
    assert len(want_record.drafts["cold"]) >= 5  # the random drafter's acceptance is ~0: its drafts are the check
    for result, record, accepted, read in runs:
        assert result.token_ids == want.token_ids
        assert result.num_cached_tokens >= len(first) - 4  # the first turn (or on disk, the second's own snapshot)
        assert record.drafts["warm"] == want_record.drafts["cold"]  # every step's draft, from the same context
        assert accepted == want_accepted
        if config.method == "draft_model":  # a text prompt: every token of it is the draft model's to read
            assert (want_read, read) == (len(second.input_ids), len(second.input_ids) - result.num_cached_tokens)
        np.testing.assert_allclose(record.kv["warm"], want_record.kv["cold"], rtol=1e-4, atol=1e-4)
