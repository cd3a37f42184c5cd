"""[worker] Generation for one request outside the batching engine (CLI captioning, warm-up, benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator

from vlmserve.engine.params import PromptInputs, SamplingParams
from vlmserve.engine.runner import ModelRunner
from vlmserve.engine.sampler import RowState, sample


def generate_tokens(runner: ModelRunner, prompt: PromptInputs, params: SamplingParams) -> Iterator[int]:
    """Yield token ids until EOS, a stop token or ``max_tokens``; needs the runner's batch to itself."""
    assert not runner.batch, "generate_tokens needs an idle runner"
    seq = runner.start("generate", prompt)
    while (logits := runner.prefill_step(seq)) is None:
        pass
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(runner.loaded.eos_token_ids))
    rows = [RowState.create(params, prompt.input_ids)]
    runner.join_batch(seq)
    try:
        for produced in range(1, params.max_tokens + 1):
            token = sample(logits, rows).token_ids[0]
            if token in stop_ids:
                return
            yield token
            if produced < params.max_tokens:
                logits = runner.decode([token])
    finally:
        runner.leave_batch([seq.seq_id])
