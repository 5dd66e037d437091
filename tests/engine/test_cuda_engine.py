"""The engine on CUDA: Triton attention, CUDA-graph replay equal to eager (skipped on CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specbatch import LLM, SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 6, 7, 8] * 5, [30, 31], list(range(40, 90)), [3] * 17]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def outputs(model_dir: Path, graphs: bool = False, **kwargs: Any) -> list[list[int]]:
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        num_kv_blocks=128,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        **kwargs,
    )
    assert llm.llm_engine.model.backend.name == "triton"
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    runner = llm.llm_engine.runner
    assert (runner.graphs is not None) == graphs
    if runner.graphs is not None:  # every decode step after the prompts replays a graph
        assert runner.graphs.replays >= PARAMS.max_tokens // 2
    return tokens


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_graph_replay_equals_eager(tiny_model_dir: Path, speculative: Any) -> None:
    eager = outputs(tiny_model_dir, enforce_eager=True, speculative_config=speculative)
    graphed = outputs(tiny_model_dir, graphs=True, speculative_config=speculative)
    assert graphed == eager


def test_cuda_matches_cpu(tiny_model_dir: Path) -> None:
    cpu = LLM(
        str(tiny_model_dir), device="cpu", num_kv_blocks=128, block_size=16, max_model_len=256
    )
    expected = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert outputs(tiny_model_dir, graphs=True) == expected
