"""The shipped draft model and draft head for the default target (SmolLM2-135M-Instruct).

It was made by ``specbatch distill-draft`` (see ``docs/distillation.md`` for the command and the
numbers) and lives in the package as an ordinary HF directory; its weights are checked against
a known sha256 before use.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specbatch.errors import ConfigError, ModelLoadError
from specbatch.models.config import ModelConfig
from specbatch.models.llama import LlamaForCausalLM
from specbatch.tokenizer import Tokenizer

# The default (``"auto"``) drafts with it for its target, inside the hybrid proposer (prompt
# lookup where the text repeats, this draft elsewhere): measured in docs/distillation.md, the
# hybrid beats n-gram alone at batch 1 on the CPU; the draft alone is slower on some categories.
DRAFT_DIR = Path(__file__).resolve().parents[2] / "assets" / "smollm2-135m-draft"
DRAFT_SHA256 = "a76042d7f311b87bcd6f0060d624f235183848e7317708e6e24265f4e1632f10"
# Its Q8_0 copy (made at load under a target of GGUF blocks: LlamaForCausalLM.quantize_for_cpu),
# by LlamaForCausalLM.quantized_digest (over the dequantised values, whichever form holds them).
DRAFT_Q8_0_SHA256 = "33823cf35b7c87ea6afb5249bab9d88ac97aedc54a0e94b01d996051c7a70d34"
# The shipped draft head (``specbatch train-head``, docs/distillation.md): what
# ``{"method": "eagle"}`` drafts with by default (the hybrid's default is the draft model:
# the head paid less beside prompt lookup, docs/distillation.md).
HEAD_DIR = Path(__file__).resolve().parents[2] / "assets" / "smollm2-135m-head"
HEAD_SHA256 = "4cfd0995adaa165fa6e3da6e37e0033db91788ca960ac9ec3feb3a920f3da84b"
# What the draft was distilled for: SmolLM2-135M-Instruct's shape, and the sha256 of its
# vocabulary (every token's text, in id order; see vocabulary_digest). A target is recognised by
# these, whatever its file is called or holds it (the GGUF, a dequantised HF directory).
TARGET_SHAPE = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}
TARGET_VOCABULARY_SHA256 = "3466f905d023e99999d2405642d4e1c28ef8c0de1f949700722331d4e9765fb4"


def vocabulary_digest(tokenizer: Tokenizer) -> str:
    """sha256 of every token's text in id order (about 50 ms for 49k tokens)."""
    digest = hashlib.sha256()
    for token_id in range(tokenizer.vocab_size):
        digest.update(tokenizer.decode([token_id]).encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


def drafts_for(config: ModelConfig, tokenizer: Tokenizer) -> bool:
    """Whether the shipped draft was made for this target, recognised by content: its shape
    and its vocabulary (lossless either way; this says whether the draft is any good)."""
    if any(getattr(config, field) != value for field, value in TARGET_SHAPE.items()):
        return False
    return vocabulary_digest(tokenizer) == TARGET_VOCABULARY_SHA256


def shipped_draft_available() -> bool:
    """Whether this installation carries the trained draft (checked in full at load)."""
    return bool(DRAFT_SHA256) and (DRAFT_DIR / "model.safetensors").is_file()


def default_draft_path() -> Path:
    """The verified shipped draft directory."""
    return _verified(DRAFT_DIR, DRAFT_SHA256, "draft model", "method 'ngram'")


def default_head_path() -> Path:
    """The verified shipped draft head directory."""
    return _verified(HEAD_DIR, HEAD_SHA256, "draft head", "another method")


def check_shipped_q8_0(draft: LlamaForCausalLM) -> None:
    """Refuse a Q8_0 copy of the shipped draft whose blocks are not the known ones."""
    digest = draft.quantized_digest()
    if digest != DRAFT_Q8_0_SHA256:
        raise ModelLoadError(
            f"the Q8_0 copy of the shipped draft model has sha256 {digest}, not "
            f"{DRAFT_Q8_0_SHA256}: its quantisation changed; use draft_dtype 'float32'"
        )


def _verified(directory: Path, sha256: str, what: str, instead: str) -> Path:
    weights = directory / "model.safetensors"
    if not sha256 or not weights.is_file():
        raise ConfigError(
            f"this installation ships no {what}; pass speculative_config 'model' or use {instead}"
        )
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != sha256:
        raise ModelLoadError(
            f"{weights}: sha256 {digest} does not match the shipped {what} ({sha256}); "
            "the package is damaged, reinstall it"
        )
    return directory
