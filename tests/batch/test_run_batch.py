"""``specbatch run-batch``: one result line per input line, errors per line, exact resume after
a SIGKILL, shards that partition the input; results equal the engine's own generation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from specbatch import LLMEngine, SamplingParams
from specbatch.batch import BatchJob, Shard
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError

MODEL_NAME = "tiny"


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    config: dict[str, Any] = {
        "model": str(model_dir),
        "num_kv_blocks": 256,
        "max_model_len": 256,
        "block_size": 8,
        "max_num_seqs": 4,
        "speculative_config": {"method": "ngram"},
    }
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def completion(custom_id: str, prompt: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": prompt, "max_tokens": 10, "temperature": 0, **body},
    }


def chat(custom_id: str, text: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 10,
            "temperature": 0,
            **body,
        },
    }


def write_lines(path: Path, lines: list[Any]) -> Path:
    with path.open("w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def read_results(path: Path) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.decode().splitlines()]


def greedy_text(engine: LLMEngine, prompt: str | list[int], max_tokens: int = 10) -> str:
    """The reference: the engine asked directly."""
    engine.add_request("reference", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    text = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                text = out.outputs[0].text
    assert text is not None
    return text


def test_every_line_gets_one_result(tiny_model_dir: Path, tmp_path: Path) -> None:
    lines: list[Any] = [
        completion("text", "the cat sat on the mat"),
        completion("ids", [5, 6, 7, 8], model=MODEL_NAME),
        completion("two-prompts", ["a b c", "d e f"], n=2, temperature=0.8, seed=3),
        chat("chat", "hello there"),
        "{not json",
        "[1, 2]",
        "",  # blank: not a request
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},  # no custom_id
        completion("text", "a repeated custom_id"),
        {**completion("get", "x"), "method": "GET"},
        {**completion("url", "x"), "url": "/v1/embeddings"},
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
        completion("bad-type", "x", temperature="hot"),
        completion("other-model", "x", model="gpt-4"),
        completion("stream", "x", stream=True),
        completion("empty-prompt", []),
        completion("huge-int", "x", max_tokens=10**30),
        chat("bad-role", "x") | {"body": {"messages": [{"role": "wizard", "content": "x"}]}},
        '{"custom_id": "nan", "method": "POST", "url": "/v1/completions", '
        '"body": {"prompt": "x", "temperature": NaN}}',
    ]
    source = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    engine = make_engine(tiny_model_dir)
    summary = BatchJob(engine, MODEL_NAME, progress=False).run(source, out)
    results = read_results(out)
    requests = [line for line in lines if line != ""]
    assert len(results) == len(requests) == summary.lines
    assert summary.succeeded == 4
    assert summary.failed == len(requests) - 4
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks  # nothing leaked

    by_id: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_id.setdefault(result["custom_id"], []).append(result)

    def status(custom_id: str) -> int:
        (result,) = by_id[custom_id]
        return result["response"]["status_code"]

    # successes equal the engine's own greedy text
    reference = make_engine(tiny_model_dir)
    first, repeated = sorted(by_id["text"], key=lambda r: r["error"] is not None)
    text = first["response"]["body"]
    assert text["object"] == "text_completion"
    assert text["model"] == MODEL_NAME
    assert text["choices"][0]["text"] == greedy_text(reference, "the cat sat on the mat")
    assert by_id["ids"][0]["response"]["body"]["choices"][0]["text"] == greedy_text(
        reference, [5, 6, 7, 8]
    )
    assert len(by_id["two-prompts"][0]["response"]["body"]["choices"]) == 4
    chat_body = by_id["chat"][0]["response"]["body"]
    assert chat_body["object"] == "chat.completion"
    _, ids = reference.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    assert chat_body["choices"][0]["message"]["content"] == greedy_text(reference, ids)
    assert chat_body["usage"]["prompt_tokens"] == len(ids)

    # the repeated custom_id: the first line answered, the second an error naming its line
    assert first["response"]["status_code"] == 200
    assert repeated["error"]["code"] == "duplicate_custom_id"
    assert repeated["error"]["line"] == 9
    # lines that are not requests: an error object with the line number
    line_errors = {r["error"]["line"]: r["error"]["code"] for r in results if r["error"]}
    assert line_errors == {
        5: "invalid_json",
        6: "invalid_line",
        8: "invalid_custom_id",
        9: "duplicate_custom_id",
        10: "invalid_method",
        11: "invalid_url",
        12: "invalid_body",
        19: "invalid_json",
    }
    # requests the server would refuse: the same status and field
    assert status("bad-type") == 400
    assert by_id["bad-type"][0]["response"]["body"]["error"]["param"] == "temperature"
    assert status("other-model") == 404
    assert status("stream") == 400
    assert status("empty-prompt") == 400
    assert by_id["empty-prompt"][0]["response"]["body"]["error"]["param"] == "prompt"
    assert status("huge-int") == 400
    assert by_id["huge-int"][0]["response"]["body"]["error"]["param"] == "max_tokens"
    assert status("bad-role") == 400


def test_a_rerun_skips_what_is_done_and_cuts_a_partial_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    source = write_lines(
        tmp_path / "in.jsonl", [completion(f"r{i}", f"prompt number {i}") for i in range(6)]
    )
    out = tmp_path / "out.jsonl"
    done = {
        "id": "batch_req_x",
        "custom_id": "r2",
        "response": {"status_code": 200, "request_id": "x", "body": {"marker": True}},
        "error": None,
    }
    out.write_text(json.dumps(done) + "\n" + '{"id": "batch_req_y", "custom_id": "r3", "resp')
    engine = make_engine(tiny_model_dir)
    summary = BatchJob(engine, MODEL_NAME, progress=False).run(source, out)
    assert summary.skipped == 1
    assert summary.succeeded == 5
    results = read_results(out)
    assert sorted(r["custom_id"] for r in results) == [f"r{i}" for i in range(6)]
    assert results[0]["response"]["body"] == {"marker": True}  # kept, not redone
    again = BatchJob(engine, MODEL_NAME, progress=False).run(source, out)
    assert again.skipped == 6
    assert len(read_results(out)) == 6


def test_shards_partition_the_input(tiny_model_dir: Path, tmp_path: Path) -> None:
    lines: list[Any] = [completion(f"r{i}", f"shard prompt {i}") for i in range(10)]
    lines[4] = "not json"
    source = write_lines(tmp_path / "in.jsonl", lines)
    engine = make_engine(tiny_model_dir)
    seen: list[str] = []
    for index in range(3):
        out = tmp_path / f"out{index}.jsonl"
        BatchJob(engine, MODEL_NAME, Shard(index, 3), progress=False).run(source, out)
        keys = [
            f"line{r['error']['line']}" if r["error"] else r["custom_id"] for r in read_results(out)
        ]
        expected = [
            "line5" if number == 5 else f"r{number - 1}"
            for number in range(1, 11)
            if (number - 1) % 3 == index
        ]
        assert sorted(keys) == sorted(expected)
        seen += keys
    assert len(seen) == len(set(seen)) == 10


def test_shard_parsing() -> None:
    assert Shard.parse("2/5") == Shard(2, 5)
    for bad in ("5/5", "-1/3", "1", "a/b", "1/0"):
        with pytest.raises(ConfigError, match=r"i/n"):
            Shard.parse(bad)


@pytest.mark.engine_errors
def test_a_failing_step_is_a_500_line_and_the_job_goes_on(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_lines(
        tmp_path / "in.jsonl", [completion(f"r{i}", f"prompt {i}") for i in range(6)]
    )
    out = tmp_path / "out.jsonl"
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    original, calls = engine.runner.execute, 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", failing)
    summary = BatchJob(engine, MODEL_NAME, progress=False).run(source, out)
    results = read_results(out)
    assert len(results) == 6
    failed = [r for r in results if r["response"]["status_code"] == 500]
    assert 1 <= len(failed) <= 2
    assert "injected fault" in failed[0]["response"]["body"]["error"]["message"]
    assert summary.succeeded == 6 - len(failed)
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_sigkill_and_rerun_give_every_line_exactly_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The command itself, killed with SIGKILL mid-run and run again to the end."""
    count = 40
    lines = [completion(f"r{i}", f"the cat number {i} sat", max_tokens=40) for i in range(count)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "specbatch.cli",
        "run-batch",
        "-i",
        str(source),
        "-o",
        str(out),
        "--model",
        str(tiny_model_dir),
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "256",
        "--served-model-name",
        MODEL_NAME,
        "--no-progress",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.02)
    assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    partial = out.read_bytes().count(b"\n")
    assert 5 <= partial < count
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert f"{count} requests" in finished.stderr
    results = read_results(out)
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(count))
    assert all(r["response"]["status_code"] == 200 for r in results)
    # the resumed run's results are what one uninterrupted run gives
    clean_out = tmp_path / "clean.jsonl"
    BatchJob(make_engine(tiny_model_dir), MODEL_NAME, progress=False).run(source, clean_out)
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results}
    clean = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read_results(clean_out)
    }
    assert texts == clean


