"""Damaged or unsupported model files fail with a ModelLoadError naming the file and tensor."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.errors import ModelLoadError
from specbatch.models import load_model, loader
from specbatch.models.gguf_file import GGUFFile
from tests.gguf_writer import write_gguf
from tests.helpers import tiny_config, write_hf_checkpoint
from tests.models.gguf_rewrite import Value, rewrite_gguf


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    write_hf_checkpoint(tmp_path / "hf", tiny_config())
    return tmp_path / "hf"


@pytest.fixture
def gguf_path(tmp_path: Path) -> Path:
    config = tiny_config()
    model = write_hf_checkpoint(tmp_path / "src", config)
    write_gguf(tmp_path / "m.gguf", config, model.state_dict())
    return tmp_path / "m.gguf"


def test_truncated_gguf(gguf_path: Path) -> None:
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"m\.gguf.*runs past the end"):
        load_model(gguf_path)


def test_gguf_header_cut_inside_metadata(gguf_path: Path) -> None:
    gguf_path.write_bytes(gguf_path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match=r"m\.gguf: not a valid GGUF file"):
        load_model(gguf_path)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"\x00" * 1000)
    with pytest.raises(ModelLoadError, match=r"junk\.gguf.*magic"):
        load_model(path)


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        load_model(tmp_path / "x.gguf")


def test_wrong_shape_safetensors(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(file))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
        r" has shape \(3, 3\), expected \(128, 64\)",
    ):
        load_model(hf_dir)


def test_missing_tensor(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    state = load_file(str(file))
    del state["model.norm.weight"]
    save_file(state, str(file))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\): model\.norm\.weight"):
        load_model(hf_dir)


def test_truncated_safetensors(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors"):
        load_model(hf_dir)


def test_unknown_architecture(hf_dir: Path) -> None:
    config = tiny_config(architectures=["GPTNeoXForCausalLM"])
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        load_model(hf_dir)


def test_bad_config_json(hf_dir: Path) -> None:
    (hf_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot parse JSON"):
        load_model(hf_dir)


def test_config_missing_field(hf_dir: Path) -> None:
    config = tiny_config()
    del config["hidden_size"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(hf_dir)


def test_pickle_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickle checkpoints"):
        load_model(tmp_path)


def test_sharded_checkpoint_with_index(hf_dir: Path) -> None:
    state = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(state)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(hf_dir / file))
    (hf_dir / "model.safetensors").unlink()
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    params = dict(load_model(hf_dir).named_parameters())
    torch.testing.assert_close(params["model.norm.weight"], state["model.norm.weight"])
    (hf_dir / "b.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"index\.json: lists weight files that do not exist"):
        load_model(hf_dir)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="never reaches a model hub"):
        load_model(tmp_path / "nope")


# Hostile or corrupt headers: each fails with one ModelLoadError naming the file and the field or
# tensor, before the model the header describes is allocated.

U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((0, U32), r"llama\.attention\.head_count must be in \[1, 1024\], got 0"),
        ((-4, gguf.GGUFValueType.INT32), r"llama\.attention\.head_count must be in .*, got -4"),
        (("4", gguf.GGUFValueType.STRING), r"llama\.attention\.head_count must be an integer"),
        ((4.0, gguf.GGUFValueType.FLOAT32), r"llama\.attention\.head_count must be an integer"),
        ((True, gguf.GGUFValueType.BOOL), r"llama\.attention\.head_count must be an integer"),
        (None, r"GGUF metadata lacks llama\.attention\.head_count"),
    ],
)
def test_gguf_bad_head_count(gguf_path: Path, value: Value | None, message: str) -> None:
    rewrite_gguf(gguf_path, metadata={"llama.attention.head_count": value})
    with pytest.raises(ModelLoadError, match=rf"m\.gguf: (GGUF metadata )?{message}"):
        load_model(gguf_path)


@pytest.mark.parametrize(
    "key",
    [
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.vocab_size",
        "llama.context_length",
        "llama.attention.key_length",
    ],
)
def test_gguf_huge_size(gguf_path: Path, key: str) -> None:
    rewrite_gguf(gguf_path, metadata={key: (2**40, U64)})
    with pytest.raises(
        ModelLoadError, match=rf"m\.gguf: GGUF metadata {re.escape(key)} must be in .*corrupt"
    ):
        load_model(gguf_path)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (10**9, r"llama\.block_count must be in \[1, 1024\], got 1000000000"),
        (1000, r"llama\.block_count is 1000, but the file has no tensors for layer 2"),
    ],
)
@pytest.mark.timeout(60)  # a loader that walked the claimed layers would not end: fail instead
def test_gguf_huge_block_count_fails_fast(
    gguf_path: Path, layers: int, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header and the tensor directory refuse the count before any work that grows with
    it: no module is built, no tensor's data is read."""
    rewrite_gguf(gguf_path, metadata={"llama.block_count": (layers, U32)})
    built = record_calls(monkeypatch, loader, "_build")
    dequantized = record_calls(monkeypatch, GGUFFile, "dequantize")
    raw = record_calls(monkeypatch, GGUFFile, "raw_rows")
    with pytest.raises(ModelLoadError, match=rf"m\.gguf: (GGUF metadata )?{message}"):
        load_model(gguf_path)
    assert built == []
    assert dequantized == raw == []


