"""A program for ``torchrun`` (tests/parallel/test_launched_world.py): every rank runs it; rank
0's ``LLMEngine`` is the engine, the others' constructors become its workers and end their
processes. Rank 0 writes the results as JSON.

    torchrun ... tests/parallel/torchrun_job.py JOB.json

JOB.json: ``config`` (EngineConfig fields), ``prompts`` (token ids), ``params``
(SamplingParams fields), ``output`` (the results file), ``pids`` (a directory each rank writes
its pid to), ``endless`` (generate until the engine fails: the killed-rank test).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.errors import TensorParallelError
from specbatch.outputs import RequestOutput


def serialize(outputs: list[RequestOutput]) -> list[dict[str, Any]]:
    """What the comparison needs of each request's final output."""

    def positions(logprobs: Any) -> list[dict[str, float] | None]:
        return [
            None if at is None else {str(t): lp.logprob for t, lp in at.items()}
            for at in logprobs or []
        ]

    return [
        {
            "token_ids": list(out.outputs[0].token_ids),
            "logprobs": positions(out.outputs[0].logprobs),
            "prompt_logprobs": positions(out.prompt_logprobs),
            "num_cached_tokens": out.metrics.num_cached_tokens if out.metrics else 0,
        }
        for out in outputs
    ]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return {
        "outputs": serialize([finals[f"r{i}"] for i in range(len(prompts))]),
        "preemptions": engine.scheduler.num_preemptions,
        "draft_tokens": engine.stats.num_draft_tokens,
        "free_blocks_after": engine.cache.num_free_blocks == engine.cache.num_blocks,
    }


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(job["pids"], os.environ["RANK"]).write_text(str(os.getpid()))
    engine = LLMEngine(EngineConfig(**job["config"]))  # ranks > 0 end inside it
    params = SamplingParams(**job["params"])
    if job.get("endless"):
        engine.add_request("endless", job["prompts"][0], params)
        Path(job["output"]).with_suffix(".ready").write_text("")
        try:
            while True:
                engine.step()
        except TensorParallelError as exc:
            print(f"rank 0 engine error: {exc}", file=sys.stderr)
            return 3
    results = run(engine, job["prompts"], params)
    engine.shutdown()
    Path(job["output"]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