def test_the_output_must_be_a_batch_result_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", [completion("a", "x")])
    out = tmp_path / "out.jsonl"
    out.write_text("hello\n")
    with pytest.raises(ConfigError, match="not a batch result"):
        BatchJob(make_engine(tiny_model_dir), MODEL_NAME, progress=False).run(source, out)
    with pytest.raises(ConfigError, match="must not be the input"):
        BatchJob(make_engine(tiny_model_dir), MODEL_NAME, progress=False).run(source, source)


def test_the_store_learns_across_the_files_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Lines that repeat earlier lines' prompts (a batch job's repeated work): the later ones
    draft from what the earlier ones generated (the store of other requests' tokens), and
    every result is the one speculation off gives."""
    prompts = [[7 + i, 40 + 3 * i, 90, 91, 17 * i % 250 + 3, 5] for i in range(6)]
    lines = [completion(f"r{i}", prompts[i % 6], max_tokens=24) for i in range(18)]
    source = write_lines(tmp_path / "in.jsonl", lines)
    texts = {}
    for spec in ({"method": "off"}, {"method": "suffix"}):
        engine = make_engine(tiny_model_dir, speculative_config=spec, max_num_seqs=2)
        out = tmp_path / f"out-{spec['method']}.jsonl"
        BatchJob(engine, MODEL_NAME, progress=False).run(source, out)
        texts[spec["method"]] = {
            r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read_results(out)
        }
        if spec["method"] == "suffix":
            stats = engine.stats
            assert stats.suffix_store_requests == 18
            assert stats.num_accepted_tokens_by_way.get("suffix", 0) > 24, stats
    assert texts["suffix"] == texts["off"]