def record_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[object]:
    """Wrap ``owner.name`` (for this test) so that each call appends its arguments to the
    returned list."""
    calls: list[object] = []
    original = getattr(owner, name)

    def recording(*args: object, **kwargs: object) -> object:
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def test_gguf_string_where_float_expected(gguf_path: Path) -> None:
    rewrite_gguf(gguf_path, metadata={"llama.rope.freq_base": ("1e4", gguf.GGUFValueType.STRING)})
    with pytest.raises(ModelLoadError, match=r"m\.gguf: .*llama\.rope\.freq_base must be a"):
        load_model(gguf_path)


def test_gguf_without_vocabulary_size_takes_the_embeddings_rows(gguf_path: Path) -> None:
    """As llama.cpp does (its converter trims Gemma 3's embedding to the tokenizer's size)."""
    expected = load_model(gguf_path).config.vocab_size
    rewrite_gguf(gguf_path, metadata={"llama.vocab_size": None})
    assert load_model(gguf_path).config.vocab_size == expected


@pytest.mark.parametrize("shape", [(128, 32), (64, 128)])
def test_gguf_tensor_with_changed_dimension(gguf_path: Path, shape: tuple[int, int]) -> None:
    # The data stays as written: only the tensor info's dimensions change.
    rewrite_gguf(gguf_path, shapes={"blk.1.ffn_up.weight": shape})
    with pytest.raises(
        ModelLoadError,
        match=rf"m\.gguf: tensor 'blk\.1\.ffn_up\.weight' has shape \({shape[0]}, {shape[1]}\), "
        r"expected \(128, 64\)",
    ):
        load_model(gguf_path)


def test_gguf_tensors_sharing_bytes(gguf_path: Path) -> None:
    # Every shape matches the config, but two tensors claim the same bytes: a header could build
    # a model many times the file's size that way.
    reader = gguf.GGUFReader(gguf_path, "r+")
    infos = {t.name: t.field for t in reader.tensors}
    infos["output_norm.weight"].parts[-1][0] = infos["blk.1.attn_norm.weight"].parts[-1][0]
    del reader, infos
    with pytest.raises(
        ModelLoadError,
        match=r"m\.gguf: tensors '(blk\.1\.attn|output)_norm\.weight' and "
        r"'(blk\.1\.attn|output)_norm\.weight' overlap",
    ):
        load_model(gguf_path)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((0,), r"has shape \(0,\): every dimension must be in \[1, 2\*\*63\)"),
        (
            (2**40, 2**40),
            r"has shape \(1099511627776, 1099511627776\): its element count overflows",
        ),
        ((2**20, 2**20), r"runs past the end of the file"),
    ],
)
def test_gguf_impossible_tensor_shape(
    gguf_path: Path, shape: tuple[int, ...], message: str
) -> None:
    rewrite_gguf(gguf_path, shapes={"output_norm.weight": shape})
    with pytest.raises(ModelLoadError, match=rf"m\.gguf: .*tensor 'output_norm\.weight' {message}"):
        load_model(gguf_path)


@pytest.mark.parametrize("entries", [8, 3])
def test_gguf_rope_freqs_length(tmp_path: Path, entries: int) -> None:
    config = tiny_config()  # head_dim 16: 8 rotary frequencies
    model = write_hf_checkpoint(tmp_path / "src", config)
    factors = {"rope_freqs.weight": np.full(entries, 2.0, np.float32)}
    write_gguf(tmp_path / "m.gguf", config, model.state_dict(), extra_tensors=factors)
    if entries == 8:
        assert load_model(tmp_path / "m.gguf").config.rope_freq_factors == (2.0,) * 8
        return
    with pytest.raises(
        ModelLoadError,
        match=r"m\.gguf: tensor 'rope_freqs\.weight' has shape \(3,\), expected \(8,\)",
    ):
        load_model(tmp_path / "m.gguf")


