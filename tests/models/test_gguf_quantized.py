"""``quantization="gguf"``: a GGUF model's matrices multiplied as stored (SmolLM2's Q4_1/Q8_0;
every other type in ``test_gguf_block_types.py``).

Every layer against the same layer with the file's dequantised float32 weights (the plain
loader's), a tiny GGUF of each variant (tied, untied, biases, mixed kinds) against its plain
load, and the lossless contract on the quantized path: speculation on gives the tokens of
speculation off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.errors import ConfigError
from specbatch.kernels.block_forms import RepackedForm
from specbatch.kernels.linear import Linear
from specbatch.kernels.weight_forms import StackedWeight
from specbatch.models import LlamaForCausalLM, load_model
from specbatch.models.llama import QuantizedEmbedding
from tests.gguf_writer import write_gguf
from tests.helpers import (
    PagedHarness,
    assert_fused_equals_per_op,
    mixed_workload_logits,
    per_op_layers,
    tiny_config,
    write_hf_checkpoint,
)

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def quantized_smollm2(default_gguf: Path) -> LlamaForCausalLM:
    return load_model(default_gguf, dtype=torch.float32, quantization="gguf")


def _linears(model: LlamaForCausalLM) -> dict[str, Linear]:
    """The decoder layers' linears by name (the LM head apart)."""
    linears = model.named_modules()
    return {name: m for name, m in linears if isinstance(m, Linear) and m is not model.lm_head}


def test_every_layer_matches_its_dequantised_float32_layer(
    smollm2: LlamaForCausalLM, quantized_smollm2: LlamaForCausalLM
) -> None:
    plain, quantized = _linears(smollm2), _linears(quantized_smollm2)
    assert plain.keys() == quantized.keys()
    assert len(plain) == 4 * 30
    gen = torch.Generator().manual_seed(0)
    for name, layer in quantized.items():
        assert isinstance(layer.form, RepackedForm), name
        assert layer.weight is None, name
        weight = plain[name].weight
        assert weight is not None
        torch.testing.assert_close(layer.form.dequantize(), weight, rtol=0, atol=0)
        x = torch.randn(3, layer.in_features, generator=gen)
        expected = (x.double() @ weight.double().T).float()
        scale = float((x.abs().double() @ weight.abs().double().T).max())
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=2e-6 * scale)


def test_embedding_and_tied_head_are_the_files_q8_0(
    smollm2: LlamaForCausalLM, quantized_smollm2: LlamaForCausalLM
) -> None:
    embedding = quantized_smollm2.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    ids = torch.tensor([0, 1, 2, 500, 49151])
    assert torch.equal(embedding(ids), smollm2.model.embed_tokens(ids))
    hidden = torch.randn(4, 576, generator=torch.Generator().manual_seed(1))
    expected = hidden.double() @ smollm2.model.embed_tokens.weight.double().T
    torch.testing.assert_close(
        quantized_smollm2.compute_logits(hidden).double(), expected, rtol=0, atol=1e-4
    )
    assert quantized_smollm2.weight_bytes() < 0.3 * smollm2.weight_bytes()


VARIANTS: dict[str, dict[str, Any]] = {
    "llama-untied": {},
    "llama-tied": {"tie_word_embeddings": True},
    "qwen2-bias": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_bias": True,
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_quantized_gguf_matches_its_plain_load(tmp_path: Path, variant: str) -> None:
    config = tiny_config(hidden_size=64, intermediate_size=128, **VARIANTS[variant])
    state = write_hf_checkpoint(tmp_path / "hf", config).state_dict()
    qtypes = {
        name: (Q8_0 if "embed" in name or "lm_head" in name or "v_proj" in name else Q4_1)
        for name, tensor in state.items()
        if tensor.dim() == 2
    }
    write_gguf(tmp_path / "q.gguf", config, state, qtypes=qtypes)
    plain = load_model(tmp_path / "q.gguf")
    quantized = load_model(tmp_path / "q.gguf", quantization="gguf")
    linears = _linears(quantized)
    # q, k in Q4_1 but v in Q8_0: the fused projection is a stack of the two; every other
    # one is one block matrix
    assert all(
        isinstance(m.form, StackedWeight) and [p.kind for p in m.form.parts] == ["q4_1", "q8_0"]  # type: ignore[attr-defined]
        for n, m in linears.items()
        if n.endswith("qkv_proj")
    )
    assert all(
        isinstance(m.form, RepackedForm) for n, m in linears.items() if not n.endswith("qkv_proj")
    )
    prompt = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator()).tolist()
    expected = PagedHarness(plain).forward([(0, prompt)])[0]
    got = PagedHarness(quantized).forward([(0, prompt)])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_bad_quantization_settings_are_refused(tiny_model_dir: Path, default_gguf: Path) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of"):
        LLM(model=str(default_gguf), quantization="int3")
    with pytest.raises(ConfigError, match=r"not a \.gguf file"):
        load_model(tiny_model_dir, quantization="gguf")
    with pytest.raises(ConfigError, match="use dtype float32"):
        load_model(default_gguf, dtype="bfloat16", quantization="gguf")


