"""Constrained sampling stays exact under speculation: what is emitted is distributed as the
target's masked distribution, with a probabilistic drafter (its q masked too) and with point
masses cut at the first draft the constraint refuses.

Two levels: the verify step alone on a toy vocabulary and a toy automaton (chi-square of the
emitted tokens against the masked target, 20,000 samples), and the engine end to end on a tiny
model under a real llguidance constraint (chi-square of whole outputs against the exact
distribution enumerated from the target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specbatch import LLMEngine, SamplingParams, StructuredOutputsParams
from specbatch.config import EngineConfig
from specbatch.kernels.sampling import SamplingRow, SamplingTensors, target_probs
from specbatch.models import load_model
from specbatch.spec_decode.verification.chain import verify
from specbatch.structured.manager import Constraints
from specbatch.tokenizer import load_tokenizer
from tests.helpers import PagedHarness, write_tiny_model
from tests.spec_decode.distribution import assert_chisquare

V = 12
N = 20_000
RANDOM = SamplingParams(temperature=1.0)


def _toy_mask(history: tuple[int, ...]) -> np.ndarray:
    """A toy automaton: after token t only tokens of the same parity as t + len(history) are
    allowed, and never more than 8 of them (the first position allows 0..7)."""
    mask = np.zeros(V, dtype=bool)
    if not history:
        mask[:8] = True
        return mask
    parity = (history[-1] + len(history)) % 2
    mask[parity::2] = True
    mask[history[-1] % V] = False  # and not the same token twice in a row
    return mask


def _masked(p: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    p = p.clone().double()
    p[~torch.from_numpy(mask)] = 0.0
    return p / p.sum()


@pytest.mark.parametrize("drafter", ["masked-q", "point-mass"])
def test_verify_under_masks_emits_the_masked_target(drafter: str) -> None:
    """Two drafts per sequence. ``masked-q``: drafts sampled from a random q masked by the
    automaton (as a draft model's rows are). ``point-mass``: drafts drawn at random from the
    whole vocabulary, cut after the first one the automaton refuses (as the speculator does),
    that one kept and rejected with certainty. The first two emitted tokens must follow the
    masked target exactly."""
    gen = torch.Generator().manual_seed(3)
    logits_first = torch.randn(V, generator=gen) * 1.5
    logits_next = torch.randn(V, V, generator=gen) * 1.5  # row a: the logits after token a
    q_first = torch.rand(V, generator=gen) ** 2
    q_next = torch.rand(V, V, generator=gen) ** 2
    rng = np.random.default_rng(0)
    all_logits, rows, drafts, q_rows = [], [], [], []
    for _ in range(N):
        chain: list[int] = []
        qs: list[torch.Tensor] = []
        for depth in range(2):
            history = tuple(chain)
            if drafter == "masked-q":
                q = _masked(q_first if depth == 0 else q_next[chain[-1]], _toy_mask(history))
                token = int(rng.choice(V, p=q.numpy()))
                qs.append(q.float())
            else:
                token = int(rng.integers(V))
            chain.append(token)
            if not _toy_mask(history)[token]:
                break  # the refused draft stays; nothing after it
        for j in range(len(chain) + 1):
            history = tuple(chain[:j])
            allowed = (
                _toy_mask(history)
                if all(_toy_mask(history[:i])[history[i]] for i in range(j))
                else np.ones(V, dtype=bool)
            )
            all_logits.append(logits_first if j == 0 else logits_next[chain[j - 1]])
            rows.append(SamplingRow(RANDOM, [], list(history), j, allowed=allowed))
        drafts.append(chain)
        q_rows += qs
    q_tensor = torch.stack(q_rows) if drafter == "masked-q" else None
    result = verify(
        torch.stack(all_logits), rows, drafts, q_tensor, torch.Generator().manual_seed(9)
    )
    first = np.array([tokens[0] for tokens in result.tokens])
    p1 = _masked(logits_first.softmax(-1), _toy_mask(()))
    assert_chisquare(np.bincount(first, minlength=V).astype(float), p1.numpy() * N)
    # the second token, where the sequence emitted two: P(t2 | t1) summed over t1 given 2 emitted
    # is not the marginal, so condition on t1 instead: the most frequent first token's rows
    top = int(np.bincount(first).argmax())
    seconds = np.array([t[1] for t in result.tokens if len(t) > 1 and t[0] == top])
    p2 = _masked(logits_next[top].softmax(-1), _toy_mask((top,)))
    assert_chisquare(np.bincount(seconds, minlength=V).astype(float), p2.numpy() * len(seconds))


# ------------------------------------------------------------------ the engine, end to end

REGEX = "[a-d]{1,2}x"  # a short finite language: every output is enumerable
PARAMS = SamplingParams(
    temperature=1.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=REGEX)
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("structured-dist")
    return write_tiny_model(base / "target", seed=20), write_tiny_model(base / "draft", seed=21)


PROMPT = [5, 6, 7, 8]


def exact_outputs(target: Path) -> dict[tuple[int, ...], float]:
    """Every output the constraint allows (EOS included) and its probability under the
    target's masked distribution, by walking the language's token tree."""
    model = load_model(target)
    tokenizer = load_tokenizer(target)
    constraints = Constraints(tokenizer, model.config.vocab_size)
    grammar = constraints.compile(PARAMS.structured_outputs)  # type: ignore[arg-type]
    eos = tokenizer.eos_token_ids
    outcomes: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        harness = PagedHarness(model, num_blocks=len(frontier) * 2 + 8, block_size=16)
        logits = harness.forward([(i, PROMPT + list(h)) for i, (h, _) in enumerate(frontier)])
        last = torch.stack([row[-1] for row in logits])
        rows = []
        for history, _ in frontier:
            constraint = constraints.new(grammar)
            constraint.commit(history)
            rows.append(
                SamplingRow(
                    PARAMS,
                    PROMPT,
                    list(history),
                    len(PROMPT) + len(history),
                    allowed=constraint.mask(),
                )
            )
        probs = target_probs(last, SamplingTensors.build(rows, last.shape[1], last.device)).double()
        grown = []
        for (history, weight), row in zip(frontier, probs, strict=True):
            for token in np.flatnonzero(row.numpy() > 0):
                path = (*history, int(token))
                if int(token) in eos:
                    outcomes[path] = weight * float(row[token])
                else:
                    grown.append((path, weight * float(row[token])))
        frontier = grown
    assert abs(sum(outcomes.values()) - 1.0) < 1e-6
    return outcomes


def sample_outputs(
    target: Path, speculative: dict[str, Any], samples: int
) -> list[tuple[int, ...]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(target),
            num_kv_blocks=600,
            block_size=16,
            max_model_len=64,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            speculative_config=speculative,
            seed=7,
        )
    )
    out: list[tuple[int, ...]] = []
    pending = samples
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_unfinished_requests() < 256:
            pending -= 1
            engine.add_request(str(pending), PROMPT, PARAMS)
        for o in engine.step():
            if o.finished:
                out.append(tuple(o.outputs[0].token_ids))
    if speculative.get("method") != "off":
        assert engine.stats.num_draft_tokens > samples // 4  # the verify path really ran
    return out


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "off"},
        {"method": "draft_model", "num_speculative_tokens": 2, "adaptive_k": False},
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "adaptive_k": False,
            "prompt_lookup_min": 1,
        },
    ],
    ids=["off", "draft-model", "ngram"],
)
def test_engine_outputs_follow_the_masked_target(
    models: tuple[Path, Path], speculative: dict[str, Any]
) -> None:
    target, draft = models
    if speculative["method"] == "draft_model":
        speculative = {**speculative, "model": str(draft)}
    exact = exact_outputs(target)
    samples = 4_000  # the verify alone is tested on 20,000 above; this is the whole path
    seen = sample_outputs(target, speculative, samples)
    assert set(seen) <= set(exact), "an output the constraint does not allow"
    keys = sorted(exact)
    observed = np.array([sum(1 for s in seen if s == k) for k in keys], dtype=float)
    expected = np.array([exact[k] for k in keys]) * samples
    assert_chisquare(observed, expected)