def test_gguf_missing_layer(gguf_path: Path) -> None:
    rewrite_gguf(
        gguf_path, drop={t for t in _gguf_tensor_names(gguf_path) if t.startswith("blk.1.")}
    )
    with pytest.raises(
        ModelLoadError, match=r"m\.gguf: llama\.block_count is 2, but .* no tensors for layer 1"
    ):
        load_model(gguf_path)


def test_gguf_extra_layer(gguf_path: Path) -> None:
    rewrite_gguf(gguf_path, metadata={"llama.block_count": (1, U32)})
    with pytest.raises(
        ModelLoadError,
        match=r"m\.gguf: tensor 'blk\.1\.\w+\.weight' belongs to layer 1, but llama\.block_count "
        r"is 1",
    ):
        load_model(gguf_path)


def test_gguf_missing_tensor_is_named_as_in_the_file(gguf_path: Path) -> None:
    rewrite_gguf(gguf_path, drop={"blk.0.ffn_gate.weight"})
    with pytest.raises(ModelLoadError, match=r"m\.gguf: missing 1 tensor\(s\): blk\.0\.ffn_gate"):
        load_model(gguf_path)


def test_safetensors_header_with_changed_dimension(hf_dir: Path) -> None:
    # Same byte count: the safetensors library accepts it, the config does not.
    _edit_safetensors_header(
        hf_dir / "model.safetensors", "model.layers.1.mlp.up_proj.weight", [64, 128]
    )
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has shape "
        r"\(64, 128\), expected \(128, 64\)",
    ):
        load_model(hf_dir)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([128, 65], r"has shape \(128, 65\) of F32 \(33280 bytes\), but its data spans 32768"),
        ([2**40, 2**40], r"has shape \(1099511627776, 1099511627776\) of F32"),
        ([-1, 64], r"has shape \[-1, 64\]"),
    ],
)
def test_safetensors_header_inconsistent_with_data(
    hf_dir: Path, shape: list[int], message: str
) -> None:
    _edit_safetensors_header(
        hf_dir / "model.safetensors", "model.layers.1.mlp.up_proj.weight", shape
    )
    with pytest.raises(
        ModelLoadError,
        match=rf"model\.safetensors: cannot read .*tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
        rf"{message}",
    ):
        load_model(hf_dir)


def test_safetensors_missing_layer(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    state = load_file(str(file))
    save_file({k: v for k, v in state.items() if ".layers.1." not in k}, str(file))
    with pytest.raises(
        ModelLoadError,
        match=r"hf: num_hidden_layers in config\.json is 2, but .* no tensors for layer 1",
    ):
        load_model(hf_dir)


def test_safetensors_extra_layer(hf_dir: Path) -> None:
    (hf_dir / "config.json").write_text(json.dumps(tiny_config(num_hidden_layers=1)))
    with pytest.raises(
        ModelLoadError,
        match=r"model\.safetensors: tensor 'model\.layers\.1\.[\w.]+' belongs to layer 1, but "
        r"num_hidden_layers in config\.json is 1",
    ):
        load_model(hf_dir)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", 64.0, "must be an integer, got 64.0"),
        ("hidden_size", "64", "must be an integer, got '64'"),
        ("num_hidden_layers", True, "must be an integer, got True"),
        ("num_attention_heads", 0, r"must be in \[1, 1024\], got 0"),
        ("vocab_size", 10**9, r"must be in \[1, 4194304\], got 1000000000 \(larger than"),
        ("intermediate_size", 2**40, r"must be in \[1, 131072\]"),
        ("num_hidden_layers", 10**9, r"must be in \[1, 1024\]"),
        ("head_dim", -16, r"must be in \[1, 1024\], got -16"),
    ],
)
def test_config_json_bad_size(hf_dir: Path, field: str, value: object, message: str) -> None:
    (hf_dir / "config.json").write_text(json.dumps(tiny_config(**{field: value})))
    with pytest.raises(
        ModelLoadError, match=rf"config\.json: model config field {field} {message}"
    ):
        load_model(hf_dir)


def _gguf_tensor_names(path: Path) -> list[str]:
    return [t.name for t in gguf.GGUFReader(path).tensors]


def _edit_safetensors_header(file: Path, name: str, shape: list[int]) -> None:
    """Declare another shape for ``name`` in the header; the data stays where it was."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header[name]["shape"] = shape
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads its header to 8 bytes
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
