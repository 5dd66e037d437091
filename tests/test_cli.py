"""The command line: streaming generation, speculation flags, errors as exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from specbatch.cli import build_parser, main, resolved_method, speculative_config
from specbatch.errors import ConfigError
from specbatch.spec_decode import default_draft
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


def test_speculative_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    assert speculative_config(parser.parse_args(["generate", "x", "--speculative", "off"])) is None

    def resolved(argv: list[str]) -> SpeculativeConfig | None:
        """What the engine makes of the flags (the method's defaults filled in)."""
        return SpeculativeConfig.parse(speculative_config(parser.parse_args(argv)))

    lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": 4}
    ngram = {"method": "ngram", "num_speculative_tokens": 6, **lookup}
    shipped = {
        "method": "hybrid",
        "model": None,
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        "draft_confidence_threshold": 0.5,
    }
    # 'auto' (the default): hybrid lookup + the shipped draft for the default target when that
    # draft is preferred, n-gram for any other target or while the shipped draft does not pay.
    monkeypatch.setattr(default_draft, "shipped_draft_preferred", lambda: True)
    assert resolved(["generate", "x", "-k", "6"]) == SpeculativeConfig.parse(shipped)
    other = ["generate", "x", "-k", "6", "--model", "m.gguf"]
    assert resolved(other) == SpeculativeConfig.parse(ngram)
    monkeypatch.setattr(default_draft, "shipped_draft_preferred", lambda: False)
    assert resolved(["generate", "x", "-k", "6"]) == SpeculativeConfig.parse(ngram)
    given = ["generate", "x", "--draft-model", "d", "--ngram-min", "3"]
    assert resolved(given) == SpeculativeConfig(
        **{
            **shipped,
            "model": "d",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 3,
        }
    )
    draft = [
        "generate",
        "x",
        "--speculative",
        "draft",
        "--draft-model",
        "d",
        "--draft-confidence",
        "0",
    ]
    assert resolved(draft) == SpeculativeConfig(
        **{
            "method": "draft_model",
            "model": "d",
            "num_speculative_tokens": 4,
            "draft_confidence_threshold": 0.0,
        }
    )
    adaptive = ["serve", "--speculative", "ngram", "--adaptive-k"]
    assert resolved(adaptive) == SpeculativeConfig(
        **{
            "method": "ngram",
            "num_speculative_tokens": 4,
            "adaptive_k": True,
            **lookup,
        }
    )
    long_lookup = ["generate", "x", "--speculative", "ngram", "--ngram-min", "6"]
    assert resolved(long_lookup) == SpeculativeConfig(
        **{
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 6,
            "prompt_lookup_max": 6,
        }
    )
    for flags, unused in (
        (["--speculative", "off", "--adaptive-k"], "--adaptive-k"),
        (["--speculative", "draft", "--ngram-min", "2"], "--ngram-min"),
        (["--speculative", "ngram", "--draft-model", "d"], "--draft-model"),
    ):
        with pytest.raises(ConfigError, match=f"{unused} has no effect"):
            speculative_config(parser.parse_args(["generate", "x", *flags]))
    serve = parser.parse_args(["serve", "--port", "9000", "--api-key", "k"])
    assert (serve.port, serve.api_key, serve.speculative) == (9000, "k", "off")


def test_auto_recognises_the_default_model_by_its_path(
    default_gguf: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_draft, "shipped_draft_preferred", lambda: True)
    parser = build_parser()
    by_path = parser.parse_args(["generate", "x", "--model", str(default_gguf)])
    assert resolved_method(by_path) == "hybrid"
    other = parser.parse_args(["generate", "x", "--model", str(tiny_model_dir)])
    assert resolved_method(other) == "ngram"


def test_auto_speculation_is_off_on_the_quantized_path_unless_asked_for() -> None:
    parser = build_parser()
    plain = parser.parse_args(["generate", "x", "--quantization", "gguf"])
    assert resolved_method(plain) == "off"
    assert speculative_config(plain) is None
    tuned = parser.parse_args(["generate", "x", "--quantization", "gguf", "-k", "3"])
    assert resolved_method(tuned) != "off"
    explicit = parser.parse_args(
        ["generate", "x", "--quantization", "gguf", "--speculative", "ngram"]
    )
    assert resolved_method(explicit) == "ngram"
