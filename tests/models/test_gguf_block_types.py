"""A tiny Llama GGUF with its matrices in each block type the exact mode reads, and in the mix
a Q4_K_M file holds (q/k and v of different types in one layer: a stacked projection): every
linear held as stored, logits against the same file's dequantised float32 load, the fused
layer call bit for bit against the per-op path, the embedding's rows from every type, and
speculation lossless on the mixed file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.errors import ModelLoadError
from specbatch.kernels import gguf_tiles
from specbatch.kernels.block_forms import holds_blocks
from specbatch.kernels.gguf_blocks import BLOCK_TYPES, BlockType, BlockWeight
from specbatch.kernels.gguf_tiles import TILED_TYPES
from specbatch.kernels.weight_forms import StackedWeight
from specbatch.models import LlamaForCausalLM, load_model
from specbatch.models.llama import QuantizedEmbedding
from tests.gguf_writer import write_gguf
from tests.helpers import (
    OFF,
    PagedHarness,
    assert_fused_equals_per_op,
    tiny_config,
    write_hf_checkpoint,
    write_tiny_tokenizer,
)

T = gguf.GGMLQuantizationType
# hidden and intermediate sizes whole blocks of 256 (the K-quants' and IQ4_XS's)
SIZES = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
# A Q4_K_M file's kinds of mix: q/k, gate/up Q5_0; v Q8_0 (stacked with q/k); o Q4_K; down
# Q6_K; the embedding Q8_0 and an untied head Q6_K.
MIXED = {
    "q_proj": "Q5_0",
    "k_proj": "Q5_0",
    "v_proj": "Q8_0",
    "o_proj": "Q4_K",
    "gate_proj": "Q5_0",
    "up_proj": "Q5_0",
    "down_proj": "Q6_K",
    "embed_tokens": "Q8_0",
    "lm_head": "Q6_K",
}
# where each type keeps its fp16 scales (d, and dmin or m)
_SCALES = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip


def stored_blocks(kind: BlockType, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A matrix's bytes in ``kind``: random codes and sub-block scales, fp16 scales small
    enough that the weights stay near 0.05 (what a quantizer would make of a trained layer)."""
    n, k = shape
    if kind.name in ("F32", "F16", "BF16"):
        values = torch.from_numpy(0.05 * rng.standard_normal(shape).astype(np.float32))
        stored = {"F32": values, "F16": values.half(), "BF16": values.bfloat16()}[kind.name]
        return stored.contiguous().view(torch.uint8).numpy().reshape(n, -1)
    blocks = k // kind.block_weights
    cells = rng.integers(0, 256, (n, blocks, kind.block_bytes), dtype=np.uint8)
    scale = 0.05 / (15 if kind.block_weights == 32 else 15 * 63)
    for offset in _SCALES[kind.name]:
        d = (scale * rng.uniform(0.5, 1.5, (n, blocks, 1))).astype(np.float16)
        cells[..., offset : offset + 2] = d.view(np.uint8)
    return cells.reshape(n, -1)


def write_block_gguf(path: Path, kinds: dict[str, str], tied: bool = False) -> dict[str, object]:
    """A tiny llama GGUF whose matrices are stored in ``kinds`` (by HF name part; "*" for
    every one), with a real tokenizer beside it; returns its config."""
    vocab = write_tiny_tokenizer(path.parent / "hf")
    config = tiny_config(vocab_size=max(vocab, 96), tie_word_embeddings=tied, **SIZES)
    state = write_hf_checkpoint(path.parent / "hf", config).state_dict()
    rng = np.random.default_rng(0)
    raw, qtypes = {}, {}
    for name, tensor in state.items():
        part = name.split(".")[-2]
        kind = kinds.get(part, kinds.get("*"))
        if tensor.dim() != 2 or kind is None:
            continue
        raw[name] = stored_blocks(BLOCK_TYPES[kind], tuple(tensor.shape), rng)
        qtypes[name] = T[kind]
    write_gguf(path, config, state, qtypes=qtypes, raw_tensors=raw)
    return config


def small_workload(model: LlamaForCausalLM, vocab: int) -> list[torch.Tensor]:
    """Prefills of two lengths in one step (across 16-token blocks), then decodes and a
    5-token verify-like step."""
    harness = PagedHarness(model, num_blocks=32, block_size=16)
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(0, vocab, (70,), generator=gen).tolist()
    second = torch.randint(0, vocab, (21,), generator=gen).tolist()
    outputs = [torch.cat(harness.forward([(0, first), (1, second)]))]
    outputs.append(torch.cat(harness.forward([(0, [11]), (1, [12, 13, 14, 15, 16])])))
    outputs.append(torch.cat(harness.forward([(1, [17])])))
    return outputs


