"""``DataParallelEngine``: N engine processes (replicas, each its own share of the cores or its
own GPU) behind one asyncio front with :class:`AsyncEngine`'s interface, so the server runs on
it unchanged (``specbatch serve --data-parallel-size N``).

The front tokenizes (the replicas get token ids), routes each request and relays its outputs.
Each replica process runs an ``AsyncEngine`` and talks to the front over one pipe: the front
sends ``add``/``abort``/``drain``/``stop``, the replica answers ``accepted``/``refused`` per add,
streams each request's outputs, and reports its stats every ``STATS_SECONDS``.

Routing: the replica with the fewest requests in flight; among those equally loaded, the one
that holds the longest prefix of the prompt's full blocks in its cache. The front remembers the
block-hash chains of the prompts it sent each replica (as many blocks as the replica's cache
has, least recently sent first out), which is what the replica's prefix cache holds unless it
evicted them since: a stale entry costs a prefill, never a wrong answer.

A replica that dies (killed, or a fatal engine error) ends its in-flight requests with
:class:`EngineDeadError` (the server sends an error event or a 503), is started again, and
takes requests once loaded; the others serve meanwhile. A replica that fails to load at a
restart stays down (logged); when none is left the engine is errored (``/health``: 503).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing as mp

from specbatch.config import EngineConfig
from specbatch.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    RequestFailedError,
    RequestStream,
    _Abort,
    _Stream,
    prompt_ids,
)
from specbatch.engine.intake import RequestIntake
from specbatch.engine.stats import EngineStats
from specbatch.errors import ConfigError, InvalidRequestError
from specbatch.models import resolve_model_path
from specbatch.outputs import RequestOutput
from specbatch.parallel.world import launched_world
from specbatch.sampling_params import SamplingParams
from specbatch.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("specbatch")

STATS_SECONDS = 0.5  # how often a replica reports its stats (/metrics reads the latest)
LOAD_SECONDS = 600.0  # a replica's model load


@dataclass(frozen=True)
class ReplicaInfo:
    """What a loaded replica tells the front."""

    num_kv_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    model_path: str


def replica_config(config: EngineConfig, size: int) -> EngineConfig:
    """Each replica's config: its share of the host's cores unless ``num_threads`` is set."""
    if config.num_threads is not None or config.resolved_device().type == "cuda":
        return config
    return replace(config, num_threads=max(1, (os.cpu_count() or 1) // size))


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks (a hash names a block and all before)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class Replica:
    """The front's handle on one replica process."""

    def __init__(self, index: int, config: EngineConfig, owner: DataParallelEngine) -> None:
        self.index = index
        self.config = config
        self.owner = weakref.proxy(owner)  # the engine's finalizer must not wait on its replicas
        self.owner_lock = owner._lock
        self.gpu: str | None = None  # the CUDA device it gets (an entry of the front's list)
        self.info: ReplicaInfo | None = None
        self.up = False  # loaded, taking requests
        self.failed: str | None = None  # could not be (re)started: stays down
        self.restarts = 0
        self.stopping = False  # asked to stop: its exit is not a death
        self.stats = EngineStats()
        self.in_flight: set[str] = set()
        self.prefixes: OrderedDict[int, None] = OrderedDict()  # block hashes sent here
        self._adds: dict[str, Future[None]] = {}
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self.process: Any = None
        self.conn: Connection | None = None

    # ------------------------------------------------------------------ process

    def start(self) -> None:
        context = mp.get_context("spawn")
        parent, child = context.Pipe()
        self.process = context.Process(
            target=_replica_main,
            args=(self.config, self.gpu, child),
            name=f"specbatch-dp-{self.index}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.conn = parent
        self._ready.clear()
        threading.Thread(
            target=self._read,
            args=(parent, self.process),
            name=f"specbatch-dp-{self.index}-read",
            daemon=True,
        ).start()

    def wait_ready(self, timeout: float = LOAD_SECONDS) -> None:
        if not self._ready.wait(timeout):
            self.failed = f"replica {self.index} did not load within {timeout:.0f} s"
        if self.failed is not None or not self.up:
            raise ConfigError(self.failed or f"replica {self.index} exited while loading")

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def send(self, message: tuple[Any, ...]) -> None:
        assert self.conn is not None
        with self._send_lock:
            self.conn.send(message)

    # ------------------------------------------------------------------ the reader thread

    def _read(self, conn: Connection, process: Any) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._handle(message)
            except Exception:
                logger.exception("replica %d: a message could not be handled", self.index)
        with self.owner_lock:  # no request is routed here from now on
            was_up, self.up = self.up, False
        process.join(timeout=5)
        self._died(process.exitcode, was_up)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            output: RequestOutput = message[2]
            self.owner._deliver(output.request_id, output)
            if output.finished:
                self.in_flight.discard(output.request_id)
                self.owner._notify_finished(output)
        elif kind == "error":
            self.in_flight.discard(message[1])
            self.owner._deliver(message[1], _error(message[2], message[3], message[4]))
        elif kind == "accepted":
            self._resolve(message[1], None)
        elif kind == "refused":
            self.in_flight.discard(message[1])
            self._resolve(message[1], _error(message[2], message[3], message[4]))
        elif kind == "stats":
            self.stats = message[1]
        elif kind == "ready":
            self.info = message[1]
            self.up = True
            self._ready.set()
        elif kind == "load_error":
            self.failed = f"replica {self.index} failed to load: {message[1]}"
            self._ready.set()

    def _resolve(self, request_id: str, error: BaseException | None) -> None:
        future = self._adds.pop(request_id, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _died(self, exit_code: int | None, was_up: bool) -> None:
        """The process is gone: fail what it held, start it again unless stopping."""
        if not was_up and self.failed is None:
            self.failed = f"replica {self.index} exited while loading (exit code {exit_code})"
        self._ready.set()
        if _exiting:
            return
        error = EngineDeadError(
            f"data-parallel replica {self.index} died (exit code {exit_code}); its requests "
            "were lost: retry"
        )
        with self.owner_lock:  # what _add registered before `up` went down, all of it
            adds, self._adds = list(self._adds.values()), {}
            lost, self.in_flight = list(self.in_flight), set()
            self.prefixes.clear()
        for future in adds:
            if not future.done():
                future.set_exception(error)
        for request_id in lost:
            self.owner._deliver(request_id, error)
        try:
            ending = _exiting or self.stopping or self.owner.stopping or self.owner._draining
        except ReferenceError:  # the engine was collected: its finalizer ends the replicas
            ending = True
        if ending or self.failed is not None:
            return
        logger.error("%s; starting it again", error)
        self.restarts += 1
        self.stats = EngineStats()
        self.start()

    @property
    def waiting(self) -> int:
        """Its requests not running yet (as of its last stats report)."""
        return max(0, len(self.in_flight) - self.stats.num_running)

    # ------------------------------------------------------------------ routing

    def held_prefix(self, hashes: list[int]) -> int:
        """How many of the prompt's leading blocks this replica was sent before."""
        held = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            held += 1
        return held

    def remember(self, hashes: list[int]) -> None:
        capacity = self.info.num_kv_blocks if self.info is not None else 0
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > capacity:
            self.prefixes.popitem(last=False)


def _report(error: BaseException) -> tuple[str, str, str | None]:
    """A replica's exception as it crosses the pipe (``_error`` rebuilds it): a ValueError is
    the request's fault, a 400 as on one engine."""
    kind = type(error).__name__
    if isinstance(error, ValueError):
        kind = "InvalidRequestError"
    return kind, str(error), getattr(error, "param", None)


def _error(kind: str, message: str, param: str | None) -> BaseException:
    """An exception a replica reported, as the front's own class."""
    if kind == "InvalidRequestError":
        return InvalidRequestError(message, param)
    if kind == "EngineDrainingError":
        return EngineDrainingError(message)
    if kind == "EngineDeadError":
        return EngineDeadError(message)
    return RequestFailedError(message)


class DataParallelEngine:
    """``size`` replicas of the engine of ``config`` behind :class:`AsyncEngine`'s interface."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"data_parallel_size must be a positive integer, got {size!r}")
        if config.tensor_parallel_size > 1:
            raise ConfigError(
                "data parallelism with tensor_parallel_size > 1 is not supported: run one "
                "server per tensor-parallel group"
            )
        if launched_world() is not None:
            raise ConfigError("data parallelism does not run under torchrun; start it directly")
        self.config = config
        self.size = size
        self.stopping = False
        self.on_finished: list[Callable[[RequestOutput], None]] = []
        self._streams: dict[str, tuple[_Stream, Replica]] = {}
        self._lock = threading.Lock()
        self._draining = False
        self._adding = 0
        self._ids = itertools.count()
        self.replicas = [Replica(i, replica_config(config, size), self) for i in range(size)]
        if config.resolved_device().type == "cuda":
            import torch

            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = (
                visible.split(",")
                if visible
                else [str(i) for i in range(torch.cuda.device_count())]
            )
            if len(gpus) < size:
                raise ConfigError(
                    f"data_parallel_size {size} needs {size} GPUs, {len(gpus)} visible"
                )
            for replica, gpu in zip(self.replicas, gpus, strict=False):
                replica.gpu = gpu
        for replica in self.replicas:
            replica.start()
        self._finalizer = weakref.finalize(self, _stop_processes, self.replicas)
        try:
            for replica in self.replicas:
                replica.wait_ready()
        except BaseException:
            self.stopping = True
            self._finalizer()
            raise
        info = self.replicas[0].info
        assert info is not None
        self.info = info
        self.tokenizer: Tokenizer = load_tokenizer(
            config.tokenizer or resolve_model_path(config.model)
        )
        self.intake = RequestIntake(
            self.tokenizer, info.vocab_size, info.max_model_len, config.structured_outputs_backend
        )

    # ------------------------------------------------------------------ AsyncEngine's interface

    @property
    def errored(self) -> bool:
        return all(r.failed is not None for r in self.replicas)

    @property
    def accepting(self) -> bool:
        return not (self._draining or self.stopping) and any(r.up for r in self.replicas)

    def start(self) -> None:
        """The replicas run from construction."""

    def num_waiting(self) -> int:
        """Requests not yet running in their replica (their replica's last report), plus
        those being added."""
        with self._lock:
            adding = self._adding
        return adding + sum(r.waiting for r in self.replicas if r.up)

    def stats_by_replica(self) -> list[tuple[str | None, EngineStats, int]]:
        """Each replica's stats and waiting count, then their sum (``replica="all"``)."""
        rows: list[tuple[str | None, EngineStats, int]] = [
            (str(r.index), r.stats, r.waiting) for r in self.replicas
        ]
        total = EngineStats.combined([s for _, s, _ in rows])
        return [*rows, ("all", total, sum(w for _, _, w in rows))]

    async def add_request(
        self,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """As :meth:`AsyncEngine.add_request`, on the replica the request is routed to."""
        self._check_alive()
        counted = [True]  # in _adding until it is in a replica's in_flight (counted there)
        with self._lock:
            self._adding += 1
        try:
            return await self._add(request_id, prompt, params, prompt_token_ids, priority, counted)
        finally:
            with self._lock:
                if counted[0]:
                    self._adding -= 1

    async def _add(
        self,
        request_id: str | None,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None,
        prompt_token_ids: Sequence[int] | None,
        priority: int,
        counted: list[bool],
    ) -> RequestStream:
        request_id = request_id or f"req-{next(self._ids)}"
        params = params or SamplingParams()
        _, token_ids = await prompt_ids(self.intake, prompt, prompt_token_ids)
        if token_ids is None:
            raise InvalidRequestError("a prompt (text or token ids) is required", "prompt")
        ids = list(token_ids)
        stream = _Stream(asyncio.get_running_loop())
        done: Future[None] = Future()
        with self._lock:
            self._check_alive()
            if request_id in self._streams:
                raise InvalidRequestError(
                    f"request_id {request_id!r} is already in use", "request_id"
                )
            hashes = prefix_hashes(ids, self.info.block_size)
            replica = self._route(hashes)
            self._streams[request_id] = (stream, replica)
            replica.in_flight.add(request_id)
            replica._adds[request_id] = done
            replica.remember(hashes)
            counted[0] = False
            self._adding -= 1
        try:
            replica.send(("add", request_id, ids, params, priority))
        except (OSError, ValueError) as exc:  # the pipe is gone: the replica is dying
            replica._resolve(request_id, EngineDeadError(f"replica {replica.index}: {exc}"))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            refused = done.done() and not done.cancelled() and done.exception() is not None
            self._forget_stream(request_id)
            if not refused:
                self._send(_Abort(request_id))
            replica.in_flight.discard(request_id)
            raise
        return RequestStream(self, request_id, stream)

    def _route(self, hashes: list[int]) -> Replica:
        """The least-loaded replica that is up; among those, the longest held prefix."""
        live = [r for r in self.replicas if r.up]
        if not live:
            raise EngineDeadError("no data-parallel replica is up (restarting); retry")
        return min(live, key=lambda r: (len(r.in_flight), -r.held_prefix(hashes), r.index))

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        options: dict[str, Any] | None = None,
    ) -> list[int]:
        """As :meth:`AsyncEngine.encode_chat` (the front holds the tokenizer)."""

        def encode() -> list[int]:
            self.intake.check_length(
                sum(len(str(m.get("content") or "")) for m in messages), "messages"
            )
            _, ids = self.tokenizer.encode_chat(messages, add_generation_prompt, **(options or {}))
            return ids

        return await asyncio.to_thread(encode)

    async def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def drain(self, timeout: float) -> None:
        """As :meth:`AsyncEngine.drain`, over every replica."""
        with self._lock:
            self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._busy() and loop.time() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        with self._lock:
            pending = list(self._streams.items())
        for request_id, (stream, replica) in pending:
            stream.put(EngineDrainingError("the server is shutting down"))
            self._forget_stream(request_id)
            with contextlib.suppress(OSError, ValueError, AssertionError):
                replica.send(("abort", request_id))

    async def shutdown(self, timeout: float = 5.0) -> None:
        await self.drain(timeout)
        self.stopping = True
        await asyncio.to_thread(self._finalizer)

    # ------------------------------------------------------------------ streams

    def _busy(self) -> bool:
        with self._lock:
            return bool(self._streams) or self._adding > 0

    def _check_alive(self) -> None:
        if self.stopping:
            raise EngineDeadError("the engine is shut down")
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        if self.errored:
            raise EngineDeadError(
                "every data-parallel replica failed: "
                + "; ".join(r.failed or "" for r in self.replicas)
            )

    def _forget_stream(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _send(self, command: _Abort) -> None:
        """A stream closed early (or a drain): abort it on its replica."""
        with self._lock:
            entry = self._streams.pop(command.request_id, None)
        if entry is None:
            for replica in self.replicas:  # closed after its stream was forgotten
                if command.request_id in replica.in_flight:
                    entry = (None, replica)  # type: ignore[assignment]
        if entry is not None:
            with contextlib.suppress(OSError, ValueError, AssertionError):
                entry[1].send(("abort", command.request_id))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is not None:
            entry[0].put(item)

    def _notify_finished(self, output: RequestOutput) -> None:
        for callback in self.on_finished:
            try:
                callback(output)
            except Exception:
                logger.exception("a finished-request callback failed")


def _stop_processes(replicas: list[Replica]) -> None:
    """Ask every replica to stop; kill those still running after 10 s."""
    for replica in replicas:
        replica.stopping = True
        with contextlib.suppress(OSError, ValueError, AssertionError):
            replica.send(("stop",))
    deadline = time.monotonic() + 10
    for replica in replicas:
        if replica.process is None:
            continue
        replica.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if replica.process.is_alive():
            replica.process.kill()
            replica.process.join(timeout=5)


_exiting = False  # the interpreter is exiting: a replica ending now is not restarted


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True


# ---------------------------------------------------------------------- the replica process


def _replica_main(config: EngineConfig, gpu: str | None, conn: Connection) -> None:
    from specbatch.parallel.workers import die_with_parent

    die_with_parent()
    # a terminal's Ctrl-C reaches the whole process group: the front ends the replicas
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before CUDA starts in this process
    from specbatch.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except Exception as exc:
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(
        (
            "ready",
            ReplicaInfo(
                engine.num_kv_blocks,
                config.block_size,
                engine.model.config.vocab_size,
                engine.max_model_len,
                str(engine.model_path),
            ),
        )
    )
    try:
        asyncio.run(_serve_replica(AsyncEngine(engine=engine), conn))
    finally:
        engine.shutdown()


async def _serve_replica(served: AsyncEngine, conn: Connection) -> None:
    """Commands from the front in, outputs and stats out (sent from this loop only)."""
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()
    streams: dict[str, RequestStream] = {}
    adding: set[str] = set()  # adds received, not yet taken or refused by the engine
    aborted: set[str] = set()  # ... of which the front aborted these meanwhile
    tasks: set[asyncio.Task[None]] = set()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the front is gone
                loop.call_soon_threadsafe(commands.put_nowait, None)
                return
            loop.call_soon_threadsafe(commands.put_nowait, message)

    threading.Thread(target=read, name="specbatch-dp-commands", daemon=True).start()

    async def run(request_id: str, ids: list[int], params: SamplingParams, priority: int) -> None:
        try:
            stream = await served.add_request(
                None, params, request_id, prompt_token_ids=ids, priority=priority
            )
        except Exception as exc:
            adding.discard(request_id)
            aborted.discard(request_id)
            conn.send(("refused", request_id, *_report(exc)))
            return
        adding.discard(request_id)
        streams[request_id] = stream
        conn.send(("accepted", request_id))
        if request_id in aborted:
            aborted.discard(request_id)
            await served.abort(request_id)
        try:
            async for output in stream:
                conn.send(("out", request_id, output))
        except Exception as exc:
            conn.send(("error", request_id, *_report(exc)))
        finally:
            streams.pop(request_id, None)

    async def stats() -> None:
        while True:
            conn.send(("stats", served.engine.stats))
            await asyncio.sleep(STATS_SECONDS)

    reporter = asyncio.ensure_future(stats())
    try:
        while True:
            message = await commands.get()
            if message is None or message[0] == "stop":
                break
            if message[0] == "add":
                adding.add(message[1])
                task = asyncio.ensure_future(run(*message[1:]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif message[0] == "abort":
                # the engine ends it with a final output, which goes back as its last "out"
                # (the front counts it done); one not yet added is aborted once it is
                if message[1] in streams:
                    await served.abort(message[1])
                elif message[1] in adding:
                    aborted.add(message[1])
            if served.errored:  # the engine's loop is dead: this replica is no use
                break
    finally:
        reporter.cancel()
        await served.shutdown(1.0)
    if served.errored:
        print("specbatch data-parallel replica: its engine stopped", file=sys.stderr)
        os._exit(1)
