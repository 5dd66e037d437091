"""``quantization="auto"``: the default model multiplies its GGUF blocks as stored; each explicit
setting gives its own mode; a file (or machine) the kernels cannot serve falls back to float32
with one log line naming the reason."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest
import torch

from specbatch import LLMEngine
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from specbatch.kernels import gguf_linear
from specbatch.kernels.block_forms import RepackedForm
from specbatch.kernels.linear import Linear
from specbatch.models.weight_mode import WeightMode, resolve_weight_mode
from tests.gguf_writer import write_gguf
from tests.helpers import tiny_config, write_hf_checkpoint, write_tiny_tokenizer

CPU = torch.device("cpu")
GGUF = WeightMode(torch.float32, "gguf")
FLOAT32 = WeightMode(torch.float32, None)
OFF = {"method": "off"}
VECTOR_KERNEL = gguf_linear.vector_isa() in ("avx2", "avx512")


def _records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "specbatch"]


def _engine(**settings: object) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=16, max_model_len=256, speculative_config=OFF, **settings)  # type: ignore[arg-type]
    return LLMEngine(config)


@pytest.mark.skipif(not VECTOR_KERNEL, reason="the GGUF kernel has no vector path here")
def test_the_default_load_of_the_default_model_multiplies_its_blocks_as_stored() -> None:
    engine = _engine()
    assert engine.weight_mode == GGUF
    linears = engine.model.layer_linears()
    assert len(linears) == 4 * 30
    assert engine.model.lm_head.form is engine.model.model.embed_tokens.form  # tied, shared
    assert all(isinstance(m.form, RepackedForm) and m.weight is None for m in linears)
    assert engine.model.fused.applies()  # each decoder layer one C call


def test_without_a_vector_kernel_the_default_model_is_float32(
    default_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for isa, why in (("plain", "neither AVX2 with FMA nor AVX-512"), (None, "could not be built")):
        monkeypatch.setattr(gguf_linear, "vector_isa", lambda isa=isa: isa)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specbatch"):
            assert resolve_weight_mode("auto", "auto", default_gguf, CPU) == FLOAT32
        (record,) = _records(caplog)
        assert why in record


@pytest.mark.parametrize(
    ("dtype", "quantization", "expected"),
    [
        ("float32", "auto", FLOAT32),
        ("bfloat16", "auto", WeightMode(torch.bfloat16, None)),
        ("auto", None, FLOAT32),
        ("bfloat16", None, WeightMode(torch.bfloat16, None)),
        ("auto", "gguf", GGUF),
        ("float32", "gguf", GGUF),
    ],
)
def test_each_explicit_setting_gives_its_own_mode(
    default_gguf: Path,
    caplog: pytest.LogCaptureFixture,
    dtype: str,
    quantization: str | None,
    expected: WeightMode,
) -> None:
    with caplog.at_level(logging.INFO, logger="specbatch"):
        assert resolve_weight_mode(dtype, quantization, default_gguf, CPU) == expected
    assert _records(caplog) == []  # asked for: nothing to explain


def test_an_explicit_setting_reaches_the_model() -> None:
    engine = _engine(quantization=None)
    assert engine.weight_mode == FLOAT32
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert all(not isinstance(m.form, RepackedForm) for m in linears)
    bf16 = _engine(dtype="bfloat16")
    assert bf16.weight_mode == WeightMode(torch.bfloat16, None)
    assert bf16.model.dtype == torch.bfloat16


def test_hf_directories_cuda_and_tensor_parallel_ranks_are_not_quantized(
    default_gguf: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="specbatch"):
        assert resolve_weight_mode("auto", "auto", tiny_model_dir, CPU) == FLOAT32
    assert _records(caplog) == []
    with caplog.at_level(logging.INFO, logger="specbatch"):
        cuda = resolve_weight_mode("auto", "auto", default_gguf, torch.device("cuda"))
        assert cuda == WeightMode(torch.bfloat16, None)
    (record,) = _records(caplog)  # one line: the blocks are dequantised on CUDA
    assert "on CUDA: its Q4_1, Q8_0 tensors are dequantised to bfloat16" in record
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specbatch"):
        assert resolve_weight_mode("auto", "auto", default_gguf, CPU, 2) == FLOAT32
    (record,) = _records(caplog)
    assert "tensor-parallel" in record
    assert EngineConfig(tensor_parallel_size=2).quantization == "auto"
    with pytest.raises(ConfigError, match="one process"):
        EngineConfig(tensor_parallel_size=2, quantization="gguf")


def _tiny_gguf(path: Path, kinds: dict[str, gguf.GGMLQuantizationType]) -> Path:
    """A tiny llama GGUF: every matrix Q4_1 but those of ``kinds`` (by HF name suffix)."""
    (path.parent / "hf").mkdir(parents=True)
    vocab = write_tiny_tokenizer(path.parent / "hf")  # the engine's tokenizer
    config = tiny_config(vocab_size=max(vocab, 96))
    state = write_hf_checkpoint(path.parent / "hf", config).state_dict()
    qtypes = {
        name: next(
            (kind for suffix, kind in kinds.items() if name.endswith(suffix)),
            gguf.GGMLQuantizationType.Q4_1,
        )
        for name, tensor in state.items()
        if tensor.dim() == 2
    }
    write_gguf(path, config, state, qtypes=qtypes)
    return path


def test_a_file_the_kernels_cannot_serve_falls_back_with_one_line_naming_the_tensor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kinds = {"layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.MXFP4}
    path = _tiny_gguf(tmp_path / "model.gguf", kinds)
    with caplog.at_level(logging.INFO, logger="specbatch"):
        assert resolve_weight_mode("auto", "auto", path, CPU) == FLOAT32
    (record,) = _records(caplog)
    assert "blk.1.ffn_down.weight is MXFP4, which the kernels do not multiply" in record
    assert record.endswith("dequantising to float32")


@pytest.mark.skipif(not VECTOR_KERNEL, reason="the GGUF kernel has no vector path here")
@pytest.mark.parametrize(
    "kinds",
    [
        {"layers.0.mlp.down_proj.weight": gguf.GGMLQuantizationType.Q5_0},
        {"proj.weight": gguf.GGMLQuantizationType.F32},
        {"layers.1.self_attn.v_proj.weight": gguf.GGMLQuantizationType.Q8_0},
        {
            "gate_proj.weight": gguf.GGMLQuantizationType.Q4_0,
            "embed_tokens.weight": gguf.GGMLQuantizationType.F16,
        },
    ],
    ids=["q5_0", "f32", "mixed-fused", "q4_0-f16"],
)
def test_files_of_every_kernel_type_take_the_exact_mode_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kinds: dict[str, gguf.GGMLQuantizationType]
) -> None:
    path = _tiny_gguf(tmp_path / "model.gguf", kinds)
    with caplog.at_level(logging.INFO, logger="specbatch"):
        assert resolve_weight_mode("auto", "auto", path, CPU) == GGUF
    assert _records(caplog) == []


@pytest.mark.skipif(not VECTOR_KERNEL, reason="the GGUF kernel has no vector path here")
def test_a_tiny_file_the_kernels_read_is_loaded_quantized_and_one_they_cannot_is_not(
    tmp_path: Path,
) -> None:
    readable = _tiny_gguf(tmp_path / "a" / "model.gguf", {})
    unreadable = _tiny_gguf(
        tmp_path / "b" / "model.gguf",
        {"layers.0.mlp.down_proj.weight": gguf.GGMLQuantizationType.MXFP4},
    )
    quantized = _engine(model=str(readable), tokenizer=str(readable.parent / "hf"))
    assert quantized.weight_mode == GGUF
    assert all(
        isinstance(m.form, RepackedForm) for m in quantized.model.modules() if isinstance(m, Linear)
    )
    plain = _engine(model=str(unreadable), tokenizer=str(unreadable.parent / "hf"))
    assert plain.weight_mode == FLOAT32
    assert all(
        not isinstance(m.form, RepackedForm) for m in plain.model.modules() if isinstance(m, Linear)
    )


def test_unknown_settings_are_refused(default_gguf: Path) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of auto, gguf or None"):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        resolve_weight_mode("auto", "q4", default_gguf, CPU)
    with pytest.raises(ConfigError, match="dtype"):
        resolve_weight_mode("float8", "auto", default_gguf, CPU)
