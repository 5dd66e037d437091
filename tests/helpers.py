"""Test utilities: tiny random checkpoints and a harness running a model on a paged cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.kernels.attention import AttentionInputs
from specbatch.models.llama import LlamaForCausalLM


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A HF ``config.json`` of a tiny Llama (2 layers, GQA 4:2, head_dim 16, vocab 96)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def hf_model_from_config(config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """A transformers model with random weights (std 0.1 so logits are not all tiny)."""
    import transformers

    cls = getattr(transformers, config["architectures"][0])
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = cls(hf_config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model


def write_hf_checkpoint(directory: Path, config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """Save a random tiny model as a HF directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    model = hf_model_from_config(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"))
    return model


class PagedHarness:
    """Runs a model over a paged cache with a shuffled, non-contiguous block table per sequence."""

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 16, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        caches = allocate_kv_caches(model.config, num_blocks, block_size, model.dtype, model.device)
        model.bind_kv_caches(caches)
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def forward(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed each ``(seq, new_token_ids)`` chunk in one ragged forward; logits per chunk."""
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lengths.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(int(self.free.pop()))
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += tokens
            positions += list(range(start, end))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.lengths[seq] = end
        width = max(len(t) for t in tables)
        block_tables = np.array([t + [0] * (width - len(t)) for t in tables])
        inputs = AttentionInputs(
            np.array(query_lens), np.array(seq_lens), block_tables, np.array(slots), self.block_size
        )
        metadata = self.model.backend.build_metadata(inputs, self.model.device)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), metadata)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the "
    "target verifies them in one pass. def add(a, b):\n    return a + b\n"
    "Paged attention reads keys and values through a block table. 0123456789 "
    "Continuous batching keeps every sequence busy; prefix caching shares full blocks. "
)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tiny_tokenizer(directory: Path, vocab_size: int = 300) -> int:
    """Train a small byte-level BPE (ids 0-2: <unk>, <s>, </s>) into ``directory``; returns its
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TINY_CORPUS] * 4, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "chat_template": TINY_CHAT_TEMPLATE,
            }
        )
    )
    return tokenizer.get_vocab_size()


def write_tiny_model(
    directory: Path, seed: int = 0, vocab_size: int | None = None, **overrides: Any
) -> Path:
    """A tiny random Llama with a real (small) tokenizer: an engine-ready model directory.

    ``vocab_size`` below the tokenizer's makes the model emit only the first ids (for tests
    that need exact distributions over a small vocabulary)."""
    vocab = write_tiny_tokenizer(directory)
    config = tiny_config(
        vocab_size=vocab_size or max(vocab, 96), max_position_embeddings=512, **overrides
    )
    write_hf_checkpoint(directory, config, seed=seed)
    return directory