@pytest.mark.parametrize(
    "speculation",
    [
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "num_speculative_tokens": 3},
        {"method": "auto"},
    ],
    ids=["ngram", "draft", "default"],
)
def test_speculation_on_the_quantized_path_is_lossless(
    default_gguf: Path, speculation: dict[str, Any]
) -> None:
    """Verify steps multiply k + 1 rows where decoding multiplies one: the kernel's row bits
    must not depend on that (batch 1 and a batch of 6), greedy and seeded. The draft model is
    the shipped one as Q8_0 blocks (``draft_dtype="auto"`` under this target)."""
    from tests.prompts import CHAT

    messages = [[{"role": "user", "content": text}] for text in CHAT[:6]]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24, ignore_eos=True)
    common = {"quantization": "gguf", "max_model_len": 1024, "kv_cache_gib": 0.25}
    plain = LLM(model=str(default_gguf), speculative_config={"method": "off"}, **common)
    expected = {
        name: [o.outputs[0].token_ids for o in plain.chat(messages, params, use_tqdm=False)]
        for name, params in (("greedy", greedy), ("seeded", seeded))
    }
    del plain
    spec = LLM(model=str(default_gguf), speculative_config=speculation, **common)
    draft = spec.llm_engine.draft_model
    if speculation["method"] != "ngram":
        assert isinstance(draft, LlamaForCausalLM)
        assert draft.multiplies_blocks()
        assert draft.fused.applies()
    outputs = spec.chat(messages, greedy, use_tqdm=False)
    alone = [spec.chat([m], greedy, use_tqdm=False)[0].outputs[0].token_ids for m in messages[:2]]
    assert [o.outputs[0].token_ids for o in outputs] == expected["greedy"]
    assert alone == expected["greedy"][:2]
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0  # it did speculate
    sampled = spec.chat(messages, seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == expected["seeded"]


def test_quantized_rows_do_not_depend_on_the_batch(
    quantized_smollm2: LlamaForCausalLM,
) -> None:
    layer = _linears(quantized_smollm2)["model.layers.3.mlp.down_proj"]
    x = torch.randn(9, layer.in_features, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    for row in range(9):
        assert torch.equal(layer(x[row : row + 1]), together[row : row + 1]), row


def test_fused_layers_give_the_per_op_paths_bits(quantized_smollm2: LlamaForCausalLM) -> None:
    """With every linear in GGUF blocks, each layer runs as one C call; it calls the same
    kernels as the per-op path, so every logit is the same bit for bit."""
    model = quantized_smollm2
    assert_fused_equals_per_op(model, lambda: mixed_workload_logits(model))


def test_fused_layers_with_biases_match_the_plain_load(tmp_path: Path) -> None:
    config = tiny_config(hidden_size=64, intermediate_size=128, **VARIANTS["qwen2-bias"])
    state = write_hf_checkpoint(tmp_path / "hf", config).state_dict()
    qtypes = {name: Q4_1 for name, tensor in state.items() if tensor.dim() == 2}
    write_gguf(tmp_path / "q.gguf", config, state, qtypes=qtypes)
    plain = load_model(tmp_path / "q.gguf")
    quantized = load_model(tmp_path / "q.gguf", quantization="gguf")
    assert quantized.fused.applies()
    prompt = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator()).tolist()
    expected = PagedHarness(plain).forward([(0, prompt)])[0]
    fused = PagedHarness(quantized).forward([(0, prompt)])[0]
    torch.testing.assert_close(fused, expected, rtol=0, atol=1e-4)
    with per_op_layers(quantized):
        assert torch.equal(PagedHarness(quantized).forward([(0, prompt)])[0], fused)


@pytest.mark.parametrize(
    "speculation",
    [{"method": "ngram", "num_speculative_tokens": 3}, {"method": "auto"}],
    ids=["ngram", "default"],
)
def test_quantized_engine_survives_chunking_preemption_and_prefix_hits(
    default_gguf: Path, speculation: dict[str, Any]
) -> None:
    """The fused layers under the engine's hard cases: prompts cut into chunks of at most 48
    tokens, a cache too small for every sequence at once (preemption and recompute), prefix-cache
    hits on a second pass, speculation on (prompt lookup; the default: lookup and the Q8_0
    draft); the text is that of a roomy engine without speculation."""
    from tests.prompts import CHAT

    messages = [[{"role": "user", "content": text * 3}] for text in CHAT[:6]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    roomy = LLM(
        model=str(default_gguf),
        quantization="gguf",
        max_model_len=256,
        kv_cache_gib=0.25,
        speculative_config={"method": "off"},
    )
    expected = [o.outputs[0].token_ids for o in roomy.chat(messages, params, use_tqdm=False)]
    del roomy
    tight = LLM(
        model=str(default_gguf),
        quantization="gguf",
        max_model_len=256,
        num_kv_blocks=24,
        max_num_batched_tokens=48,
        speculative_config=speculation,
    )
    first = tight.chat(messages, params, use_tqdm=False)
    again = tight.chat(messages, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.metrics.num_preemptions for o in first) > 0
    assert sum(o.metrics.num_cached_tokens for o in again) > 0


def test_types_the_kernel_cannot_read_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file with other storage types still loads (those layers dequantised), with a warning
    naming the types, so a user knows why it is not faster."""
    config = tiny_config(hidden_size=64, intermediate_size=128)
    state = write_hf_checkpoint(tmp_path / "hf", config).state_dict()
    qtypes = {name: Q4_1 for name, tensor in state.items() if tensor.dim() == 2}
    qtypes["model.layers.0.mlp.down_proj.weight"] = gguf.GGMLQuantizationType.MXFP4
    write_gguf(tmp_path / "q.gguf", config, state, qtypes=qtypes)
    with caplog.at_level("WARNING", logger="specbatch"):
        model = load_model(tmp_path / "q.gguf", quantization="gguf")
    assert "blk.0.ffn_down.weight is MXFP4, which the kernels do not multiply" in caplog.text
    down = _linears(model)["model.layers.0.mlp.down_proj"]
    assert not isinstance(down.form, RepackedForm)
    assert down.weight is not None
    assert not model.fused.applies()  # one plain layer: the per-op path serves every layer
