"""The command line: streaming generation, speculation flags, errors as exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from specbatch.cli import build_parser, main, speculative_config
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError
from specbatch.spec_decode.config import SpeculativeConfig


def test_generate_streams_text_and_reports_speculation(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "generate",
            "The quick brown fox",
            "--model",
            str(tiny_model_dir),
            "--max-tokens",
            "12",
            "--max-model-len",
            "128",
            "-k",
            "3",
        ]
    )
    assert code == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n")
    assert "12 tokens" in err
    assert "finish: length" in err


def test_generate_equals_library_output(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specbatch import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), max_model_len=128, num_kv_blocks=64)
    expected = (
        llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .text
    )
    assert (
        main(
            [
                "generate",
                "Hello there",
                "--model",
                str(tiny_model_dir),
                "--max-tokens",
                "10",
                "--max-model-len",
                "128",
                "--speculative",
                "off",
                "--quiet",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == expected + "\n"


def test_bad_input_is_an_error_exit(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "x", "--model", str(tiny_model_dir), "--max-tokens", "0"]) == 2
    assert "max_tokens must be >= 1, got 0" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "/nonexistent/model"]) == 2
    assert "no such model directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--speculative", "bogus"])


def test_speculative_flags() -> None:
    parser = build_parser()

    def resolved(argv: list[str], shipped_draft_fits: bool = True) -> SpeculativeConfig:
        """What the engine makes of the flags for a target the shipped draft fits (or not)."""
        config = SpeculativeConfig.parse(speculative_config(parser.parse_args(argv)))
        return config.resolved(shipped_draft_fits)

    assert not resolved(["generate", "x", "--speculative", "off"]).enabled
    # 'auto' (the default, generate and serve alike): hybrid with the shipped draft where it
    # fits, n-gram with the store of other requests elsewhere; the goodput controller on
    # unless --fixed-k
    assert resolved(["generate", "x", "-k", "6"]) == SpeculativeConfig(
        "hybrid", 6, prompt_lookup_min=2, draft_confidence_threshold=0.5
    )
    assert resolved(["serve", "-k", "6"], shipped_draft_fits=False) == SpeculativeConfig(
        "suffix", 6, prompt_lookup_min=1, prompt_lookup_max=4
    )
    no_store = ["serve", "--suffix-store-tokens", "0"]
    assert resolved(no_store, shipped_draft_fits=False).method == "ngram"
    assert resolved(no_store).store_tokens == 0
    small = ["generate", "x", "--speculative", "suffix", "--suffix-store-tokens", "4096"]
    assert resolved(small).store_tokens == 4096
    given = ["generate", "x", "--draft-model", "d", "--ngram-min", "3"]
    assert resolved(given, shipped_draft_fits=False) == SpeculativeConfig(
        "hybrid", 8, model="d", prompt_lookup_min=3, prompt_lookup_max=4
    )
    draft = ["generate", "x", "--speculative", "draft", "--draft-model", "d"]
    assert resolved([*draft, "--draft-confidence", "0"]) == SpeculativeConfig(
        "draft_model", 8, model="d", draft_confidence_threshold=0.0
    )
    fixed = ["serve", "--speculative", "ngram", "--fixed-k"]
    assert resolved(fixed) == SpeculativeConfig(
        "ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4, adaptive_k=False
    )
    long_lookup = ["generate", "x", "--speculative", "ngram", "--ngram-min", "6"]
    assert resolved(long_lookup) == SpeculativeConfig(
        "ngram", 8, prompt_lookup_min=6, prompt_lookup_max=6
    )
    for flags, unused in (
        (["--speculative", "off", "--fixed-k"], "--fixed-k"),
        (["--speculative", "draft", "--ngram-min", "2"], "--ngram-min"),
        (["--speculative", "ngram", "--draft-model", "d"], "--draft-model"),
        (["--speculative", "ngram", "--suffix-store-tokens", "9"], "--suffix-store-tokens"),
    ):
        with pytest.raises(ConfigError, match=f"{unused} has no effect"):
            speculative_config(parser.parse_args(["generate", "x", *flags]))
    serve = parser.parse_args(["serve", "--port", "9000", "--api-key", "k"])
    assert (serve.port, serve.api_key, serve.speculative) == (9000, "k", "auto")


def test_auto_recognises_the_default_model_by_its_content(
    default_gguf: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specbatch.engine import setup

    monkeypatch.setattr(setup, "shipped_draft_available", lambda: True)
    by_path = EngineConfig(model=str(default_gguf), num_kv_blocks=16)
    assert setup.load_models(by_path).speculation == SpeculativeConfig("auto").resolved(True)
    other = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16)
    models = setup.load_models(other)
    assert models.speculation is not None
    assert models.speculation.method == "suffix"
    assert models.draft is None


def test_the_quantization_flag_gives_the_engine_setting() -> None:
    from specbatch.cli import engine_config

    parser = build_parser()

    def setting(*flags: str) -> str | None:
        return engine_config(parser.parse_args(["generate", "x", *flags])).quantization

    assert setting() == "auto"
    assert setting("--quantization", "none") is None
    assert setting("--quantization", "gguf") == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--quantization", "int4"])


def test_generate_names_the_weights_it_multiplied(capsys: pytest.CaptureFixture[str]) -> None:
    from specbatch.kernels.gguf_linear import vector_isa

    common = ["generate", "Hi", "--max-tokens", "2", "--speculative", "off", "--max-model-len"]
    assert main([*common, "256"]) == 0
    default = "gguf (float32 activations)" if vector_isa() in ("avx2", "avx512") else "float32"
    assert f"weights: {default};" in capsys.readouterr().err
    assert main([*common, "256", "--quantization", "none"]) == 0
    assert "weights: float32;" in capsys.readouterr().err
