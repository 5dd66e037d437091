"""Float models run every decoder layer as one C call (``kernels/fused_layers.py``) where their
linears allow: float32 in MKL's packed layout, bfloat16 as AMX tiles. The same bits as the
per-op path, and the plain product's values within rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch.kernels import amx_linear, sgemm
from specbatch.kernels.amx_linear import TileWeight
from specbatch.kernels.linear import Linear
from specbatch.kernels.onednn import OneDnnWeight
from specbatch.kernels.sgemm import SgemmWeight
from specbatch.models import LlamaForCausalLM, load_model
from tests.helpers import (
    PagedHarness,
    assert_fused_equals_per_op,
    mixed_workload_logits,
    tiny_config,
    write_hf_checkpoint,
)

needs_mkl = pytest.mark.skipif(
    not sgemm.available(), reason="MKL's packed GEMM is not exported by this torch"
)
needs_amx = pytest.mark.skipif(not amx_linear.available(), reason="no AMX tiles on this CPU")


@pytest.fixture(scope="module")
def packed_smollm2(default_gguf: Path) -> LlamaForCausalLM:
    model = load_model(default_gguf, dtype=torch.float32)
    assert model.pack_for_cpu()
    return model


@needs_mkl
def test_smollm2_float32_layers_run_fused_with_the_per_op_bits(
    packed_smollm2: LlamaForCausalLM,
) -> None:
    """Prefills of 300 and 37 tokens in one step, decodes and a 5-token verify-like step."""
    model = packed_smollm2
    assert all(isinstance(m.form, SgemmWeight) for m in model.layer_linears())
    assert model.fused.applies()
    assert_fused_equals_per_op(model, lambda: mixed_workload_logits(model))


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.float32, marks=needs_mkl), pytest.param(torch.bfloat16, marks=needs_amx)],
)
@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias"])
def test_fused_layers_match_the_unpacked_model(
    tmp_path: Path, variant: str, dtype: torch.dtype
) -> None:
    """A tiny model (biases on q/k/v, or a tied head): packed and fused against the same
    weights multiplied by torch's plain product (float32: within float32 rounding; bfloat16:
    within a few bfloat16 roundings, which land in other places)."""
    overrides = (
        {"tie_word_embeddings": True}
        if variant == "llama-tied"
        else {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "attention_bias": True,
        }
    )
    config = tiny_config(hidden_size=64, intermediate_size=128, **overrides)
    write_hf_checkpoint(tmp_path / "hf", config)
    plain = load_model(tmp_path / "hf", dtype=dtype)
    packed = load_model(tmp_path / "hf", dtype=dtype)
    assert packed.pack_for_cpu()
    assert packed.fused.applies()
    assert not plain.fused.applies()
    prompt = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator()).tolist()
    expected = PagedHarness(plain).forward([(0, prompt)])[0].float()
    fused = PagedHarness(packed).forward([(0, prompt)])[0].float()
    if dtype == torch.float32:
        torch.testing.assert_close(fused, expected, rtol=0, atol=1e-4)
    else:
        torch.testing.assert_close(fused, expected, rtol=0.05, atol=0.05)
    assert_fused_equals_per_op(packed, lambda: [PagedHarness(packed).forward([(0, prompt)])[0]])


@needs_mkl
def test_without_mkl_float32_keeps_onednn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where MKL's packed GEMM is missing or fails its probe, float32 weights take oneDNN's
    layout and the layers run per op, with the plain product's values."""
    monkeypatch.setattr(sgemm, "_library", lambda: None)
    config = tiny_config(hidden_size=64, intermediate_size=128)
    write_hf_checkpoint(tmp_path / "hf", config)
    plain = load_model(tmp_path / "hf", dtype=torch.float32)
    packed = load_model(tmp_path / "hf", dtype=torch.float32)
    assert packed.pack_for_cpu()
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.form, OneDnnWeight) for m in linears)
    assert not packed.fused.applies()
    prompt = list(range(1, 30))
    torch.testing.assert_close(
        PagedHarness(packed).forward([(0, prompt)])[0],
        PagedHarness(plain).forward([(0, prompt)])[0],
        rtol=0,
        atol=1e-4,
    )


@needs_mkl
def test_the_probe_refuses_a_product_whose_rows_depend_on_their_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    library = sgemm._torch_library()
    assert library is not None
    assert sgemm._probe(library)
    multiply = sgemm._multiply

    def batch_dependent(lib: object, x: torch.Tensor, data: torch.Tensor, n: int) -> torch.Tensor:
        out = multiply(library, x, data, n)
        return out + 1e-6 if x.shape[0] == 1 else out  # one row alone: other bits

    monkeypatch.setattr(sgemm, "_multiply", batch_dependent)
    assert not sgemm._probe(library)


@needs_amx
def test_smollm2_bfloat16_layers_run_fused_with_the_per_op_bits(default_gguf: Path) -> None:
    """Every rounding of the bfloat16 per-op path (products, bias and residual adds, norms,
    SiLU-gate, attention output) made in the same place by the fused layer."""
    model = load_model(default_gguf, dtype=torch.bfloat16)
    assert model.pack_for_cpu()
    assert all(isinstance(m.form, TileWeight) for m in model.layer_linears())
    assert model.fused.applies()
    assert_fused_equals_per_op(model, lambda: mixed_workload_logits(model))
