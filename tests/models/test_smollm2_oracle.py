"""SmolLM2-135M from its GGUF: float32 logits equal HF transformers' on the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch.models import LlamaForCausalLM
from tests.helpers import PagedHarness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_reference(default_gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def prompt_and_reference(hf_reference: torch.nn.Module) -> tuple[list[int], torch.Tensor]:
    prompt = torch.randint(0, 49152, (117,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        logits = hf_reference(torch.tensor([prompt])).logits[0]
    return prompt, logits


def _max_relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def test_prefill_matches_hf(
    smollm2: LlamaForCausalLM, prompt_and_reference: tuple[list[int], torch.Tensor]
) -> None:
    prompt, expected = prompt_and_reference
    # block size 16 does not divide 117; the harness shuffles the block table.
    got = PagedHarness(smollm2, num_blocks=16, block_size=16, seed=5).forward([(0, prompt)])[0]
    assert _max_relative_error(got, expected) < 1e-4


def test_token_by_token_decode_matches_hf(
    smollm2: LlamaForCausalLM, prompt_and_reference: tuple[list[int], torch.Tensor]
) -> None:
    prompt, expected = prompt_and_reference
    harness = PagedHarness(smollm2, num_blocks=32, block_size=10, seed=9)
    first = harness.forward([(0, prompt[:60])])[0]
    rows = [first] + [harness.forward([(0, [tok])])[0] for tok in prompt[60:]]
    assert _max_relative_error(torch.cat(rows), expected) < 1e-4
