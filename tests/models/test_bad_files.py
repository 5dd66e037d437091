"""Damaged or unsupported model files fail with a ModelLoadError naming the file and tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.errors import ModelLoadError
from specbatch.models import load_model
from tests.gguf_writer import write_gguf
from tests.helpers import tiny_config, write_hf_checkpoint


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
