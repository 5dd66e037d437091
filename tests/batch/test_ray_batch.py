"""``run-batch --ray``: a file of good, bad and repeated lines through two engine replicas on a
local Ray cluster (2 CPUs) gives ``run-batch``'s result lines (greedy text equal per
``custom_id``, the same error lines); a replica actor killed mid-job is replaced and its batch
run again; a driver killed mid-job is resumed by a rerun; either way every ``custom_id`` is in
the output exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from specbatch.batch import BatchJob  # noqa: E402
from specbatch.batch.ray_job import RayBatchSettings, import_ray, run_on_ray  # noqa: E402
from specbatch.config import EngineConfig  # noqa: E402
from specbatch.engine.llm_engine import LLMEngine  # noqa: E402
from specbatch.errors import ConfigError  # noqa: E402
from tests.batch.test_run_batch import completion, write_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REPLICA = "MapWorker(MapBatches(EngineReplica))"
CONFIG: dict[str, Any] = {"num_kv_blocks": 256, "block_size": 8, "max_model_len": 256}


def request_file(path: Path, lines: int = 300, max_tokens: int = 12) -> Path:
    """Mostly good lines; every 25th not JSON, every 25th (offset) a repeated custom_id, every
    25th (another offset) a body the server would refuse."""
    out: list[Any] = []
    for i in range(lines):
        if i % 25 == 3:
            out.append("{not json")
        elif i % 25 == 4:
            out.append(completion("c0", "a repeated id"))
        elif i % 25 == 5:
            out.append(completion(f"c{i}", "bad", max_tokens=-1))
        else:
            out.append(completion(f"c{i}", f"Line {i} asks about {i * 13}", max_tokens=max_tokens))
    return write_lines(path, out)


def key(record: dict[str, Any]) -> tuple[Any, ...]:
    """What must match between two runs: the text (or the error) per custom_id or line."""
    if record["response"] is None:
        return ("line", record["error"]["line"], record["error"]["code"])
    body = record["response"]["body"]
    answer = body["choices"][0]["text"] if "choices" in body else body["error"]["message"]
    return ("id", record["custom_id"], record["response"]["status_code"], answer)


def results(path: Path) -> list[tuple[Any, ...]]:
    return sorted(key(json.loads(line)) for line in path.read_text().splitlines())


def once_each(path: Path) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ids = Counter(r["custom_id"] for r in records if r["response"] is not None)
    assert max(ids.values()) == 1, [i for i, n in ids.items() if n > 1]
    lines = Counter(r["error"]["line"] for r in records if r["response"] is None)
    assert max(lines.values()) == 1


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The same file through ``run-batch`` on one engine."""
    directory = tmp_path_factory.mktemp("reference")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, **CONFIG))
    BatchJob(engine, "tiny", progress=False).run(
        request_file(directory / "in.jsonl"), directory / "out.jsonl"
    )
    return directory / "out.jsonl"


def config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), max_num_seqs=8, num_threads=1, **CONFIG)


