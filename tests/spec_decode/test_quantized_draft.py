"""The shipped draft held as Q8_0 blocks (``draft_dtype="q8_0"``, ``"auto"`` under a target of
GGUF blocks): ggml's quantisation bit for bit, every product against float64, the whole draft
against its dequantised float32 self, the digest of its blocks, and the fused layers' bits."""

from __future__ import annotations

import copy
import dataclasses

import gguf
import numpy as np
import pytest
import torch

from specbatch.errors import ConfigError, ModelLoadError
from specbatch.kernels.block_forms import RepackedForm
from specbatch.kernels.gguf_linear import quantize_q8_0
from specbatch.kernels.linear import Linear
from specbatch.models import LlamaForCausalLM, load_model
from specbatch.models.llama import QuantizedEmbedding
from specbatch.spec_decode.factory import draft_dtype, quantized_draft
from specbatch.spec_decode.proposers.shipped import check_shipped_q8_0, default_draft_path
from tests.helpers import PagedHarness, assert_fused_equals_per_op
from tests.kernels.test_gguf_linear import assert_near_product

Q8_0 = gguf.GGMLQuantizationType.Q8_0
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def plain_draft() -> LlamaForCausalLM:
    return load_model(default_draft_path(), torch.float32)


@pytest.fixture(scope="module")
def q8_draft(plain_draft: LlamaForCausalLM) -> LlamaForCausalLM:
    draft = copy.deepcopy(plain_draft)
    draft.quantize_for_cpu()
    return draft


def _linears(model: LlamaForCausalLM) -> dict[str, Linear]:
    """The decoder layers' linears by name (the LM head apart)."""
    linears = model.named_modules()
    return {name: m for name, m in linears if isinstance(m, Linear) and m is not model.lm_head}


@pytest.mark.parametrize("seed", range(6))
def test_the_quantizer_is_ggmls_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    scale = [1e-30, 1e-4, 1.0, 3e4][seed % 4]
    weight = (rng.standard_normal((19, 160)) * scale).astype(np.float32)
    weight[0, :32] = 0  # d = 0
    weight[1, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves: away from zero
    weight[2, :32] = rng.integers(-127, 128, 32).astype(np.float32) * np.float32(0.01)
    weight[3, 32:64] = -weight[3, 32:64]
    assert np.array_equal(quantize_q8_0(weight), gguf.quants.quantize(weight, Q8_0))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(weight[:, :48])


def test_every_quantized_product_is_within_float32_error_of_float64(
    plain_draft: LlamaForCausalLM, q8_draft: LlamaForCausalLM
) -> None:
    plain, quantized = _linears(plain_draft), _linears(q8_draft)
    assert plain.keys() == quantized.keys()
    gen = torch.Generator().manual_seed(0)
    for name, layer in quantized.items():
        weight = layer.form
        assert weight is not None, name
        assert layer.weight is None, name
        reference = plain[name].weight
        assert reference is not None
        # each weight within half a step d = amax / 127 of its block, plus d's fp16 rounding
        # (half an fp16 ulp, at least a subnormal's) times |q| <= 127
        blocks = reference.reshape(reference.shape[0], -1, 32)
        step = blocks.abs().amax(-1, keepdim=True) / 127
        bound = 0.5 * step + 127 * torch.clamp(step * 2**-11, min=2**-25)
        error = (weight.dequantize().reshape(blocks.shape) - blocks).abs()
        assert bool((error <= bound * (1 + 1e-6)).all()), name
        for rows in (1, 3, 9):
            x = torch.randn(rows, layer.in_features, generator=gen)
            assert_near_product(layer(x), x, weight)
    embedding = q8_draft.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    hidden = torch.randn(4, 576, generator=gen)
    assert_near_product(q8_draft.compute_logits(hidden), hidden, embedding.form)


def _dequantised_self(plain: LlamaForCausalLM, quantized: LlamaForCausalLM) -> LlamaForCausalLM:
    """The float32 draft whose weights are the quantized draft's values."""
    model = copy.deepcopy(plain)
    linears = _linears(quantized)
    with torch.no_grad():
        for name, layer in _linears(model).items():
            weight = linears[name].form
            assert layer.weight is not None
            assert weight is not None
            layer.weight.copy_(weight.dequantize())
        embedding = quantized.model.embed_tokens
        assert isinstance(embedding, QuantizedEmbedding)
        model.model.embed_tokens.weight.copy_(embedding.form.dequantize())
    return model


def test_the_draft_equals_its_dequantised_float32_self(
    plain_draft: LlamaForCausalLM, q8_draft: LlamaForCausalLM
) -> None:
    reference = _dequantised_self(plain_draft, q8_draft)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 49152, (70,), generator=gen).tolist()
    got = PagedHarness(q8_draft).forward([(0, prompt)])[0]
    expected = PagedHarness(reference).forward([(0, prompt)])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    assert q8_draft.weight_bytes() < 0.32 * plain_draft.weight_bytes()  # 1.125 bytes a weight


def test_fused_layers_give_the_per_op_bits(q8_draft: LlamaForCausalLM) -> None:
    gen = torch.Generator().manual_seed(4)
    first = torch.randint(0, 49152, (40,), generator=gen).tolist()

    def logits() -> list[torch.Tensor]:
        harness = PagedHarness(q8_draft, num_blocks=16)
        out = harness.forward([(0, first), (1, first[:7])])
        out += harness.forward([(0, [11]), (1, [12, 13, 14, 15])])
        return out

    assert_fused_equals_per_op(q8_draft, logits)


def test_the_shipped_drafts_blocks_are_checked_by_digest(q8_draft: LlamaForCausalLM) -> None:
    check_shipped_q8_0(q8_draft)  # the known blocks
    damaged = copy.deepcopy(q8_draft)
    layer = _linears(damaged)["model.layers.1.mlp.down_proj"]
    form = layer.form
    assert isinstance(form, RepackedForm)
    data = form.data.clone()
    data.view(-1)[0] ^= 1  # one code's low bit (the first bytes are codes in either form)
    layer.form = dataclasses.replace(form, data=data)
    with pytest.raises(ModelLoadError, match="Q8_0 copy of the shipped draft"):
        check_shipped_q8_0(damaged)


def test_auto_quantizes_the_draft_under_a_target_of_blocks(
    plain_draft: LlamaForCausalLM, q8_draft: LlamaForCausalLM
) -> None:
    """A target whose layers multiply blocks gets a Q8_0 draft; a float one does not (the
    draft's own weights stand in for targets here: the rule reads only the layers' form)."""
    assert quantized_draft("auto", q8_draft)
    assert not quantized_draft("auto", plain_draft)
    assert quantized_draft("q8_0", plain_draft)
    assert not quantized_draft("float32", q8_draft)
    assert draft_dtype("q8_0", torch.bfloat16, CPU, packed=True) == torch.float32
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        load_model(default_draft_path(), torch.bfloat16).quantize_for_cpu()


def test_q8_0_is_a_draft_dtype_of_draft_methods_only() -> None:
    from specbatch.spec_decode.config import SpeculativeConfig

    assert SpeculativeConfig("draft_model", model="d", draft_dtype="q8_0").draft_dtype == "q8_0"
    with pytest.raises(ConfigError, match="draft_dtype is for methods"):
        SpeculativeConfig("ngram", draft_dtype="q8_0")
    with pytest.raises(ConfigError, match="draft_dtype must be one of"):
        SpeculativeConfig("draft_model", model="d", draft_dtype="q4_0")
