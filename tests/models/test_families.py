"""Each family beside Llama (Gemma 2/3, Qwen3, Qwen2-MoE, Qwen3-MoE, Phi-3) against
transformers on the same weights: a tiny random model built with transformers' own config
class, loaded from its HF directory and from the GGUF file llama.cpp's converter would write
(float32 and block types in the exact mode), prompts longer than the sliding window, across
8-token blocks and chunked prefill; greedy text equal to transformers' ``generate``; the fused
layer call bit for bit against the per-op path; the expert routing against a per-token
reference."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from specbatch import LLM, SamplingParams
from specbatch.kernels.block_forms import holds_blocks
from specbatch.models import LlamaForCausalLM, load_model
from specbatch.models.layers import LlamaDecoderLayer, SparseMoE
from tests.gguf_families import (
    FAMILIES,
    SLIDING,
    VOCAB,
    WINDOW,
    write_family_dir,
    write_family_gguf,
)
from tests.helpers import OFF, PagedHarness, assert_fused_equals_per_op

T = gguf.GGMLQuantizationType
PROMPT = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, transformers.PreTrainedModel, Path]:
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    model = write_family_dir(directory / "hf", name)
    write_family_gguf(directory / "f32.gguf", model)
    return name, model, directory


def reference_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def chunked_logits(model: LlamaForCausalLM, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """The logits of ``ids`` fed in prefill chunks of these sizes, then one token at a time,
    over 8-token blocks."""
    harness = PagedHarness(model, num_blocks=24, block_size=8)
    out, at = [], 0
    for size in chunks:
        out += harness.forward([(0, ids[at : at + size])])
        at += size
    out += [harness.forward([(0, [token])])[0] for token in ids[at:]]
    return torch.cat(out)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, tolerance: float = 2e-5) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * scale)


def test_hf_directory_logits_match_transformers(
    family: tuple[str, transformers.PreTrainedModel, Path],
) -> None:
    """Past the window (37 > 12), over 8-token blocks: one prefill, and chunks that cut the
    prompt at a block edge and across the window edge."""
    name, reference, directory = family
    model = load_model(directory / "hf")
    expected = reference_logits(reference, PROMPT)
    assert_matches(chunked_logits(model, PROMPT, [37]), expected)
    assert_matches(chunked_logits(model, PROMPT, [8, 5, 13]), expected)
    if name in SLIDING:
        assert model.config.sliding_window == WINDOW
        assert "sliding" in model.config.layer_types


def test_gguf_file_logits_match_transformers(
    family: tuple[str, transformers.PreTrainedModel, Path],
) -> None:
    _, reference, directory = family
    model = load_model(directory / "f32.gguf")
    assert_matches(chunked_logits(model, PROMPT, [30]), reference_logits(reference, PROMPT))


def _mixed_types(name: str, array: np.ndarray) -> T | None:
    """Block types for a tiny model's matrices (rows of 64 or 128 take 32-weight blocks)."""
    if "token_embd" in name or name.startswith("output."):
        return T.Q8_0
    if "gate_inp" in name:
        return None  # routers stay F32, as the converter keeps them
    return T.Q4_0 if "ffn_down" in name else T.Q5_0 if "attn_v" in name else T.Q8_0


def test_the_exact_mode_keeps_every_block_and_fuses_what_it_can(
    family: tuple[str, transformers.PreTrainedModel, Path],
) -> None:
    """A file of block types: every matrix held as stored, logits within float32 summation of
    the file's dequantised load, the fused layer call bit for bit equal to the per-op path
    (experts run per op)."""
    _, reference, directory = family
    path = directory / "blocks.gguf"
    write_family_gguf(path, reference, _mixed_types)
    plain, exact = load_model(path), load_model(path, quantization="gguf")
    assert all(holds_blocks(m.form) for m in exact.layer_linears())
    assert_matches(chunked_logits(exact, PROMPT, [21]), chunked_logits(plain, PROMPT, [21]))
    layers = [layer for layer in exact.model.layers if isinstance(layer, LlamaDecoderLayer)]
    if any(isinstance(layer.mlp, SparseMoE) for layer in layers):
        assert not exact.fused.applies()
    else:
        assert_fused_equals_per_op(exact, lambda: [chunked_logits(exact, PROMPT, [13, 8])])


def test_greedy_text_equals_transformers_generate(
    family: tuple[str, transformers.PreTrainedModel, Path],
) -> None:
    name, reference, directory = family
    prompts = [PROMPT[:5], PROMPT[:19], PROMPT]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=str(directory / "hf"), max_model_len=256, speculative_config=OFF)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for ids, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )[0, len(ids) :].tolist()
        assert list(tokens) == expected, name


def routed_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The experts' sum token by token: softmax over all experts, the top k, renormalised
    where the model says so, each chosen expert's output weighted; plus the gated shared
    expert."""
    rows = []
    for token in x:
        probs = torch.softmax(moe.gate(token[None]).float()[0], dim=-1)
        order = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[: moe.top_k]
        weights = probs[order]
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        out = torch.zeros_like(token)
        for expert, weight in zip(order, weights, strict=True):
            out = out + moe.experts[expert](token[None])[0] * weight
        if moe.shared_expert is not None and moe.shared_expert_gate is not None:
            gate = torch.sigmoid(moe.shared_expert_gate(token[None]))[0]
            out = out + gate * moe.shared_expert(token[None])[0]
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["qwen2moe", "qwen3moe"])
def test_expert_routing_matches_a_per_token_reference(tmp_path: Path, name: str) -> None:
    write_family_dir(tmp_path, name)
    model = load_model(tmp_path)
    model.pack_for_cpu()  # as the engine holds it: products whose rows keep their bits
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))
    x = torch.randn(23, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        batched = moe(x)
        torch.testing.assert_close(batched, routed_reference(moe, x), rtol=1e-5, atol=1e-6)
        alone = torch.cat([moe(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(batched, alone)  # a token's experts sum in one order in any batch
