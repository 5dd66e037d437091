"""Draft trees in a ragged step: depth positions, ancestor masks, and the accepted path's move.

The references are obvious: a node's depth and ancestors come from walking its parent array,
and a tree node's logits must equal those of its path computed as an ordinary chain over a
fresh cache; after the accepted path's K/V are moved to contiguous positions, the next token's
logits must equal a recompute of the accepted text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specbatch.cache.kv_tensors import allocate_kv_caches, move_slots
from specbatch.kernels.attention import PAD_SLOT, LayerKVCache
from specbatch.models.llama import LlamaForCausalLM
from specbatch.models.loader import load_model
from specbatch.runner.flat_batch import FlatBatch, TokenRun, flatten
from tests.helpers import PagedHarness


def random_parents(rng: np.random.Generator, count: int) -> list[int]:
    return [int(rng.integers(-1, i)) for i in range(count)]


def ancestors(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_runs_get_depth_positions_index_slots_and_ancestor_masks() -> None:
    rng = np.random.default_rng(0)
    for _ in range(60):
        block_size = int(rng.choice([4, 16]))
        runs, parents_of = [], []
        for _ in range(int(rng.integers(1, 5))):
            start = int(rng.integers(0, 30))
            kind = rng.choice(["prefill", "chain", "tree", "tree+fillers"])
            drafts = int(rng.integers(1, 7))
            parents = random_parents(rng, drafts) if "tree" in kind else None
            fillers = int(rng.integers(1, 3)) if kind == "tree+fillers" else 0
            count = int(rng.integers(1, 9)) if kind == "prefill" else 1 + drafts
            held = -(-(start + count) // block_size)
            table = rng.permutation(100)[:held].tolist()
            tokens = list(range(count + fillers))
            num_drafts = 0 if kind == "prefill" else drafts
            runs.append(TokenRun(tokens, start, table, num_drafts, fillers, parents))
            parents_of.append(parents)
        batch = flatten(runs, block_size)
        mask = batch.attention.tree_mask
        assert (mask is not None) == any(p is not None for p in parents_of)
        row = 0
        for run, parents in zip(runs, parents_of, strict=True):
            real = len(run.token_ids) - run.num_unslotted
            for i in range(len(run.token_ids)):
                slot = int(batch.attention.slot_mapping[row + i])
                if i >= real:
                    assert slot == PAD_SLOT
                else:  # written at its index: siblings never share a slot
                    position = run.start_position + i
                    block = run.block_table[position // block_size]
                    assert slot == block * block_size + position % block_size
                if parents is not None and 0 < i < real:
                    path = ancestors(parents, i - 1)
                    assert batch.positions[row + i] == run.start_position + len(path)
                    assert mask is not None
                    visible = {0} | {1 + n for n in path}
                    assert set(np.flatnonzero(mask[row + i]).tolist()) == visible
                else:
                    if parents is None or i == 0:
                        assert batch.positions[row + i] == run.start_position + i
                    if mask is not None and i < real:  # a chain row stays causal
                        assert np.flatnonzero(mask[row + i]).tolist() == list(range(i + 1))
            row += len(run.token_ids)


def test_a_bad_tree_is_refused() -> None:
    with pytest.raises(ValueError, match="parent"):
        TokenRun([5, 6, 7], 3, [0], 2, draft_parents=[-1, 1])
    with pytest.raises(ValueError, match="one token"):
        TokenRun([5, 6, 7], 3, [0], 2, draft_parents=[-1])
    with_fillers = TokenRun([5, 6, 7], 3, [0], 2, draft_parents=[-1, -1]).with_fillers(4)
    assert with_fillers.draft_parents == [-1, -1]
    assert with_fillers.num_unslotted == 2


@pytest.fixture(scope="module", params=["cpu", "torch"])
def model(request: pytest.FixtureRequest, tiny_model_dir: Path) -> LlamaForCausalLM:
    return load_model(tiny_model_dir, attention_backend=request.param)


def run_batch(
    model: LlamaForCausalLM, caches: list[LayerKVCache], batch: FlatBatch
) -> torch.Tensor:
    model.bind_kv_caches(caches)  # the references bind caches of their own
    metadata = model.backend.build_metadata(batch.attention, model.device)
    with torch.no_grad():
        hidden = model(torch.tensor(batch.input_ids), torch.tensor(batch.positions), metadata)
        return model.compute_logits(hidden)


def chain_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """The last row's logits of ``tokens`` computed from scratch as one chain."""
    return PagedHarness(model, num_blocks=64, block_size=8, seed=3).forward([(0, tokens)])[0][-1]


