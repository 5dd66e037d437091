"""The exact reference the distribution tests compare with: a tiny target's distribution of
its first tokens computed from the model, the engine sampled many times, and chi-square.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import chisquare

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.kernels.sampling import SamplingRow, SamplingTensors, target_probs
from specbatch.models import load_model
from specbatch.spec_decode.control.choices import DRAFT, Candidate, Choice, lookup_way
from specbatch.spec_decode.proposers.base import Proposer
from tests.helpers import PagedHarness

V = 32
N = 12000  # samples per case: a chi-square over the first three tokens' ~100 cells
# every vocabulary id appears in the prompt, so a 1-gram always finds a continuation
PROMPT = [int(t) for t in np.random.default_rng(0).permutation(np.arange(3, V))] + [5, 6, 7]
# "7 a" for a third of the ids a: a 2-token lookup hits after about a third of first tokens
LOOKUP_PROMPT = PROMPT + [x for a in range(3, V, 3) for x in (7, a)] + [7]

PARAMS = {
    "plain": SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    "top-k-top-p": SamplingParams(
        temperature=0.8, top_k=10, top_p=0.85, max_tokens=3, ignore_eos=True
    ),
    "penalties": SamplingParams(
        temperature=1.0,
        repetition_penalty=1.5,
        presence_penalty=0.8,
        frequency_penalty=0.4,
        max_tokens=3,
        ignore_eos=True,
    ),
}


def exact_distribution(
    target: Path,
    params: SamplingParams,
    prompt: list[int] = PROMPT,
    quantization: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """P(t1, t2) as [V, V] and P(t3) as [V], from the target (loaded with ``quantization``)
    with the same processing."""
    model = load_model(target, quantization=quantization)

    def probs(histories: list[list[int]]) -> torch.Tensor:
        blocks = len(histories) * (len(prompt) // 16 + 2) + 8
        harness = PagedHarness(model, num_blocks=blocks, block_size=16)
        logits = harness.forward([(i, prompt + h) for i, h in enumerate(histories)])
        last = torch.stack([row[-1] for row in logits])
        rows = [SamplingRow(params, prompt, h, len(prompt) + len(h)) for h in histories]
        return target_probs(last, SamplingTensors.build(rows, V, last.device)).double()

    p1 = probs([[]])[0]
    p2 = probs([[a] for a in range(V)])  # [V, V]: row a = p(t2 | t1 = a)
    joint12 = p1[:, None] * p2
    p3 = probs([[a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    marginal3 = (joint12[:, :, None] * p3).sum((0, 1))
    return joint12.numpy(), marginal3.numpy()


def sample_engine(
    target: Path,
    speculative: dict[str, Any] | None,
    params: SamplingParams,
    seeded: bool = False,
    prompt: list[int] = PROMPT,
    proposer: Proposer | None = None,
    hook: Callable[[LLMEngine], None] | None = None,
    **config: Any,
) -> np.ndarray:
    """Each of N requests' first three tokens; ``config``: more EngineConfig fields."""
    engine = LLMEngine(
        EngineConfig(
            **config,
            model=str(target),
            num_kv_blocks=1400,
            block_size=16,
            max_model_len=64,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            # fixed k: every step verifies (the controller would draft only where it pays),
            # unless the config asks for the controller (then ``hook`` fixes its plan)
            speculative_config=(
                {"method": "off"} if speculative is None else {"adaptive_k": False, **speculative}
            ),
            seed=123,
        ),
        proposer=proposer,
    )
    if hook is not None:
        hook(engine)
    looked_up: list[bool] = []
    if speculative is not None and speculative.get("method") == "hybrid":
        choose_ways_at_random(engine, looked_up)
    tokens = np.zeros((N, 3), dtype=np.int64)
    pending = list(range(N))
    while pending or engine.has_unfinished_requests():
        # under the controller a step that computes a prompt carries no drafts: in waves
        wave = hook is None or not engine.has_unfinished_requests()
        while wave and pending and engine.num_unfinished_requests() < 256:
            i = pending.pop()
            engine.add_request(str(i), prompt, params.clone(seed=i) if seeded else params)
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id)] = out.outputs[0].token_ids[:3]
    if speculative is not None:
        assert engine.stats.num_draft_tokens > N // 2  # the verify path really ran
    if looked_up:  # both kinds of draft were verified
        assert 100 < sum(looked_up) < len(looked_up) - 100
    return tokens


def choose_ways_at_random(engine: LLMEngine, looked_up: list[bool]) -> None:
    """The fixed-k hybrid's way per sequence at random, so that both are verified: a match of
    2 tokens or more always, a shorter one or the draft model on a coin (``looked_up``
    records each choice)."""
    controller = engine.speculator.controller
    assert controller is not None
    coin = random.Random(0)

    def choose(candidates: list[Candidate]) -> list[Choice]:
        choices = []
        for c in candidates:
            lookup = bool(c.lookup) and (c.lookup_n >= 2 or coin.random() < 0.5)
            looked_up.append(lookup)
            way = lookup_way(c.lookup_n) if lookup else DRAFT
            drafts = min(c.slots, len(c.lookup)) if lookup else c.slots
            choices.append(Choice(way, drafts, (0.5,) * drafts))
        return choices

    controller.choose_ways = choose  # type: ignore[method-assign]


def assert_matches(tokens: np.ndarray, joint12: np.ndarray, marginal3: np.ndarray) -> None:
    observed12 = np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).astype(float)
    expected12 = joint12.reshape(-1) * N
    assert_chisquare(observed12, expected12)
    assert_chisquare(np.bincount(tokens[:, 2], minlength=V).astype(float), marginal3 * N)


def assert_chisquare(observed: np.ndarray, expected: np.ndarray) -> None:
    # Cells expected below 5 are pooled into one, as the chi-square approximation needs.
    small = expected < 5
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was produced"
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()
    assert chisquare(obs, exp)[1] > 1e-3
