"""The draft model's dtype: ``"auto"``'s rule, and outputs that do not depend on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch import LLMEngine
from specbatch.config import EngineConfig
from specbatch.spec_decode import factory
from specbatch.spec_decode.control.step_times import StepCost
from tests.helpers import TIGHT, network_proposer, outputs

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("native", [False, True])
def test_auto_is_bfloat16_only_for_packed_float32_on_native_bfloat16(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    monkeypatch.setattr(factory, "native_cpu_bfloat16", lambda: native)
    monkeypatch.setattr(factory, "cpu_packing_supported", lambda dtype: True)
    fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    assert factory.draft_dtype("auto", fp32, CPU, packed=True) == (bf16 if native else fp32)
    assert factory.draft_dtype("auto", fp32, CPU, packed=False) == fp32
    assert factory.draft_dtype("auto", fp16, CPU, packed=True) == fp16
    assert factory.draft_dtype("auto", fp32, CUDA, packed=True) == fp32
    assert factory.draft_dtype("auto", bf16, CUDA, packed=True) == bf16
    assert factory.draft_dtype("float32", bf16, CUDA, packed=True) == fp32
    assert factory.draft_dtype("bfloat16", fp32, CPU, packed=False) == bf16
    monkeypatch.setattr(factory, "cpu_packing_supported", lambda dtype: False)
    assert factory.draft_dtype("auto", fp32, CPU, packed=True) == fp32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tests.helpers import prompts_with_repeats

    return prompts_with_repeats(12, seed=23)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q8_0"])
def test_outputs_do_not_depend_on_the_draft_dtype(
    tiny_model_dir: Path, prompts: list[list[int]], dtype: str, sampled: bool
) -> None:
    """A float32 target with a draft model in each form (verify rows priced free, so the
    controller drafts wherever a draft may be accepted) generates what speculation off does,
    with preemption and chunked prefill in the batch. The draft is the target's own weights,
    so that many drafts are accepted (in bfloat16 or Q8_0 not all: their rounding differs)."""
    off = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), speculative_config={"method": "off"}, **TIGHT)
    )
    spec = {
        "method": "draft_model",
        "model": str(tiny_model_dir),
        "num_speculative_tokens": 3,
        "draft_dtype": dtype,
    }
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", speculative_config=spec, **TIGHT)
    )
    draft = network_proposer(engine).net.model  # type: ignore[attr-defined]
    assert draft.dtype == getattr(torch, dtype, torch.float32)
    assert draft.multiplies_blocks() == (dtype == "q8_0")
    controller = engine.speculator.controller
    assert controller is not None
    controller.times.fit = lambda tokens, seqs: StepCost(0.01, 0.0, 0.0, 0.0)  # type: ignore[method-assign]
    controller.draft_times.fit = lambda rows: (0.0, 0.0)  # type: ignore[method-assign]
    assert outputs(engine, prompts, sampled) == outputs(off, prompts, sampled)
    assert engine.stats.num_accepted_tokens > 0  # drafts were made and some accepted