def test_two_replicas_write_what_one_engine_writes(
    local_ray: None, reference: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    summary = run_on_ray(
        config(tiny_model_dir),
        request_file(tmp_path / "in.jsonl"),
        out,
        "tiny",
        RayBatchSettings(replicas=2),
        progress=False,
    )
    assert results(out) == results(reference)
    once_each(out)
    assert (summary.lines, summary.failed, summary.skipped) == (300, 36, 0)
    # a rerun finds everything done and writes nothing
    before = out.read_bytes()
    again = run_on_ray(config(tiny_model_dir), tmp_path / "in.jsonl", out, "tiny", progress=False)
    assert again.skipped == 300
    assert out.read_bytes() == before


def test_the_library_maps_a_dataset_of_request_lines(
    local_ray: None, reference: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``map_requests`` on a Dataset the caller made: a record per row, each the one run-batch
    writes for that line (bad ones included)."""
    from specbatch.batch.ray_job import map_requests

    lines = request_file(tmp_path / "in.jsonl", lines=40).read_text().splitlines()
    rows = [{"line": line, "number": n} for n, line in enumerate(lines, 1)]
    # what run_on_ray answers itself (not JSON, a repeated custom_id) is not a request
    rows = [r for r in rows if r["line"] != "{not json" and "a repeated id" not in r["line"]]
    mapped = map_requests(ray.data.from_items(rows), config(tiny_model_dir), "tiny")
    records = [json.loads(row["record"]) for row in mapped.iter_rows()]
    ids = {json.loads(r["line"])["custom_id"] for r in rows}
    expected = [key(json.loads(line)) for line in reference.read_text().splitlines()]
    assert sorted(key(r) for r in records) == sorted(k for k in expected if k[1] in ids)
    assert sum(r["response"]["status_code"] == 400 for r in records) == 2  # max_tokens -1


def test_a_replica_can_be_tensor_parallel_inside(
    local_ray: None, reference: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One replica of two ranks (its workers spawned inside the actor) writes the same lines."""
    out = tmp_path / "out.jsonl"
    lines = request_file(tmp_path / "all.jsonl").read_text().splitlines()[:40]
    requests = write_lines(tmp_path / "in.jsonl", lines)
    tp = EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, tensor_parallel_size=2, **CONFIG)
    run_on_ray(tp, requests, out, "tiny", RayBatchSettings(replicas=1), progress=False)
    numbers = set(range(1, 41))
    expected = [
        k
        for k in results(reference)
        if (k[0] == "line" and k[1] in numbers)
        or (k[0] == "id" and int(k[1][1:]) < 40 and k[1] != "c0")
    ]
    got = [k for k in results(out) if k[1] != "c0"]
    assert got == expected
    once_each(out)


def test_a_killed_replica_is_replaced_and_its_batch_run_again(
    local_ray: None, reference: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    requests = request_file(tmp_path / "in.jsonl")
    done: list[Any] = []
    job = threading.Thread(
        target=lambda: done.append(
            run_on_ray(
                config(tiny_model_dir),
                requests,
                out,
                "tiny",
                RayBatchSettings(replicas=2, batch_size=16),
                progress=False,
            )
        )
    )
    job.start()
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 60):
        assert time.monotonic() < deadline
        assert job.is_alive()
        time.sleep(0.05)
    victims = replica_pids()
    assert len(victims) == 2
    os.kill(victims[0], signal.SIGKILL)
    assert out.read_text().count("\n") < 300  # mid-job
    job.join(timeout=180)
    assert not job.is_alive()
    assert done
    assert results(out) == results(reference)
    once_each(out)
    assert victims[0] not in replica_pids()


def replica_pids() -> list[int]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in listing.splitlines() if REPLICA in line]


def test_a_killed_driver_is_resumed_by_a_rerun(
    local_ray: None, reference: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The command line, killed (SIGKILL) once lines are coming back, then the job run again
    (here in this process, on its cluster): the output is the reference's, no custom_id
    twice."""
    out = tmp_path / "out.jsonl"
    requests = request_file(tmp_path / "in.jsonl")
    command = [sys.executable, "-m", "specbatch.cli", "run-batch", "-i", str(requests)]
    command += ["-o", str(out), "--model", str(tiny_model_dir), "--max-num-seqs", "8"]
    command += ["--num-kv-blocks", "256", "--max-model-len", "256", "--no-progress"]
    command += ["--ray", "--replicas", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    # its own session: the local cluster it starts is in it, and ends with it below
    driver = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 40):
            assert time.monotonic() < deadline
            assert driver.poll() is None
            time.sleep(0.02)
        driver.kill()
        driver.wait()
    finally:  # a killed driver's cluster leaves Ray's agents behind, in its session
        end_sessions([driver.pid])
    written = out.read_text().count("\n")
    assert written < 300  # killed mid-job
    summary = run_on_ray(config(tiny_model_dir), requests, out, "tiny", progress=False)
    assert summary.skipped >= written - 1  # a partial last line is cut and answered again
    assert results(out) == results(reference)
    once_each(out)


def end_sessions(sessions: list[int]) -> None:
    listing = subprocess.run(["ps", "-eo", "pid,sid"], capture_output=True, text=True).stdout
    for line in listing.splitlines()[1:]:
        pid, sid = map(int, line.split())
        if sid in sessions and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ray_settings_and_flags_are_checked(tiny_model_dir: Path, tmp_path: Path) -> None:
    from specbatch.cli import main

    with pytest.raises(ConfigError, match="replicas must be a positive integer"):
        RayBatchSettings(replicas=0)
    with pytest.raises(ConfigError, match="batch_size must be at least 1"):
        RayBatchSettings(batch_size=0)
    requests = request_file(tmp_path / "in.jsonl", lines=3)
    args = ["run-batch", "-i", str(requests), "-o", str(tmp_path / "o"), "--model"]
    args.append(str(tiny_model_dir))
    assert main([*args, "--ray", "--shard", "0/2"]) == 2
    assert main([*args, "--replicas", "3"]) == 2
    assert not (tmp_path / "o").exists()


def test_without_ray_installed_the_error_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'specbatch\[ray\]'"):
        import_ray()
