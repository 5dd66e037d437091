"""One ragged forward mixing prefills, chunks, decodes and verify queries equals each run alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch.models import LlamaForCausalLM, load_model
from tests.helpers import PagedHarness, tiny_config, write_hf_checkpoint


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_ragged(model: LlamaForCausalLM, block_size: int, atol: float) -> None:
    vocab = model.config.vocab_size
    # (history already in the cache, tokens of this step): prefill, chunk, decode, verify, decode
    plan = [
        ([], _tokens(37, vocab, 1)),
        (_tokens(20, vocab, 2), _tokens(23, vocab, 3)),
        (_tokens(41, vocab, 4), _tokens(1, vocab, 5)),
        (_tokens(18, vocab, 6), _tokens(5, vocab, 7)),
        (_tokens(3, vocab, 8), _tokens(1, vocab, 9)),
    ]
    together = PagedHarness(model, num_blocks=80, block_size=block_size, seed=11)
    history = [(seq, hist) for seq, (hist, _) in enumerate(plan) if hist]
    together.forward(history)
    batched = together.forward([(seq, new) for seq, (_, new) in enumerate(plan)])
    for seq, (hist, new) in enumerate(plan):
        alone = PagedHarness(model, num_blocks=80, block_size=block_size, seed=seq)
        if hist:
            alone.forward([(0, hist)])
        expected = alone.forward([(0, new)])[0]
        torch.testing.assert_close(batched[seq], expected, rtol=0, atol=atol)


def test_ragged_batch_equals_alone_tiny(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, tiny_config())
    _check_ragged(load_model(tmp_path), block_size=8, atol=1e-5)


@pytest.mark.slow
def test_ragged_batch_equals_alone_smollm2(smollm2: LlamaForCausalLM) -> None:
    _check_ragged(smollm2, block_size=16, atol=1e-4)
