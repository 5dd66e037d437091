"""Speculation across requests in the engine (tiny models): outputs equal speculation off,
greedy and seeded, alone and in the default, at batch 1 and 8, with preemption and chunked
prefill; the sampled distribution is the target's (chi-square); and the store's counters reach
the stats and ``/metrics``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from specbatch.spec_decode.config import SpeculativeConfig
from specbatch.spec_decode.control.choices import SUFFIX, Candidate, Choice, lookup_way
from tests.helpers import OFF, check_blocks, engine_kwargs
from tests.spec_decode.distribution import (
    PARAMS,
    assert_matches,
    exact_distribution,
    sample_engine,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts sent twice, and once more with their last token changed: the later requests
    find what the earlier ones generated in the store (their own prompt does not hold it)."""
    rng = np.random.default_rng(seed)
    first = [rng.integers(3, 300, int(rng.integers(6, 40))).tolist() for _ in range(8)]
    changed = [[*p[:-1], (p[-1] + 1) % 297 + 3] for p in first]
    return first + first + changed


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> list[list[int]]:
    """Outputs in waves of ``batch`` requests (a wave's requests finish before the next)."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        wave = [params if params.seed is None else params.clone(seed=i + j) for j in range(batch)]
        done = llm.generate(prompts[i : i + batch], wave[: len(prompts[i : i + batch])])
        out += [o.outputs[0].token_ids for o in done]
    return out


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path) -> dict[tuple[str, int], list[list[int]]]:
    plain = LLM(str(tiny_model_dir), speculative_config=OFF, **engine_kwargs())
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=0, ignore_eos=True)
    return {
        (kind, batch): run(plain, workload(), params, batch)
        for kind, params in (("greedy", GREEDY), ("seeded", seeded))
        for batch in (1, 8)
    }


SPECS = {
    "suffix": {"method": "suffix"},
    "suffix-fixed-k": {"method": "suffix", "adaptive_k": False, "num_speculative_tokens": 4},
    "suffix-trees": {
        "method": "suffix",
        "adaptive_k": False,
        "num_speculative_tokens": 6,
        "lookup_tree": True,
    },
    "default": {},  # auto: the store beside prompt lookup for a target without a draft
    "hybrid": {"method": "hybrid", "draft": True},
}


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("name", SPECS)
def test_outputs_equal_speculation_off(
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    references: dict[tuple[str, int], list[list[int]]],
    name: str,
    kind: str,
    batch: int,
) -> None:
    spec = dict(SPECS[name])
    if spec.pop("draft", False):
        spec["model"] = str(tiny_draft_dir)
    # tight: preempted at batch 8; a token budget that chunks the longer prompts
    llm = LLM(
        str(tiny_model_dir),
        speculative_config=spec or None,
        **engine_kwargs(num_kv_blocks=20, max_model_len=96, max_num_batched_tokens=32),
    )
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=0, ignore_eos=True)
    params = GREEDY if kind == "greedy" else seeded
    assert run(llm, workload(), params, batch) == references[(kind, batch)]
    engine = llm.llm_engine
    check_blocks(engine)
    stats = engine.stats
    assert stats.suffix_store_requests > 0
    assert stats.suffix_hits > 0
    if name.startswith("suffix") and kind == "greedy":  # the store's drafts were verified
        assert stats.num_accepted_tokens_by_way.get(SUFFIX, 0) > 0, stats
    if batch == 8:  # a wave of 8 outgrows 20 blocks
        assert stats.num_preemptions > 0


def test_the_store_is_off_where_asked_and_refused_where_meaningless(tiny_model_dir: Path) -> None:
    assert SpeculativeConfig(method="auto").store_tokens > 0
    assert SpeculativeConfig(method="ngram").store_tokens == 0
    assert SpeculativeConfig(method="auto", suffix_store_tokens=0).resolved(False).method == "ngram"
    assert SpeculativeConfig(method="auto").resolved(False).method == "suffix"
    for bad in (
        {"method": "ngram", "suffix_store_tokens": 1000},
        {"method": "draft_model", "suffix_store_tokens": 1000},
        {"method": "suffix", "suffix_store_tokens": 0},
        {"method": "suffix", "suffix_store_tokens": -1},
        {"method": "suffix", "suffix_store_tokens": True},
        {"method": "suffix", "suffix_store_tokens": "big"},
    ):
        with pytest.raises(ConfigError, match="suffix"):
            SpeculativeConfig.parse(bad)
    llm = LLM(
        str(tiny_model_dir),
        speculative_config={"method": "auto", "suffix_store_tokens": 0},
        **engine_kwargs(),
    )
    run(llm, workload()[:8], GREEDY, 8)
    assert llm.llm_engine.speculator.store_stats() is None
    assert llm.llm_engine.stats.suffix_store_requests == 0


def choose_the_store(engine: LLMEngine) -> None:
    """Under a fixed k, the store's drafts wherever it has a match (else the own lookup's),
    so that the store's drafts are verified whenever they exist."""
    controller = engine.speculator.controller
    assert controller is not None

    def choose(candidates: list[Candidate]) -> list[Choice]:
        choices = []
        for c in candidates:
            if c.suffix:
                way, drafts = SUFFIX, min(c.slots, len(c.suffix))
            elif c.lookup:
                way, drafts = lookup_way(c.lookup_n), min(c.slots, len(c.lookup))
            else:
                choices.append(Choice(None, 0))
                continue
            choices.append(Choice(way, drafts, (0.5,) * drafts))
        return choices

    controller.choose_ways = choose  # type: ignore[method-assign]


