"""The processes of a tensor-parallel engine: rank 0 is the engine itself (scheduler, speculation,
sampling: everything decided once), ranks 1..N-1 are workers it starts that each hold their
slice of the target and its KV cache and compute what rank 0 tells them to.

Each step rank 0 broadcasts the step's inputs (the token runs with their block tables, and the
rows that need logits) and every rank runs the same :class:`ModelRunner` call on its slice; the
model's collectives (an all-reduce after each row-parallel projection, an all-gather of the
logits rows) join them, and rank 0 keeps the logits. Block tables are decided on rank 0 only,
so prefix caching, chunked prefill, preemption and rollback need nothing else: every rank's
cache holds its heads' K/V at the same block ids.

Collectives: on the CPU the model's all-reduces and all-gathers go through a shared-memory
segment every rank maps (``models/shm_collectives.py``), the step's inputs through gloo.

Failure: a worker that exits is seen before the next step's broadcast (its process is
checked), or by the collective it was in (gloo reports the closed connection; the shared-memory
wait checks its peers' processes); either way the step raises :class:`TensorParallelError`
naming it and the engine is down, never hung. Workers die with
their parent (``PR_SET_PDEATHSIG`` on Linux) and on :meth:`TensorParallelGroup.shutdown`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing import connection
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.config import EngineConfig
from specbatch.errors import ConfigError, TensorParallelError
from specbatch.models import load_model, resolve_model_path
from specbatch.models import shm_collectives as shm
from specbatch.parallel.world import (
    BEAT_SECONDS,
    SUSPECT_SECONDS,
    LaunchedWorld,
    RankWatch,
    join,
)
from specbatch.runner.flat_batch import LogitRows, TokenRun
from specbatch.runner.model_runner import ModelRunner

logger = logging.getLogger("specbatch")

START_TIMEOUT_S = 600.0  # loading a shard
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a step; a dead peer is reported at once anyway
COLLECTIVE_SECONDS = COLLECTIVE_TIMEOUT.total_seconds()
# bytes of a rank's shared-memory slot: larger tensors (a long prefill's hidden rows) go in
# chunks of it
SHM_CAPACITY = 4 << 20
# after a failed collective: the longest wait to see a killed worker exit (its address space
# torn down first); 1.0 s missed it once in three suite runs on a loaded 2-core host
# (2026-12-05), and the wait is paid only when a collective has already failed
REAP_SECONDS = 5.0
# the tensor-parallel group of this process (one at a time: torch.distributed's default group)
_active: weakref.ref[TensorParallelGroup] | None = None


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    device = config.resolved_device()
    if device.type == "cuda":
        return torch.device("cuda", rank)
    return device


def threads_per_rank(config: EngineConfig, ranks_on_host: int | None = None) -> int:
    if config.num_threads is not None:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // (ranks_on_host or config.tensor_parallel_size))


class TensorParallelGroup:
    """Rank 0's handle on its workers and the process group."""

    closed: bool

    def __init__(self, config: EngineConfig, world: LaunchedWorld | None = None) -> None:
        """Start the workers (``world`` None), or join the world a launcher started as its
        rank 0 (its workers are the other ranks' processes)."""
        global _active
        running = _active() if _active is not None else None
        if running is not None and not running.closed:
            raise ConfigError(
                "a tensor-parallel engine is already running in this process; shut it down "
                "first (LLMEngine.shutdown)"
            )
        if dist.is_initialized():
            raise ConfigError(
                "torch.distributed is already initialised in this process; a tensor-parallel "
                "engine starts its own process group"
            )
        size = config.tensor_parallel_size
        device = rank_device(config, 0)
        if device.type == "cuda" and world is None and torch.cuda.device_count() < size:
            raise ConfigError(
                f"tensor_parallel_size {size} needs {size} GPUs, found {torch.cuda.device_count()}"
            )
        self.world_size = size
        self.closed = False
        self.running = False  # every worker loaded and bound its cache: in the step loop
        self._processes: list[Any] = []
        self._pipes: list[Connection] = []
        self._watch: RankWatch | None = None
        self._store_path = ""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world is None:
            init = self._spawn(config)
        else:
            store = join(world)
            self._watch = RankWatch(store, world)
            init = {"store": store}
        self._finalizer = weakref.finalize(
            self, _stop, self._processes, self._store_path, self._watch
        )
        dist.init_process_group(
            _backend(device), rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT, **init
        )
        _active = weakref.ref(self)
        if world is None or world.single_host:
            join_shared_memory(0, size, device)

    def _spawn(self, config: EngineConfig) -> dict[str, Any]:
        handle, self._store_path = tempfile.mkstemp(prefix="specbatch-tp-")
        os.close(handle)
        os.unlink(self._store_path)  # the FileStore creates it
        init_method = f"file://{self._store_path}"
        context = mp.get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker_main,
                args=(rank, config, init_method, child),
                name=f"specbatch-tp-{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._processes.append(process)
            self._pipes.append(parent)
        return {"init_method": init_method}

    # ------------------------------------------------------------------ start-up

    def wait_loaded(self) -> None:
        """Wait for every worker's shard; a worker's load error is raised here as its own."""
        if self._watch is not None:
            try:
                statuses = _gather_status(("loaded", ""))
            except (RuntimeError, OSError) as exc:  # a rank died while loading
                try:
                    self.check_after_failure()  # names it, when the watch sees which
                finally:
                    self.shutdown()
                raise TensorParallelError(
                    f"a tensor-parallel rank was lost while loading: {exc}"
                ) from exc
            for rank, (status, message) in enumerate(statuses):
                if status != "loaded":
                    self.shutdown()
                    raise TensorParallelError(f"tensor-parallel rank {rank}: {message}")
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (process, pipe) in enumerate(zip(self._processes, self._pipes, strict=True), 1):
            while not pipe.poll(0.1):
                if not process.is_alive():
                    self.shutdown()
                    raise TensorParallelError(
                        f"tensor-parallel worker {rank} exited while loading "
                        f"(exit code {process.exitcode})"
                    )
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise TensorParallelError(f"tensor-parallel worker {rank} did not load")
            status, message = pipe.recv()
            if status != "loaded":
                self.shutdown()
                raise TensorParallelError(f"tensor-parallel worker {rank}: {message}")

    def bind_cache(self, num_blocks: int) -> None:
        """Every worker allocates the same ``num_blocks`` blocks rank 0 chose."""
        self._send(("cache", num_blocks))
        dist.barrier()
        self.running = True

    # ------------------------------------------------------------------ steps

    def execute(self, runs: Sequence[TokenRun], rows: LogitRows) -> None:
        """Tell every worker to run this step (rank 0 runs it right after)."""
        self._send(("execute", list(runs), rows))

    def move_slots(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Tell every worker to move these cache slots (rank 0 moves them right after)."""
        self._send(("move", list(sources), list(targets)))

    def check(self) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel engine is shut down")
        if self._watch is not None and self._watch.lost is not None:
            raise TensorParallelError(
                f"tensor-parallel {self._watch.lost}; the engine cannot go on without its "
                "slice of the model"
            )
        for rank, process in enumerate(self._processes, 1):
            if not process.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel worker {rank} exited (exit code {process.exitcode}); the "
                    "engine cannot go on without its slice of the model"
                )

    def check_after_failure(self) -> None:
        """``check`` after a collective failed: a killed worker's sockets close before its exit
        can be seen, so wait up to ``REAP_SECONDS`` for one to exit, to name it. A worker whose
        sentinel is ready has closed its files but may not be a zombie yet (``is_alive`` then
        still says alive: CI saw it once a loaded suite run), so it is joined, which waits for
        the exit itself. In a launched world, wait for the watch to name the rank it lost."""
        if self._watch is not None and not self.closed:
            self._watch.wait_lost(SUSPECT_SECONDS + 4 * BEAT_SECONDS)
        elif not self.closed:
            deadline = time.monotonic() + REAP_SECONDS
            by_sentinel = {p.sentinel: p for p in self._processes}
            for sentinel in connection.wait(list(by_sentinel), timeout=REAP_SECONDS):
                by_sentinel[sentinel].join(timeout=max(deadline - time.monotonic(), 0.0))
        self.check()

    def _send(self, command: tuple[Any, ...]) -> None:
        self.check()
        dist.broadcast_object_list([command], src=0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the workers and the process group (idempotent)."""
        global _active
        if self.closed:
            return
        self.closed = True
        if self._watch is not None:
            self._watch.stop()  # the workers stop beating as they stop
        lost = self._watch is not None and self._watch.lost is not None
        if self.running and not lost and all(p.is_alive() for p in self._processes):
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([("stop",)], src=0)
        else:  # not (or no longer) in the step loop: nothing to say to them
            _stop(self._processes, self._store_path, None)
        for process in self._processes:
            process.join(timeout=5)
        shm.set_local(None)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self._finalizer()
        if _active is not None and _active() is self:
            _active = None


def join_shared_memory(rank: int, world: int, device: torch.device) -> None:
    """Every rank of a CPU group maps one shared-memory segment for the model's collectives
    (``models/shm_collectives.py``; gloo's TCP round trips otherwise): rank 0 creates it and
    names it to the others, and removes the name once every rank has mapped it."""
    if device.type != "cpu":
        return
    group = None
    if rank == 0 and shm.available():  # rank 0 decides: no name, every rank stays on gloo
        group = shm.SharedMemoryGroup(
            shm.new_name(), 0, world, SHM_CAPACITY, create=True, timeout=COLLECTIVE_SECONDS
        )
    box: list[Any] = [group.name if group is not None else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return
    if group is None:
        group = shm.SharedMemoryGroup(
            box[0], rank, world, SHM_CAPACITY, create=False, timeout=COLLECTIVE_SECONDS
        )
    dist.barrier()
    group.unlink()
    shm.set_local(group)


def _stop(processes: list[Any], store_path: str, watch: RankWatch | None) -> None:
    if watch is not None:
        watch.stop()
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    if store_path:
        with contextlib.suppress(OSError):
            os.unlink(store_path)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _gather_status(status: tuple[str, str]) -> list[tuple[str, str]]:
    """Every rank's ("loaded" | "error", message) after loading its shard."""
    statuses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, status)
    return statuses


class TensorParallelRunner:
    """Rank 0's model runner: each step goes to the workers, then runs here."""

    def __init__(self, local: ModelRunner, group: TensorParallelGroup) -> None:
        self.local = local
        self.group = group
        self.model = local.model
        self.graphs = None
        self.block_size = local.block_size
        self.device = local.device

    @property
    def keep_hidden(self) -> bool:
        return self.local.keep_hidden

    @keep_hidden.setter
    def keep_hidden(self, value: bool) -> None:
        self.local.keep_hidden = value  # rank 0 holds the whole hidden state after each layer

    @property
    def hidden(self) -> tuple[torch.Tensor, np.ndarray] | None:
        return self.local.hidden

    def execute(self, runs: Sequence[TokenRun], rows: LogitRows) -> torch.Tensor:
        try:
            self.group.execute(runs, rows)
            return self.local.execute(runs, rows)
        except (TensorParallelError, RuntimeError, OSError) as exc:
            self._failed(exc)
            raise

    def move_slots(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        try:
            self.group.move_slots(sources, targets)
            self.local.move_slots(sources, targets)
        except (TensorParallelError, RuntimeError, OSError) as exc:
            self._failed(exc)
            raise

    def _failed(self, exc: BaseException) -> None:
        """After a failed step: raise a dead worker named with its exit code when it is one
        (gloo saw a closed connection, or the shared-memory wait saw the worker's process
        gone), else a collective's error as a ``TensorParallelError`` (one of those returns)."""
        self.group.check_after_failure()
        if not isinstance(exc, TensorParallelError):
            raise TensorParallelError(f"a tensor-parallel collective failed: {exc}") from exc


# ---------------------------------------------------------------------- the worker


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def _worker_main(rank: int, config: EngineConfig, init_method: str, pipe: Connection) -> None:
    die_with_parent()
    torch.set_num_threads(threads_per_rank(config))
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        _backend(device),
        init_method=init_method,
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        join_shared_memory(rank, config.tensor_parallel_size, device)
        model, dtype = _load_shard(config, rank, device)
    except Exception as exc:
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        traceback.print_exc()
        return
    pipe.send(("loaded", ""))
    try:
        _serve_steps(model, config, dtype, device)
    except (TensorParallelError, RuntimeError, OSError) as exc:
        # a peer is gone (rank 0 names it to the user): one line, not a traceback per worker
        print(f"specbatch tensor-parallel worker {rank} stopped: {exc}", file=sys.stderr)
    shm.set_local(None)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_launched_worker(config: EngineConfig, world: LaunchedWorld) -> NoReturn:
    """Rank ``world.rank`` (not 0) of a world a launcher started: join it, load this rank's
    slice, run what rank 0 broadcasts until it says stop, then end the process (``SystemExit``
    0; 1 after a lost peer, named on one line of stderr). A load error is told to rank 0 (which
    raises it as this rank's) and raised here too."""
    torch.set_num_threads(threads_per_rank(config, world.local_size))
    device = rank_device(config, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = join(world)
    watch = RankWatch(store, world, on_lost=_exit_lost(world.rank))
    dist.init_process_group(
        _backend(device),
        store=store,
        rank=world.rank,
        world_size=world.size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    code = 1
    try:
        if world.single_host:
            join_shared_memory(world.rank, world.size, device)
        try:
            model, dtype = _load_shard(config, world.rank, device)
        except Exception as exc:
            _gather_status(("error", f"{type(exc).__name__}: {exc}"))
            raise
        _gather_status(("loaded", ""))
        _serve_steps(model, config, dtype, device, on_stop=watch.stop)
        code = 0
    except (TensorParallelError, RuntimeError, OSError) as exc:
        lost = watch.wait_lost(SUSPECT_SECONDS + 4 * BEAT_SECONDS)
        print(
            f"specbatch tensor-parallel rank {world.rank} stopped: {lost or exc}", file=sys.stderr
        )
    finally:
        watch.stop()
        shm.set_local(None)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    raise SystemExit(code)


def _exit_lost(rank: int) -> Callable[[str], None]:
    """A worker whose peer is lost while it waits inside a collective: nothing else would end
    the wait before the collective's timeout."""

    def lost(why: str) -> None:
        print(f"specbatch tensor-parallel rank {rank} stopped: {why}", file=sys.stderr, flush=True)
        os._exit(1)

    return lost


def _load_shard(config: EngineConfig, rank: int, device: torch.device) -> tuple[Any, torch.dtype]:
    dtype = config.resolved_dtype(device)
    model = load_model(
        resolve_model_path(config.model),
        dtype,
        device,
        config.attention_backend,
        shard=(rank, config.tensor_parallel_size),
    )
    if config.cpu_weight_packing:
        model.pack_for_cpu()
    return model, dtype


def _serve_steps(
    model: Any,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """A worker's loop: what rank 0 broadcasts, until it says stop."""
    runner: ModelRunner | None = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command[0] == "stop":
            if on_stop is not None:
                on_stop()
            return
        if command[0] == "cache":
            model.bind_kv_caches(
                allocate_kv_caches(model.local_config, command[1], config.block_size, dtype, device)
            )
            runner = ModelRunner(model, config.block_size)
            dist.barrier()
        elif command[0] == "execute":
            assert runner is not None
            runner.execute(command[1], command[2])
        elif command[0] == "move":
            assert runner is not None
            runner.move_slots(command[1], command[2])
