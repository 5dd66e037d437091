"""Constrained outputs under speculation equal the non-speculative constrained outputs, greedy
and seeded, token for token (tiny models; every proposer kind, k from 1 to 8, with preemption,
chunked prefill and prefix-cache hits in the batch); and each sequence's matcher is, after
every step, the matcher a fresh start fed its committed tokens would be, whatever the drafts
(refused mid-chain, an end of sequence among them, all rejected, tree branches that diverge).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specbatch import LLMEngine, SamplingParams, StructuredOutputsParams
from specbatch.config import EngineConfig
from specbatch.spec_decode.proposers.base import DraftRequest, Proposal, Proposer
from tests.helpers import OFF, check_blocks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["fox", "dog", "cache"]}, "maxItems": 2},
    },
    "required": ["name", "n", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"(fox|dog)-[0-9]{2,3}"
CHOICES = ["quick brown fox", "lazy dog", "paged attention"]
CONSTRAINTS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(regex=REGEX),
    StructuredOutputsParams(choice=CHOICES),
    StructuredOutputsParams(json_object=True),
]
SHARED = "The quick brown fox jumps over the lazy dog. Paged attention reads"  # a cached prefix
# small enough to preempt (20 blocks of 8 for up to 8 sequences of ~60 tokens), a token budget
# that chunks prompts, prefix caching on: the second wave finds the first wave's blocks
TIGHT = {
    "num_kv_blocks": 28,
    "block_size": 8,
    "max_model_len": 128,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 24,
    "enable_prefix_caching": True,
}


def params_of(i: int) -> SamplingParams:
    constraint = CONSTRAINTS[i % len(CONSTRAINTS)]
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=constraint)
    return SamplingParams(
        temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=80, structured_outputs=constraint
    )


def prompts(tokenizer: Any) -> list[list[int]]:
    texts = [f"{SHARED} {word}" for word in ("keys", "values", "tables", "blocks", "pages", "rows")]
    texts += ["def add(a, b):", "0123456789 0123", "Speculative decoding drafts", "The lazy dog"]
    return [tokenizer.encode(t) for t in texts]


def run(
    model: Path, speculative: dict[str, Any], backend: str = "llguidance"
) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            speculative_config=speculative,
            seed=5,
            structured_outputs_backend=backend,
            **TIGHT,
        )
    )
    ids = prompts(engine.tokenizer)
    done: dict[str, list[int]] = {}
    waves = [range(0, 6), range(6, len(ids))]
    cached = 0
    for wave in waves:  # the second wave arrives after the first has filled the prefix cache
        for i in wave:
            engine.add_request(str(i), ids[i], params_of(i))
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
                    cached += out.metrics.num_cached_tokens
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    assert cached > 0, "no prefix-cache hit"
    return [done[str(i)] for i in range(len(ids))], engine


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    outputs, engine = run(tiny_model_dir, OFF)
    assert engine.stats.num_preemptions > 0, "the batch was not preempted"
    tokenizer = engine.tokenizer
    finished = 0
    for i, tokens in enumerate(outputs):  # those that ended (not cut by max_tokens) are valid
        if tokens[-1] not in tokenizer.eos_token_ids:
            continue
        finished += 1
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        kind = CONSTRAINTS[i % len(CONSTRAINTS)].kind
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES
        else:
            assert isinstance(json.loads(text), dict)
    assert finished >= len(outputs) // 2
    return outputs


SPECS = [
    *({"method": "ngram", "num_speculative_tokens": k, "adaptive_k": False} for k in (1, 2, 4, 8)),
    *(
        {"method": "draft_model", "num_speculative_tokens": k, "adaptive_k": False, "draft": True}
        for k in (1, 2, 4, 8)
    ),
    {"method": "hybrid", "num_speculative_tokens": 4, "adaptive_k": False, "draft": True},
    {"method": "hybrid", "draft": True},  # the goodput controller
    {"method": "ngram", "lookup_tree": True, "num_speculative_tokens": 6, "adaptive_k": False},
    # the store of other requests' tokens: the second wave drafts from the first's outputs
    {"method": "suffix", "num_speculative_tokens": 4, "adaptive_k": False},
    {"method": "suffix", "lookup_tree": True, "num_speculative_tokens": 6, "adaptive_k": False},
    {"method": "suffix"},
    {
        "method": "draft_model",
        "num_speculative_tokens": 5,
        "adaptive_k": False,
        "draft_tree": True,
        "draft_tree_depth": 2,
        "draft_confidence_threshold": 0.0,
        "draft": True,
    },
]


@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: "-".join(f"{v}" for k, v in s.items() if k != "draft")
)
def test_speculation_gives_the_constrained_output_of_speculation_off(
    tiny_model_dir: Path, noisy_draft_dir: Path, reference: list[list[int]], spec: dict[str, Any]
) -> None:
    speculative = {k: v for k, v in spec.items() if k != "draft"}
    if spec.get("draft"):
        speculative["model"] = str(noisy_draft_dir)
    outputs, engine = run(tiny_model_dir, speculative)
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert got == want, f"request {i} ({params_of(i)})"
    stats = engine.stats
    assert stats.num_draft_tokens > 0, stats
    assert stats.num_accepted_tokens > 0, stats
    assert stats.num_forced_accepted_tokens > 0, stats  # the grammar's forced tokens drafted
    if spec["method"] == "suffix":  # the store's drafts were verified
        assert stats.num_draft_tokens_by_way.get("suffix", 0) > 0, stats.num_draft_tokens_by_way


@pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"
)
def test_the_xgrammar_backend_is_exact_under_speculation_too(
    tiny_model_dir: Path, noisy_draft_dir: Path
) -> None:
    reference, _ = run(tiny_model_dir, OFF, "xgrammar")
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive_k": False},
        {"method": "hybrid", "model": str(noisy_draft_dir)},
    ):
        outputs, engine = run(tiny_model_dir, spec, "xgrammar")
        assert outputs == reference, spec
        assert engine.stats.num_forced_draft_tokens > 0


# ------------------------------------------------------------------ the matcher invariant

BACKENDS = ["llguidance"] + (["xgrammar"] if importlib.util.find_spec("xgrammar") else [])


class Scripted(Proposer):
    """Drafts chosen at random from what the constraint allows, what it refuses and the end
    of sequence, as chains or as trees whose branches diverge at the root."""

    def __init__(self, seed: int, refuse: float, eos: float, trees: bool, eos_id: int) -> None:
        self.random = random.Random(seed)
        self.refuse, self.eos, self.trees, self.eos_id = refuse, eos, trees, eos_id

    def _chain(self, r: DraftRequest, prefix: list[int], length: int) -> list[int]:
        constraint = r.seq.constraint
        assert constraint is not None
        chain: list[int] = []
        for _ in range(length):
            roll = self.random.random()
            if roll < self.eos:
                token = self.eos_id
            elif roll < self.eos + self.refuse:
                token = self.random.randrange(3, 300)  # mostly refused
            else:
                allowed = np.flatnonzero(constraint.mask(prefix + chain))
                token = int(self.random.choice(allowed))
            chain.append(token)
        return chain

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens, parents = [], []
        for r in requests:
            if not self.trees or r.slots < 2:
                chain = self._chain(r, [], r.max_drafts)
                tokens.append(chain)
                parents.append(list(range(-1, len(chain) - 1)))
                continue
            half = r.slots // 2
            left = self._chain(r, [], half)
            right = self._chain(r, [], r.slots - half)
            if right[0] == left[0]:  # siblings differ (the other may be refused: fine)
                right[0] = 3 + (left[0] - 2) % 297
            tokens.append(left + right)
            parents.append(
                [j - 1 for j in range(half)] + [-1] + [half + j for j in range(len(right) - 1)]
            )
        return Proposal(tokens, parents=parents if self.trees else None)


@settings(
    max_examples=16,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**16),
    refuse=st.sampled_from([0.0, 0.3, 1.0]),  # 1.0: every draft refused, all rejected
    eos=st.sampled_from([0.0, 0.2]),
    trees=st.booleans(),
    sampled=st.booleans(),
    backend=st.sampled_from(BACKENDS),
)
def test_each_matcher_equals_a_fresh_one_fed_the_committed_tokens(
    tiny_model_dir: Path,
    seed: int,
    refuse: float,
    eos: float,
    trees: bool,
    sampled: bool,
    backend: str,
) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            speculative_config={"method": "external", "num_speculative_tokens": 6},
            seed=seed,
            structured_outputs_backend=backend,
            **TIGHT,
        ),
        proposer=Scripted(seed, refuse, eos, trees, eos_id=2),
    )
    ids = prompts(engine.tokenizer)
    for i, prompt in enumerate(ids[:8]):
        params = params_of(i)
        if not sampled:
            params = params.clone(temperature=0.0)
        engine.add_request(str(i), prompt, params)
    constraints = engine.intake.constraints
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
        steps += 1
        if steps == 7:
            engine.abort("3")  # abort mid-run
        for seq in engine.scheduler.running + engine.scheduler.waiting:
            if seq.constraint is None:
                continue
            fresh = constraints.new(constraints.compile(seq.params.structured_outputs))  # type: ignore[arg-type]
            fresh.commit(seq.output_token_ids)
            assert np.array_equal(seq.constraint.mask(), fresh.mask()), seq.request_id
            assert seq.constraint.done == fresh.done
        check_blocks(engine)
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
