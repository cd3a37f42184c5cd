"""[worker] Generation for one request outside the batching engine (CLI captioning, evaluation)."""

from __future__ import annotations

from collections.abc import Iterator

from vlmserve.engine.core import new_request, scheduler_config
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import SchedulerOutput
from vlmserve.engine.runner import ModelRunner
from vlmserve.engine.scheduler import Scheduler
from vlmserve.inputs import PromptInputs


def generate_tokens(runner: ModelRunner, prompt: PromptInputs, params: SamplingParams,
                    config: EngineConfig = EngineConfig()) -> Iterator[int]:
    """Yield token ids until EOS, a stop token or ``max_tokens``: the engine's own plan and step,
    for one request, on the calling thread; needs the runner to itself."""
    assert not runner.batch and not runner.prompts, "generate_tokens needs an idle runner"
    scheduler = Scheduler(scheduler_config(runner.adapter, config))
    req = new_request(runner.loaded, "generate", prompt, params)
    scheduler.add(req)
    try:
        while not req.status.finished:
            plan = scheduler.schedule()
            output = runner.execute(plan)
            for update in scheduler.update_from_output(plan, output):
                if update.error is not None:
                    raise RuntimeError(update.error)
                if update.token_id is not None:
                    yield update.token_id
    finally:
        runner.execute(SchedulerOutput(finished=[req.request_id]))
