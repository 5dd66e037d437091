"""Tensor parallelism in a world torchrun starts: two "nodes" (``torchrun --nnodes 2
--nproc-per-node 1`` twice, on loopback, over gloo) compute what the in-process TP=2 and one
process compute, with speculation, prefix caching and preemption; the command line under
torchrun prints what one process prints; a killed rank, a rank that never comes, a peer that
stops answering and a world of the wrong size are each a named error within a bound on every
rank, never a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError, TensorParallelError
from specbatch.parallel.world import LaunchedWorld, RankWatch, check_world, join
from tests.parallel.torchrun_job import run

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("torchrun_job.py")
BOUND_S = 90  # a run of two nodes loads two tiny models: seconds; a hang is this bound


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(tmp_path: Path, args: list[str], port: int) -> list[subprocess.Popen[str]]:
    """Two nodes of one process each, like two hosts on one network."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_CPP_LOG_LEVEL="FATAL")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    nodes = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        command += ["--nproc-per-node", "1", "--node-rank", str(node)]
        command += ["--master-addr", "127.0.0.1", "--master-port", str(port), *args]
        nodes.append(
            subprocess.Popen(
                command,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return nodes


def finish(nodes: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    results = []
    for node in nodes:
        try:
            out, err = node.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            raise AssertionError("a torchrun node hung") from None
        results.append((node.returncode, out, err))
    return results


def job_file(tmp_path: Path, **job: Any) -> Path:
    (tmp_path / "pids").mkdir(exist_ok=True)
    job.setdefault("output", str(tmp_path / "out.json"))
    job.setdefault("pids", str(tmp_path / "pids"))
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return path


def close(reference: list[dict[str, Any]], other: list[dict[str, Any]]) -> None:
    """Same greedy tokens, every logprob within 1e-4."""
    for ref, out in zip(reference, other, strict=True):
        assert out["token_ids"] == ref["token_ids"]
        pairs = list(zip(ref["logprobs"], out["logprobs"], strict=True))
        pairs += [
            (a, b)
            for a, b in zip(ref["prompt_logprobs"], out["prompt_logprobs"], strict=True)
            if a is not None
        ]
        assert pairs
        for a, b in pairs:
            assert a.keys() == b.keys()
            for token in a:
                assert b[token] == pytest.approx(a[token], abs=1e-4)


def test_two_torchrun_nodes_compute_what_one_process_and_in_process_tp_compute(
    tmp_path: Path, tiny_model_dir: Path, tiny_draft_dir: Path
) -> None:
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    prompts = [shared + [30, 31], shared + [40], [5, 6, 7, 5, 6, 7, 5, 6, 7], [50, 51]]
    config: dict[str, Any] = {
        "model": str(tiny_model_dir),
        "block_size": 8,
        "max_num_seqs": 4,
        "num_kv_blocks": 12,  # four sequences of ~40 tokens and 8 lookahead slots: preempted
        "max_model_len": 64,
        "max_num_batched_tokens": 12,  # prompts in chunks
        "enable_prefix_caching": True,
        # every slot drafted (the controller's choice depends on measured step times)
        "speculative_config": {
            "method": "draft_model",
            "model": str(tiny_draft_dir),
            "num_speculative_tokens": 8,
            "adaptive_k": False,
        },
    }
    params: dict[str, Any] = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "logprobs": 3}
    job = job_file(
        tmp_path, config=dict(config, tensor_parallel_size=2), prompts=prompts, params=params
    )
    nodes = torchrun(tmp_path, [str(JOB), str(job)], free_port())
    for code, _, err in finish(nodes):
        assert code == 0, err
    launched = json.loads((tmp_path / "out.json").read_text())
    assert launched["preemptions"] > 0
    assert launched["draft_tokens"] > 0
    assert launched["outputs"][1]["num_cached_tokens"] > 0  # the shared prefix was found
    assert launched["free_blocks_after"]

    one = run(LLMEngine(EngineConfig(**config)), prompts, SamplingParams(**params))
    close(one["outputs"], launched["outputs"])
    engine = LLMEngine(EngineConfig(**dict(config, tensor_parallel_size=2)))
    try:
        in_process = run(engine, prompts, SamplingParams(**params))
    finally:
        engine.shutdown()
    close(in_process["outputs"], launched["outputs"])


def test_the_command_line_under_torchrun_prints_what_one_process_prints(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    args = ["generate", "The sea and the", "--model", str(tiny_model_dir), "--max-tokens", "24"]
    one = subprocess.run(
        [sys.executable, "-m", "specbatch.cli", *args, "--quiet"],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=True,
    )
    nodes = torchrun(
        tmp_path,
        ["-m", "specbatch.cli", *args, "--quiet", "--tensor-parallel-size", "2"],
        free_port(),
    )
    (code0, out0, err0), (code1, out1, err1) = finish(nodes)
    assert (code0, code1) == (0, 0), err0 + err1
    assert out0 == one.stdout
    assert out0.strip()
    assert out1 == ""  # the worker rank prints nothing


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_ends_every_rank_with_a_named_error(
    tmp_path: Path, tiny_model_dir: Path, victim: int
) -> None:
    job = job_file(
        tmp_path,
        config={
            "model": str(tiny_model_dir),
            "tensor_parallel_size": 2,
            "num_kv_blocks": 64,
            "max_model_len": 256,
            "speculative_config": {"method": "off"},
        },
        prompts=[[5, 6, 7]],
        params={"temperature": 0, "max_tokens": 250, "ignore_eos": True},
        endless=True,
    )
    nodes = torchrun(tmp_path, [str(JOB), str(job)], free_port())
    ready = tmp_path / "out.ready"
    deadline = time.monotonic() + BOUND_S
    while not ready.exists():
        assert time.monotonic() < deadline, [n.poll() for n in nodes]
        time.sleep(0.1)
    time.sleep(0.3)
    os.kill(int((tmp_path / "pids" / str(victim)).read_text()), signal.SIGKILL)
    killed = time.monotonic()
    results = finish(nodes)
    assert time.monotonic() - killed < 30  # the watch's 2 s after a failed collective
    survivor = 1 - victim
    code, _, err = results[survivor]
    assert code != 0
    if survivor == 0:
        assert "rank 0 engine error: the engine is down: tensor-parallel rank 1 (" in err, err
    else:
        # rank 0 by the pid it registered, or by its host (torchrun's agent there, which holds
        # the store, may have gone with it)
        assert "specbatch tensor-parallel rank 1 stopped: rank 0" in err, err
    assert "stopped answering" in err
    assert results[victim][0] != 0


def test_a_world_in_the_environment() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert LaunchedWorld.from_env({}) is None
    assert LaunchedWorld.from_env(dict(env, WORLD_SIZE="1", RANK="0")) is None
    world = LaunchedWorld.from_env(env)
    assert world == LaunchedWorld(1, 2, 0, 1, "10.0.0.1:29500")
    assert not world.single_host
    local = LaunchedWorld.from_env(dict(env, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"))
    assert local is not None
    assert local.single_host
    with pytest.raises(ConfigError, match="MASTER_PORT not set"):
        LaunchedWorld.from_env({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(ConfigError, match="RANK=2 is outside WORLD_SIZE=2"):
        LaunchedWorld.from_env(dict(env, RANK="2"))
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        LaunchedWorld.from_env(dict(env, WORLD_SIZE="two"))
    with pytest.raises(ConfigError, match="MASTER_PORT=70000 is not a port"):
        LaunchedWorld.from_env(dict(env, MASTER_PORT="70000"))
    check_world(2, world)
    check_world(3, None)
    with pytest.raises(ConfigError, match=r"started 2 processes .* tensor_parallel_size is 1"):
        check_world(1, world)


def test_a_world_of_the_wrong_size_is_refused_before_anything_starts(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2))
    assert not dist.is_initialized()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_never_comes_is_named_within_the_bound(rank: int) -> None:
    """Rank 0 alone names the missing rank; a rank whose store never comes up says where it
    looked. Both within the join timeout (a client retries its connection once more)."""
    world = LaunchedWorld(rank, 2, 0, 1, f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    expected = "rank\\(s\\) 1 of 2 did not arrive" if rank == 0 else "no rendezvous store"
    with pytest.raises(TensorParallelError, match=expected):
        join(world, timeout=1.0)
    assert time.monotonic() - started < 8


def test_a_peer_that_stops_beating_is_named() -> None:
    """Two watches on one store: while both beat nothing is lost; once rank 1's stops, rank
    0's names it (with the host and pid it registered) within the stale bound."""
    store = dist.HashStore()
    worlds = [LaunchedWorld(r, 2, r, 2, "127.0.0.1:1") for r in range(2)]
    for world in worlds:
        prefixed = dist.PrefixStore(f"specbatch/{world.attempt}/", store)
        prefixed.set(f"who/{world.rank}", f"node-{world.rank} pid {100 + world.rank}")
        prefixed.set(f"beat/{world.rank}", "0")
    lost: list[str] = []
    watch0 = RankWatch(store, worlds[0], on_lost=lost.append, stale_seconds=1.5)
    watch1 = RankWatch(store, worlds[1], stale_seconds=1.5)
    time.sleep(2.5)
    assert watch0.lost is None
    assert watch1.lost is None
    watch1.stop()
    started = time.monotonic()
    named = watch0.wait_lost(5.0)
    assert named == "rank 1 (node-1 pid 101) stopped answering (no heartbeat for 1.5 s)"
    assert lost == [named]
    assert time.monotonic() - started < 3.0
    watch0.stop()


def test_run_batch_and_serve_under_torchrun_answer_what_one_process_answers(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``run-batch`` writes the one-process result lines on rank 0 (the other rank writes
    nothing); ``serve`` answers on rank 0's port with the same text, and a SIGTERM to rank 0's
    node ends both nodes."""
    import urllib.request

    from tests.batch.test_run_batch import completion, read_results, write_lines

    requests = write_lines(
        tmp_path / "in.jsonl",
        [completion(f"c{i}", f"Tell me about {word}") for i, word in enumerate("abcde")],
    )
    model = ["--model", str(tiny_model_dir), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(
        [sys.executable, "-m", "specbatch.cli", "run-batch", "-i", str(requests)]
        + ["-o", str(tmp_path / "one.jsonl"), *model],
        check=True,
        timeout=BOUND_S,
        env=env,
        capture_output=True,
    )
    nodes = torchrun(
        tmp_path,
        ["-m", "specbatch.cli", "run-batch", "-i", str(requests), "-o", "tp.jsonl", *model]
        + ["-tp", "2"],
        free_port(),
    )
    for code, _, err in finish(nodes):
        assert code == 0, err

    def texts(path: Path) -> dict[str, str]:
        return {
            r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read_results(path)
        }

    one = texts(tmp_path / "one.jsonl")
    assert len(one) == 5
    assert texts(tmp_path / "tp.jsonl") == one

    port = free_port()
    nodes = torchrun(
        tmp_path,
        ["-m", "specbatch.cli", "serve", "--model", str(tiny_model_dir), "-tp", "2"]
        + ["--port", str(port), "--log-level", "warning"],
        free_port(),
    )
    try:
        deadline = time.monotonic() + BOUND_S
        while True:
            assert time.monotonic() < deadline, [n.poll() for n in nodes]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        body = json.dumps(completion("x", "Tell me about c")["body"]).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["text"] == one["c2"]
    finally:
        nodes[0].send_signal(signal.SIGTERM)
    finish(nodes)  # both nodes end within the bound
