"""The CUDA-graph step path on the CPU, with a stand-in for the graph itself.

A real graph replays the captured kernels over static input, position and metadata tensors. The
stand-in "replays" by running the same forward again over those same static tensors into the
captured output buffer, so everything around the graph runs as on a GPU: padding the batch to
the ladder, refreshing the static buffers each step (padding rows with slot -1 and empty block
tables), uniform query lengths with filler drafts when a proposer drafts fewer than k, and
logits from the replayed hidden states. Outputs must equal the eager engine's, token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.engine import llm_engine, setup
from specbatch.kernels.attention import PAD_SLOT
from specbatch.runner.model_runner import ModelRunner
from tests.helpers import network_proposer

pytest.importorskip("triton")


class EagerReplay:
    """Replays a forward by running it again into the buffer the capture returned."""

    replays = 0

    def __init__(self, forward: Any, out: torch.Tensor) -> None:
        self.forward, self.out = forward, out

    def replay(self) -> None:
        EagerReplay.replays += 1
        self.out.copy_(self.forward())


def eager_capture(forward: Any) -> tuple[EagerReplay, torch.Tensor]:
    out = forward()
    return EagerReplay(forward, out), out


PROMPTS = [[5, 6, 7, 8] * 5, [30, 31], list(range(40, 90)), [3] * 17, [9, 10, 11]]


def make_llm(model: Path, graphs: bool, **kwargs: Any) -> LLM:
    """The tiny model on the (interpreted) Triton backend, graphs on or off."""
    settings: dict[str, Any] = {
        "num_kv_blocks": 64,
        "block_size": 16,
        "max_model_len": 160,
        "max_num_seqs": 4,  # five prompts do not all fit: the batch changes size mid-run
        **kwargs,
    }
    llm = LLM(str(model), attention_backend="triton", enforce_eager=not graphs, **settings)
    assert (llm.llm_engine.runner.graphs is not None) == graphs
    return llm


def generate(
    model: Path, graphs: bool, params: list[SamplingParams], **kwargs: Any
) -> list[list[int]]:
    llm = make_llm(model, graphs, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


# per forward with graphs on: (carried fillers, could replay a graph)
FORWARDS: list[tuple[bool, bool]] = []


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    def capture_graphs(config: Any, models: Any) -> Any:
        return None if config.enforce_eager else setup.graph_runner(config, models, eager_capture)

    def capture_draft_graphs(config: Any, models: Any) -> Any:
        if config.enforce_eager or models.draft is None:
            return None
        return setup.draft_graph_runner(config, models, eager_capture)

    monkeypatch.setattr(llm_engine, "capture_graphs", capture_graphs)
    monkeypatch.setattr(llm_engine, "capture_draft_graphs", capture_draft_graphs)
    EagerReplay.replays = 0
    FORWARDS.clear()
    forward = ModelRunner.forward

    def recording_forward(self: ModelRunner, batch: Any, rows: Any) -> Any:
        if self.graphs is not None:
            fillers = bool(np.any(batch.attention.slot_mapping == PAD_SLOT))
            FORWARDS.append((fillers, self.graphs.can_run(batch)))
        return forward(self, batch, rows)

    monkeypatch.setattr(ModelRunner, "forward", recording_forward)


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "off"},
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "num_speculative_tokens": 3},
        {"method": "hybrid", "num_speculative_tokens": 3, "draft_confidence_threshold": 0.3},
    ],
    ids=["off", "ngram", "draft", "hybrid-confidence"],
)
def test_graph_steps_equal_eager(
    cpu_graphs: None, tiny_model_dir: Path, tiny_draft_dir: Path, speculative: Any
) -> None:
    if speculative["method"] not in ("off", "ngram"):
        speculative = {**speculative, "model": str(tiny_draft_dir)}
    # the second request ends early: the fifth is admitted while the others decode
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 9, 20, 17, 12)
    ]
    eager = generate(tiny_model_dir, False, params, speculative_config=speculative)
    assert EagerReplay.replays == 0
    graphed = generate(tiny_model_dir, True, params, speculative_config=speculative)
    assert EagerReplay.replays > 0
    assert graphed == eager
    # fillers only where they buy a replay (a step with a prefill chunk runs eager, unpadded)
    assert all(replays for fillers, replays in FORWARDS if fillers)
    if speculative["method"] not in ("off", "ngram"):
        assert any(fillers for fillers, _ in FORWARDS)
    assert any(not replays for _, replays in FORWARDS)  # the fifth prompt's prefill


def test_seeded_sampling_with_short_drafts_equals_eager(
    cpu_graphs: None, tiny_model_dir: Path, tiny_draft_dir: Path
) -> None:
    """Sampled rows verify against the draft's q; filler drafts must not take part."""
    speculative = {
        "method": "draft_model",
        "model": str(tiny_draft_dir),
        "num_speculative_tokens": 3,
        "draft_confidence_threshold": 0.3,
        # fixed k: a plan priced by measured step times may differ between the two runs, and
        # the unseeded rows' draws (from the engine's one generator) with it
        "adaptive_k": False,
    }
    params = [  # greedy, seeded and unseeded rows (the engine's seed fixes the latter)
        GREEDY
        if i % 3 == 0
        else SamplingParams(
            temperature=1.0, seed=i if i % 3 == 1 else None, max_tokens=20, ignore_eos=True
        )
        for i in range(len(PROMPTS))
    ]
    eager = generate(tiny_model_dir, False, params, speculative_config=speculative)
    graphed = generate(tiny_model_dir, True, params, speculative_config=speculative)
    assert EagerReplay.replays > 0
    assert graphed == eager


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_every_decode_step_replays(
    cpu_graphs: None, tiny_model_dir: Path, tiny_draft_dir: Path, method: str
) -> None:
    """Sequences near max_tokens draft fewer than k (their lookahead shrinks) and steps where
    nothing was drafted have q = 1: both still replay a graph."""
    # fixed k: every decode step drafts, so every one must replay
    speculative: dict[str, Any] = {
        "method": method,
        "num_speculative_tokens": 3,
        "adaptive_k": False,
    }
    if method == "draft_model":  # always k drafts: k - 1 single-token draft forwards a step
        speculative.update(model=str(tiny_draft_dir), draft_confidence_threshold=0.0)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 4, [40, 41, 42, 43, 44]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (17, 5, 9)]

    def run(graphs: bool) -> tuple[list[list[int]], Any]:
        llm = make_llm(tiny_model_dir, graphs, speculative_config=speculative)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.llm_engine

    eager, _ = run(False)
    graphed, engine = run(True)
    assert graphed == eager
    # one prefill step for all three prompts, then every step is a decode
    assert engine.runner.graphs.replays == engine.stats.num_steps - 1
    if method == "draft_model":
        assert engine.stats.num_drafts > 0
        # the draft's own single-token forwards (its drafts after the first) replay too
        runner = network_proposer(engine).net.runner
        assert runner.graphs.replays >= engine.stats.num_steps - 1


def test_long_contexts_replay_split_kv_graphs(
    cpu_graphs: None, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shapes that leave the GPU idle get a second graph with split-KV, replayed once the
    longest sequence reaches the long-context length (here 40 positions, 4 splits)."""
    from specbatch.kernels.attention.triton_backend import TritonAttentionBackend

    def splits(self: TritonAttentionBackend, programs: int, longest: int, device: Any) -> int:
        return 4 if longest >= self.long_context else 1

    monkeypatch.setattr(TritonAttentionBackend, "splits", splits)
    monkeypatch.setattr(TritonAttentionBackend, "long_context", 40)
    prompts = [[5, 6, 7, 8] * 8, [30, 31, 32]]  # 32 and 3 tokens: the split starts mid-run
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(graphs: bool) -> tuple[list[list[int]], Any]:
        llm = make_llm(tiny_model_dir, graphs, max_num_seqs=2, speculative_config={"method": "off"})
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], llm.llm_engine

    eager, _ = run(False)
    graphed, engine = run(True)
    assert graphed == eager
    graphs = engine.runner.graphs
    assert graphs.long_splits == {(1, 1): 4, (2, 1): 4}
    assert 0 < graphs.split_replays < graphs.replays == engine.stats.num_steps - 1
