"""Batch jobs over a Ray cluster (``specbatch run-batch --ray``; ``pip install 'specbatch[ray]'``).

The driver (this process) reads the input as ``run-batch`` does: it answers the lines that are
not requests (not JSON, no ``custom_id``, a repeated one) itself, skips what the output already
answers, and gives the rest to a Ray Dataset mapped through a pool of actors, each holding one
engine (tensor-parallel inside when the config says so): ``map_batches`` with a callable class,
``concurrency`` replicas. Each actor answers its batch with the same code as ``run-batch``
(:meth:`BatchJob.answer`: the same request models, the same error lines) and returns the result
lines; the driver appends each to the output as its batch comes back, one ``write`` per line,
and never writes a ``custom_id`` twice. So the output is resumable exactly as ``run-batch``'s: a
killed driver's rerun cuts a partial last line and skips what is there.

A replica that dies is replaced by Ray Data (actors restart, ``max_restarts=-1``) and its batch
is run again on a live one (``max_task_retries=-1``); its lines were not written, so nothing
appears twice. A batch that raises inside the engine answers its unanswered lines with a 500
line, so one bad line never stops the job.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from specbatch.batch.job import (
    BatchJob,
    BatchSummary,
    _read_done,
    error_record,
    read_lines,
    write_record,
)
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError, TensorParallelError
from specbatch.server.formatting import error_body
from specbatch.utils import ceil_div

logger = logging.getLogger("specbatch")


@dataclass(frozen=True)
class RayBatchSettings:
    """``replicas`` engines (actors) of ``cpus_per_replica`` CPUs each (default: the cluster's
    CPUs shared out); ``batch_size`` lines per actor call (default: twice the engine's
    ``max_num_seqs``, what ``run-batch`` keeps queued); ``address``: a running cluster's (else
    ``RAY_ADDRESS``, else a local one is started)."""

    replicas: int = 2
    cpus_per_replica: float | None = None
    batch_size: int | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"replicas must be a positive integer, got {self.replicas!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.cpus_per_replica is not None and self.cpus_per_replica <= 0:
            raise ConfigError(f"cpus_per_replica must be positive, got {self.cpus_per_replica}")


def import_ray() -> Any:
    try:
        import ray
        import ray.data
    except ImportError:
        raise ConfigError("run-batch --ray needs Ray: pip install 'specbatch[ray]'") from None
    return ray


class EngineReplica:
    """A Ray Data actor: one engine answering batches of ``(number, line)`` rows."""

    def __init__(self, config: EngineConfig, model_name: str) -> None:
        from specbatch.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config)
        self.job = BatchJob(self.engine, model_name, progress=False)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        numbers = batch["number"] if "number" in batch else np.zeros(len(batch["line"]), int)
        lines = [
            (int(number), str(text).encode())
            for number, text in zip(numbers, batch["line"], strict=True)
        ]
        records: list[dict[str, Any]] = []
        try:
            self.job.answer(lines, records)
        except Exception as exc:  # the engine failed outside its own handling
            if self.engine.dead is not None or isinstance(exc, TensorParallelError):
                # this engine cannot go on: end the actor, so Ray replaces it and runs the
                # batch again on a live one (its lines are not written meanwhile)
                logger.error("the replica's engine is down: %s", exc)
                os._exit(1)
            logger.exception("a batch failed")
            answered = {r.get("custom_id") for r in records}
            records += [
                _failed_record(number, text, exc)
                for number, text in lines
                if json.loads(text).get("custom_id") not in answered
            ]
        return {"record": np.array([json.dumps(r) for r in records], dtype=object)}


def _failed_record(number: int, raw: bytes, exc: Exception) -> dict[str, Any]:
    custom_id = json.loads(raw).get("custom_id")
    body = error_body(500, f"generation failed: {exc!r}", None, "engine_step_failed")
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 500, "request_id": f"line-{number}", "body": body},
        "error": None,
    }


def run_on_ray(
    config: EngineConfig,
    input_path: Path | str,
    output_path: Path | str,
    model_name: str,
    settings: RayBatchSettings | None = None,
    progress: bool = True,
) -> BatchSummary:
    """Run the input file through ``settings.replicas`` engines on Ray into the output file
    (resumable), as ``specbatch run-batch --ray`` does."""
    settings = settings or RayBatchSettings()
    ray = import_ray()
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise ConfigError(f"input file {input_path} does not exist")
    if output_path.resolve() == input_path.resolve():
        raise ConfigError("the output file must not be the input file")
    done_ids, done_lines, _ = _read_done(output_path)
    summary = BatchSummary()
    started = time.monotonic()
    fd = os.open(output_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    written: set[str | None] = set()
    try:
        rows = list(_rows(input_path, done_ids, done_lines, summary, fd))
        bar = tqdm(total=summary.lines, unit="line", disable=not progress, dynamic_ncols=True)
        bar.update(summary.skipped + summary.failed)
        try:
            for records in _mapped(ray, config, model_name, settings, rows):
                for record in records:
                    custom_id = record.get("custom_id")
                    if custom_id in written:  # a retried batch's twin: never twice
                        continue
                    written.add(custom_id)
                    write_record(fd, record)
                    _count(record, summary)
                elapsed = time.monotonic() - started
                bar.n = summary.skipped + summary.succeeded + summary.failed
                bar.set_postfix(
                    tok_s=f"{summary.completion_tokens / max(elapsed, 1e-9):.0f}", refresh=False
                )
                bar.refresh()
        finally:
            bar.close()
    finally:
        os.close(fd)
    summary.seconds = time.monotonic() - started
    return summary


def _rows(
    path: Path, done_ids: set[str], done_lines: set[int], summary: BatchSummary, fd: int
) -> Iterator[dict[str, Any]]:
    """The lines for the replicas; the lines that are not requests answered here."""
    for item in read_lines(path):
        summary.lines += 1
        if item.reject is not None:
            if item.number in done_lines:
                summary.skipped += 1
            else:
                summary.failed += 1
                write_record(fd, error_record(item.custom_id, item.number, item.reject))
        elif item.custom_id in done_ids:
            summary.skipped += 1
        else:
            yield {"number": item.number, "line": item.raw.decode("utf-8").rstrip("\n")}


def map_requests(
    dataset: Any,
    config: EngineConfig,
    model_name: str,
    settings: RayBatchSettings | None = None,
    whole_blocks: bool = False,
) -> Any:
    """A Ray Dataset of result lines for a Ray Dataset of request lines: each input row has
    ``line`` (the JSON text of one batch request line, as in a ``run-batch`` file) and
    optionally ``number`` (its line number, for error lines; else 0); each output row has
    ``record``, the JSON text of its result line, exactly as ``run-batch`` writes it. The rows
    go through an actor pool of ``settings.replicas`` engines (Ray Data ``map_batches``); the
    caller decides what to do with the results (``run_on_ray`` writes them to a file). Repeated
    ``custom_id``s and resuming are the caller's: every row is answered. ``whole_blocks``: each
    of the dataset's blocks is one batch (the caller sized them), else ``settings.batch_size``
    rows (default twice ``max_num_seqs``)."""
    ray = import_ray()
    settings = settings or RayBatchSettings()
    for name in ("ray.data", "ray"):  # its start-up and progress notes
        logging.getLogger(name).setLevel(logging.ERROR)
    if not ray.is_initialized():
        address = settings.address or os.environ.get("RAY_ADDRESS")
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=False,
        )
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # run_on_ray's own bar counts lines
    cpus = settings.cpus_per_replica
    if cpus is None:
        cpus = max(1.0, float(ray.cluster_resources().get("CPU", 1)) // settings.replicas)
    threads = config.num_threads or max(1, int(cpus) // config.tensor_parallel_size)
    return dataset.map_batches(
        EngineReplica,
        fn_constructor_args=(replace(config, num_threads=threads), model_name),
        batch_size=None if whole_blocks else settings.batch_size or 2 * config.max_num_seqs,
        concurrency=settings.replicas,
        num_cpus=cpus,
        batch_format="numpy",
    )


def _mapped(
    ray: Any,
    config: EngineConfig,
    model_name: str,
    settings: RayBatchSettings,
    rows: list[dict[str, Any]],
) -> Iterator[list[dict[str, Any]]]:
    """The replicas' result records, batch by batch as they finish."""
    if not rows:
        return
    # Blocks are the batches, as many per replica (about ``batch_size`` lines each): batches
    # cut from blocks of other sizes left 2-line remainders that a replica ran alone (0.7 s
    # each, 4 per replica on 1,000 lines), and 8 batches over 2 replicas, not 7.7, end
    # together (one replica idled 6 s at the end); measured 2026-12-06, scale_out.py --parts ray
    per = settings.batch_size or 2 * config.max_num_seqs
    batches = settings.replicas * ceil_div(len(rows), settings.replicas * per)
    blocks = ray.data.from_items(rows, override_num_blocks=min(batches, len(rows)))
    dataset = map_requests(blocks, config, model_name, settings, whole_blocks=True)
    for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
        yield [json.loads(text) for text in batch["record"]]


def _count(record: dict[str, Any], summary: BatchSummary) -> None:
    response = record.get("response")
    if response is None or response.get("status_code") != 200:
        summary.failed += 1
        return
    summary.succeeded += 1
    usage = response["body"].get("usage") or {}
    summary.prompt_tokens += usage.get("prompt_tokens", 0)
    summary.completion_tokens += usage.get("completion_tokens", 0)
