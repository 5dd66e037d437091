"""Tiny tokenizer files made offline: a SentencePiece model, a byte-level BPE ``tokenizer.json``,
and GGUF files holding their vocabularies."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces, and pieces into ids.",
    "A small model can still answer simple questions about the weather.",
    "def tokenize(text):\n    return [piece for piece in text.split()]\n",
    "for i in range(10):\n\tprint(i * 2)\n",
    "Numbers like 42, 3.14 and 2024 appear in many documents.",
    "Le café était très agréable, déjà plein à midi.",
    "She said: 'hello there!' and he replied \"good morning\".",
]
TRAINING_TEXT = "\n".join(f"{s} {i}" for i in range(40) for s in _SENTENCES)

SPM_USER_DEFINED = ("<sep>",)
SPM_CONTROL = ("<|im_start|>", "<|im_end|>")
BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_spm(directory: Path, vocab_size: int = 400, add_dummy_prefix: bool = True) -> Path:
    """Train a byte-fallback SentencePiece BPE into ``directory/tokenizer.model``."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text(TRAINING_TEXT, encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        # Llama-style: no normalisation, spaces kept as written, a dummy prefix.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        user_defined_symbols=list(SPM_USER_DEFINED),
        control_symbols=list(SPM_CONTROL),
        hard_vocab_limit=False,
        minloglevel=2,
    )
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()
    return directory / "tokenizer.model"


def spm_vocab_lists(model: Path) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and GGUF token types of a SentencePiece model."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    for i in range(processor.get_piece_size()):
        piece = processor.id_to_piece(i)
        pieces.append(piece)
        scores.append(processor.get_score(i))
        if processor.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif processor.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif processor.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        elif piece in SPM_USER_DEFINED:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return pieces, scores, types


def write_vocab_gguf(
    path: Path,
    model: str | None,
    tokens: Sequence[str] = (),
    types: Sequence[int] = (),
    scores: Sequence[float] | None = None,
    merges: Sequence[str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """A GGUF with one dummy tensor and, when ``model`` is given, a tokenizer vocabulary.

    ``metadata`` maps keys below ``tokenizer.ggml.`` (or ``tokenizer.chat_template``) to values.
    """
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(4)
    if model is not None:
        writer.add_tokenizer_model(model)
        writer.add_token_list(list(tokens))
        writer.add_token_types(list(types))
        if scores is not None:
            writer.add_token_scores(list(scores))
        if merges is not None:
            writer.add_token_merges(list(merges))
    for key, value in (metadata or {}).items():
        full = key if key.startswith("tokenizer.chat") else f"tokenizer.ggml.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        else:
            writer.add_string(full, value)
    writer.add_tensor("token_embd.weight", np.zeros((max(len(tokens), 1), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def train_byte_level_bpe(directory: Path, vocab_size: int = 500) -> Path:
    """Train a GPT-2-style byte-level BPE and save it as a ``tokenizer.json`` model directory.

    ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` are ids 0-2; BOS is ``<|im_start|>``
    (not added), EOS ``<|im_end|>``, and ``generation_config.json`` also ends on id 0.
    """
    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return directory


def byte_level_vocab_lists(directory: Path) -> tuple[list[str], list[int], list[str]]:
    """Tokens, GGUF token types and ``"a b"`` merges of a trained ``tokenizer.json``."""
    data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    types = [control if t in BPE_SPECIALS else normal for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def write_llama2_style_tokenizer_json(directory: Path, spm_model: Path) -> Path:
    """A ``tokenizer.json`` over a SentencePiece vocabulary with Llama 2's decoder chain.

    Its decoder strips one leading space from the joined text of the ids it is given *after*
    special tokens are skipped, the context effect a streaming detokenizer must not trip on.
    No merges: only decoding is meant to be realistic.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pieces, _, types = spm_vocab_lists(spm_model)
    model = models.BPE(
        vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True, unk_token="<unk>"
    )
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    controls = [p for p, t in zip(pieces, types, strict=True) if t in (2, 3)]
    backend.add_special_tokens(controls)
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
