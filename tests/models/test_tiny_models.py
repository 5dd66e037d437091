"""Tiny random Llama-family models: logits equal HF transformers' on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from specbatch.models import load_model
from tests.gguf_writer import write_gguf
from tests.helpers import PagedHarness, tiny_config, write_hf_checkpoint

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "llama3-rope": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "qwen2-bias": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_bias": True,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": None,
    },
    "mha": {"num_key_value_heads": 4},
}


def _prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(
        0, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_and_decode_match_hf(tmp_path: Path, variant: str) -> None:
    config = tiny_config(**VARIANTS[variant])
    hf = write_hf_checkpoint(tmp_path, config)
    model = load_model(tmp_path)
    prompt = _prompt(45, config["vocab_size"])
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0]

    prefill = PagedHarness(model, block_size=16).forward([(0, prompt)])[0]
    torch.testing.assert_close(prefill, reference, rtol=0, atol=1e-4)

    # Token by token through a block size (7) that does not divide the length.
    stepwise = PagedHarness(model, block_size=7, seed=3)
    rows = [stepwise.forward([(0, [token])])[0] for token in prompt]
    torch.testing.assert_close(torch.cat(rows), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen2-bias"])
def test_gguf_and_safetensors_give_identical_logits(tmp_path: Path, variant: str) -> None:
    config = tiny_config(**VARIANTS[variant])
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    prompt = _prompt(30, config["vocab_size"], seed=1)
    from_hf = PagedHarness(load_model(tmp_path / "hf")).forward([(0, prompt)])[0]
    from_gguf = PagedHarness(load_model(tmp_path / "m.gguf")).forward([(0, prompt)])[0]
    torch.testing.assert_close(from_gguf, from_hf, rtol=0, atol=0)


@pytest.mark.parametrize(
    "qtype",
    [
        gguf.GGMLQuantizationType[name]
        for name in ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
    ],
)
def test_quantised_gguf_tensors_dequantise_in_place(tmp_path: Path, qtype: Any) -> None:
    config = tiny_config(hidden_size=64, intermediate_size=256)
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    state = hf.state_dict()
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    write_gguf(tmp_path / "q.gguf", config, state, qtypes=dict.fromkeys(names, qtype))
    params = dict(load_model(tmp_path / "q.gguf").named_parameters())
    q_expected = gguf.quants.dequantize(
        gguf.quants.quantize(_permuted_q(state, config), qtype), qtype
    )
    from tests.gguf_writer import permute_rows

    q_loaded = params["model.layers.0.self_attn.qkv_proj.weight"][:64].numpy()
    np.testing.assert_array_equal(permute_rows(q_loaded, config["num_attention_heads"]), q_expected)
    down = state["model.layers.1.mlp.down_proj.weight"].numpy()
    down_expected = gguf.quants.dequantize(gguf.quants.quantize(down, qtype), qtype)
    np.testing.assert_array_equal(
        params["model.layers.1.mlp.down_proj.weight"].numpy(), down_expected
    )


def _permuted_q(state: dict[str, torch.Tensor], config: dict[str, Any]) -> np.ndarray:
    from tests.gguf_writer import permute_rows

    return permute_rows(
        state["model.layers.0.self_attn.q_proj.weight"].numpy(), config["num_attention_heads"]
    )


@pytest.mark.parametrize("qname", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"])
def test_k_quant_tensors_load(tmp_path: Path, qname: str) -> None:
    # gguf cannot quantise K-quants, so craft random blocks with sane fp16 scales.
    qtype = gguf.GGMLQuantizationType[qname]
    config = tiny_config(hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64)
    hf = write_hf_checkpoint(tmp_path / "hf", config)
    state = hf.state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    rows, cols = state[name].shape
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block, type_size), np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qname in ("Q4_K", "Q5_K"):
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    elif qname == "Q2_K":
        raw[..., -4:-2] = scale
        raw[..., -2:] = scale
    else:
        raw[..., -2:] = scale
    raw = raw.reshape(rows, -1)
    write_gguf(tmp_path / "k.gguf", config, state, qtypes={name: qtype}, raw_tensors={name: raw})
    loaded = dict(load_model(tmp_path / "k.gguf").named_parameters())
    up = loaded["model.layers.0.mlp.gate_up_proj.weight"][rows:].numpy()
    np.testing.assert_array_equal(up, gguf.quants.dequantize(raw, qtype))


def test_bfloat16_load_is_close_to_float32(tmp_path: Path) -> None:
    config = tiny_config()
    write_hf_checkpoint(tmp_path, config)
    prompt = _prompt(20, config["vocab_size"])
    full = PagedHarness(load_model(tmp_path)).forward([(0, prompt)])[0]
    half = PagedHarness(load_model(tmp_path, dtype="bfloat16")).forward([(0, prompt)])[0]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=0.05, atol=0.1)