@pytest.mark.parametrize("seed", range(4))
def test_a_tree_forward_equals_each_path_as_a_chain_and_its_moved_path_a_recompute(
    model: LlamaForCausalLM, seed: int
) -> None:
    """Two sequences in one step, each verifying a random tree, beside a prefill chunk; then
    a random accepted path per tree is moved into place and the next decode is compared with
    a recompute of prompt + path."""
    rng = np.random.default_rng(seed)
    block_size = 4  # trees cross block boundaries
    num_blocks = 64
    caches = allocate_kv_caches(model.config, num_blocks, block_size, model.dtype, "cpu")
    free = rng.permutation(num_blocks).tolist()
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, int(rng.integers(5, 14))).tolist() for _ in range(3)]
    tables = [[free.pop() for _ in range(8)] for _ in prompts]
    # the prompts, all but their last token (the trees' root) for the first two
    prefill = [
        TokenRun(p[:-1] if i < 2 else p, 0, t)
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    run_batch(model, caches, flatten(prefill, block_size))
    trees = []
    for _ in range(2):
        count = int(rng.integers(2, 9))
        parents = random_parents(rng, count)
        trees.append((rng.integers(3, vocab, count).tolist(), parents))
    runs = [
        TokenRun([prompts[i][-1], *tokens], len(prompts[i]) - 1, tables[i], len(tokens), 0, parents)
        for i, (tokens, parents) in enumerate(trees)
    ]
    chunk = rng.integers(3, vocab, 3).tolist()
    runs.append(TokenRun(chunk, len(prompts[2]), tables[2]))
    batch = flatten(runs, block_size)
    logits = run_batch(model, caches, batch)
    rows = np.split(np.arange(len(logits)), batch.query_start[1:-1])
    for i, (tokens, parents) in enumerate(trees):
        for node in range(-1, len(tokens)):
            path = [tokens[n] for n in ancestors(parents, node)] if node >= 0 else []
            expected = chain_logits(model, prompts[i] + path)
            torch.testing.assert_close(logits[rows[i][1 + node]], expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        logits[rows[2][-1]], chain_logits(model, prompts[2] + chunk), atol=2e-5, rtol=1e-5
    )
    # accept a random root-to-node path of each tree and move it into place
    sources, targets, accepted = [], [], []
    for i, (tokens, parents) in enumerate(trees):
        path = ancestors(parents, int(rng.integers(-1, len(tokens))))
        start = len(prompts[i])  # the root sits at start - 1, node n was written at start + n
        for depth, node in enumerate(path):
            for slots, position in ((sources, start + node), (targets, start + depth)):
                table = tables[i]
                slots.append(table[position // block_size] * block_size + position % block_size)
        accepted.append([tokens[n] for n in path])
    move_slots(caches, torch.tensor(sources), torch.tensor(targets))
    following = [int(t) for t in rng.integers(3, vocab, 2)]
    decodes = [
        TokenRun([following[i]], len(prompts[i]) + len(accepted[i]), tables[i]) for i in range(2)
    ]
    after = run_batch(model, caches, flatten(decodes, block_size))
    for i in range(2):
        expected = chain_logits(model, prompts[i] + accepted[i] + [following[i]])
        torch.testing.assert_close(after[i], expected, atol=2e-5, rtol=1e-5)


def test_move_slots_reads_every_source_before_writing() -> None:
    """Overlapping moves (a slot both a target and another move's source) use old values."""
    cache = torch.arange(2 * 4 * 1 * 2, dtype=torch.float32).view(2, 4, 1, 2)
    caches = [(cache, cache.clone() * -1)]
    before = [c.clone() for c in caches[0]]
    move_slots(caches, torch.tensor([2, 5, 7]), torch.tensor([1, 2, 3]))
    for old, new in zip(before, caches[0], strict=True):
        flat_old, flat_new = old.view(8, 1, 2), new.view(8, 1, 2)
        for source, target in ((2, 1), (5, 2), (7, 3)):
            assert torch.equal(flat_new[target], flat_old[source])
        for untouched in (0, 4, 5, 6, 7):
            assert torch.equal(flat_new[untouched], flat_old[untouched])
    with pytest.raises(ValueError, match="one target"):
        move_slots(caches, torch.tensor([1, 2]), torch.tensor([3]))
