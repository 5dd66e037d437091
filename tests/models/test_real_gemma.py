"""The real Gemma 3 270M Q4_K_M file (four chunk wheels on PyPI, joined in the cache): its
greedy text in the exact mode (Q4_K, Q6_K, Q5_0 and Q8_0 multiplied as stored, sliding and
global layers, q/k norms, GeGLU) equal to transformers' on the same file (dequantised), token
for token. Skipped where the file cannot be fetched."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.models.gguf_file import GGUFFile
from tests.helpers import OFF
from tests.real_gemma import gemma_path

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def gemma() -> Path:
    path = gemma_path()
    if path is None:
        pytest.skip("the Gemma 3 270M Q4_K_M packages cannot be fetched here")
    return path


def test_the_file_is_the_typical_q4_k_m_mix(gemma: Path) -> None:
    with GGUFFile(gemma) as handle:
        kinds = Counter(t.type_name for t in handle.tensors)
    assert kinds == {"Q4_K": 27, "Q6_K": 9, "Q5_0": 81, "Q8_0": 10, "F32": 109}


def test_greedy_text_equals_transformers_on_the_same_file(gemma: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(gemma), max_model_len=512, speculative_config=OFF)
    assert llm.llm_engine.weight_mode.quantization == "gguf"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    del llm
    reference = AutoModelForCausalLM.from_pretrained(
        str(gemma.parent), gguf_file=gemma.name, dtype=torch.float32
    ).eval()
    for out in outputs:
        ids = list(out.prompt_token_ids)
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
            )[0, len(ids) :].tolist()
        assert list(out.outputs[0].token_ids) == expected, out.prompt