@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("params_name", ["plain", "top-k-top-p"])
def test_sampling_from_the_store_keeps_the_targets_distribution(
    models: tuple[Path, Path], params_name: str, trees: bool
) -> None:
    """Every request has the same prompt: the store holds earlier requests' sampled tokens,
    and its drafts (the most frequent continuation, or a tree of the frequent ones: point
    masses, siblings among them) are verified in every step after the first wave."""
    target, _ = models
    # 5 tokens: the first three decided with up to 3 drafts (a tree's 3 nodes) after the first
    params = PARAMS[params_name].clone(max_tokens=5)
    spec: dict[str, Any] = {"method": "suffix", "num_speculative_tokens": 3, "lookup_tree": trees}
    engines: list[LLMEngine] = []

    def hook(engine: LLMEngine) -> None:
        choose_the_store(engine)
        engines.append(engine)

    joint12, marginal3 = exact_distribution(target, params)
    assert_matches(sample_engine(target, spec, params, hook=hook), joint12, marginal3)
    stats = engines[0].stats
    assert stats.num_draft_tokens_by_way.get(SUFFIX, 0) > 5000, stats.num_draft_tokens_by_way
    if trees:
        assert stats.num_tree_drafts > 1000


def test_metrics_show_the_store(tiny_model_dir: Path) -> None:
    from specbatch.server.metrics import ServerMetrics

    class Served:
        def __init__(self, engine: LLMEngine) -> None:
            self.engine = engine
            self.on_finished: list[Any] = []

        def stats_by_replica(self) -> list[Any]:
            return [(None, self.engine.stats, 0)]

    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), speculative_config={"method": "suffix"})
    )
    for i, prompt in enumerate(workload()):
        engine.add_request(str(i), prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
    text = ServerMetrics(Served(engine), "m").render().decode()  # type: ignore[arg-type]
    stats = engine.stats
    assert stats.suffix_store_requests == len(workload())
    for line in (
        f'specbatch_spec_suffix_store_requests{{model_name="m"}} {float(len(workload()))}',
        f'specbatch_spec_suffix_hits_total{{model_name="m"}} {float(stats.suffix_hits)}',
        'specbatch_spec_decode_num_accepted_tokens_by_way_total{model_name="m",way="suffix"} '
        f"{float(stats.num_accepted_tokens_by_way[SUFFIX])}",
    ):
        assert line in text, line
    assert stats.suffix_hits > 0
    assert stats.num_accepted_tokens_by_way[SUFFIX] > 0