def assert_exact_mode_matches_the_dequantised_load(path: Path, vocab: int) -> LlamaForCausalLM:
    plain = load_model(path)
    exact = load_model(path, quantization="gguf")
    assert all(holds_blocks(m.form) for m in exact.layer_linears())
    assert holds_blocks(exact.lm_head.form)
    assert isinstance(exact.model.embed_tokens, QuantizedEmbedding)
    ids = torch.arange(vocab)
    assert torch.equal(exact.model.embed_tokens(ids), plain.model.embed_tokens(ids))
    for got, expected in zip(
        small_workload(exact, vocab), small_workload(plain, vocab), strict=True
    ):
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale + 1e-6)
    assert_fused_equals_per_op(exact, lambda: small_workload(exact, vocab))
    return exact


def form_name(kind: str) -> str:
    """The form the registry gives a tensor of type ``kind`` on this machine."""
    if kind in TILED_TYPES and gguf_tiles.available():
        return "TileBlockWeight"
    return "QuantizedWeight" if kind in ("Q4_1", "Q8_0") else "BlockWeight"


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_every_type_is_multiplied_as_stored(tmp_path: Path, kind: str) -> None:
    config = write_block_gguf(tmp_path / "m.gguf", {"*": kind})
    exact = assert_exact_mode_matches_the_dequantised_load(
        tmp_path / "m.gguf", config["vocab_size"]
    )
    weight = exact.model.layers[0].mlp.down_proj.form  # type: ignore[union-attr]
    assert type(weight).__name__ == form_name(kind)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_q4_k_m_mix_with_stacked_projections(tmp_path: Path, tied: bool) -> None:
    config = write_block_gguf(tmp_path / "m.gguf", MIXED, tied=tied)
    exact = assert_exact_mode_matches_the_dequantised_load(
        tmp_path / "m.gguf", config["vocab_size"]
    )
    qkv = exact.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert isinstance(qkv.form, StackedWeight)
    assert [type(p).__name__ for p in qkv.form.parts] == [form_name("Q5_0"), form_name("Q8_0")]
    assert exact.fused.applies()
    if tied:  # the head is the embedding's own form
        assert exact.lm_head.form is exact.model.embed_tokens.form


def test_speculation_on_the_mixed_file_is_lossless(tmp_path: Path) -> None:
    """Verify rows and decode rows through stacked projections and K-quant kernels: greedy and
    seeded text with prompt lookup equal speculation off, batch 1 and a batch of 6."""
    write_block_gguf(tmp_path / "m.gguf", MIXED)
    common = {
        "model": str(tmp_path / "m.gguf"),
        "tokenizer": str(tmp_path / "hf"),
        "max_model_len": 256,
        "num_kv_blocks": 96,
        "block_size": 8,
    }
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6] * (i + 1) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)
    off = LLM(speculative_config=OFF, **common)
    assert off.llm_engine.weight_mode.quantization == "gguf"
    expected = [
        [o.outputs[0].token_ids for o in off.generate(prompts, p, use_tqdm=False)]
        for p in (greedy, seeded)
    ]
    del off
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **common)
    for params, want in zip((greedy, seeded), expected, strict=True):
        together = spec.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in together] == want
    alone = spec.generate(prompts[:1], greedy, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == expected[0][0]
    assert sum(o.metrics.num_accepted_tokens for o in together) > 0


def test_truncated_block_rows_are_named(tmp_path: Path) -> None:
    """A tensor whose bytes are not whole rows of blocks: the loader names it."""
    write_block_gguf(tmp_path / "m.gguf", {"*": "Q4_K"})
    model = load_model(tmp_path / "m.gguf", quantization="gguf")  # sane file loads
    assert holds_blocks(model.lm_head.form)
    bad = np.zeros((3, 100), np.uint8)
    with pytest.raises(ValueError, match="truncated or misaligned"):
        BlockWeight.from_blocks(bad, "Q4_K", 256)
    net = load_model(tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        net.use_quantized_weights([("model.layers.0.mlp.down_proj.weight", "Q4_K", bad)])
