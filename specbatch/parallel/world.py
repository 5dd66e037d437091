"""A world another program started: ``torchrun`` (or any launcher that sets torch.distributed's
``env://`` variables: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and
``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` per host) runs the same program on every rank, on one host
or several. Rank 0 builds the engine and its front end; every other rank, on reaching the
engine's constructor, runs the worker loop instead and exits with it (``parallel/workers.py``).

Joining: each rank connects to the rendezvous store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's
agent hosts it; without torchrun, rank 0 does), writes who it is and counts itself in; a rank
missing after ``JOIN_SECONDS`` is named on every rank that arrived. Then the process group
(gloo on the CPU, NCCL on CUDA) forms over the same store.

Watching: every rank beats a counter in the store every ``BEAT_SECONDS`` and reads the others'
(:class:`RankWatch`). A rank whose counter stops for ``STALE_SECONDS``, or a store that stops
answering, is lost: a worker prints one line naming it and exits; rank 0 names it in the error
that ends the engine. A killed process is usually seen sooner, by the collective it leaves (its
sockets close); the watch then names it. The collectives are unauthenticated: bind the master
address to a private interface.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from specbatch.errors import ConfigError, TensorParallelError

# every rank's arrival at the store; a peer not there by then is named (torchrun's own
# rendezvous has usually gathered the nodes already)
JOIN_SECONDS = 300.0
BEAT_SECONDS = 0.5
# a rank whose beat has not moved for this long is lost; a starved thread on a loaded 2-core
# host has not missed 1 s of beats in the suite, so 10 s leaves room, and the wait is paid only
# by a rank that already failed a collective (to name the peer) or a peer that really stopped
STALE_SECONDS = 10.0
# once a collective has failed, some peer is gone: four missed beats name it
SUSPECT_SECONDS = 4 * BEAT_SECONDS


@dataclass(frozen=True)
class LaunchedWorld:
    """This process's place in a world a launcher started."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    master: str  # host:port of the rendezvous store
    attempt: int = 0  # torchrun's restart count: keys of an earlier attempt are not read

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchedWorld | None:
        """The world the environment describes, or None when no launcher set one (or it has
        one process)."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env or "RANK" not in env:
            return None
        size, rank = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK")
        if size <= 1:
            return None
        if not 0 <= rank < size:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={size}")
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={size} but {' and '.join(missing)} not set: start the ranks with "
                "torchrun (--master-addr/--master-port, or --rdzv-endpoint)"
            )
        port = _env_int(env, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT={port} is not a port")
        # set by hand without the local variables: one rank per host
        local_size = _env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1
        local_rank = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        attempt = _env_int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        return cls(rank, size, local_rank, local_size, f"{env['MASTER_ADDR']}:{port}", attempt)

    @property
    def single_host(self) -> bool:
        """Every rank on this host (their collectives can go through shared memory)."""
        return self.local_size == self.size


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value or "")
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def launched_world() -> LaunchedWorld | None:
    return LaunchedWorld.from_env()


def ranks_on_this_host(tensor_parallel_size: int) -> int:
    """How many ranks share this host's cores."""
    world = launched_world()
    return world.local_size if world is not None else tensor_parallel_size


def check_world(tensor_parallel_size: int, world: LaunchedWorld | None) -> None:
    """A launched world is the tensor-parallel group: its size must be the one asked for."""
    if world is not None and world.size != tensor_parallel_size:
        raise ConfigError(
            f"the launcher started {world.size} processes (WORLD_SIZE) but "
            f"tensor_parallel_size is {tensor_parallel_size}: pass --tensor-parallel-size "
            f"{world.size} (or start {tensor_parallel_size} processes)"
        )


def join(world: LaunchedWorld, timeout: float = JOIN_SECONDS) -> dist.Store:
    """Connect to the rendezvous store and wait for every rank (``TensorParallelError``
    naming the ranks that did not come within ``timeout`` seconds). Returns the store the
    process group forms over; :func:`watch_store` is this run's part of it for the watch."""
    host, port = world.master.rsplit(":", 1)
    # under torchrun its agent on node 0 hosts the store; else rank 0 does
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(
            host,
            int(port),
            world.size,
            is_master=world.rank == 0 and not hosted_by_agent,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,  # the arrivals below name who is missing
            multi_tenant=True,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise TensorParallelError(
            f"tensor-parallel rank {world.rank}: no rendezvous store at {world.master} "
            f"within {timeout:.0f} s ({exc}); start every rank with the same master address "
            "and port"
        ) from exc
    ours = watch_store(store, world)
    ours.set(f"who/{world.rank}", f"{socket.gethostname()} pid {os.getpid()}")
    ours.set(f"beat/{world.rank}", "0")
    ours.add("arrived", 1)
    deadline = time.monotonic() + timeout
    while ours.add("arrived", 0) < world.size:
        if time.monotonic() > deadline:
            missing = [r for r in range(world.size) if not ours.check([f"who/{r}"])]
            raise TensorParallelError(
                f"tensor-parallel rank {world.rank}: rank(s) "
                f"{', '.join(map(str, missing))} of {world.size} did not arrive at "
                f"{world.master} within {timeout:.0f} s; start every node with the same "
                "--nnodes, --master-addr and --master-port"
            )
        time.sleep(0.05)
    return store


def watch_store(store: dist.Store, world: LaunchedWorld) -> dist.Store:
    return dist.PrefixStore(f"specbatch/{world.attempt}/", store)


class RankWatch:
    """Beats this rank's counter and watches every other rank's (a daemon thread)."""

    def __init__(
        self,
        store: dist.Store,
        world: LaunchedWorld,
        on_lost: Callable[[str], None] | None = None,
        stale_seconds: float = STALE_SECONDS,
    ) -> None:
        self.store = watch_store(store, world)
        self.world = world
        self.stale_seconds = stale_seconds
        self.lost: str | None = None  # why a peer is taken for gone
        self._on_lost = on_lost
        self._lost_event = threading.Event()
        self._stop = threading.Event()
        self._peers = [r for r in range(world.size) if r != world.rank]
        self._thread = threading.Thread(target=self._run, name="specbatch-rank-watch", daemon=True)
        self._thread.start()

    def who(self, rank: int) -> str:
        try:
            return f"rank {rank} ({self.store.get(f'who/{rank}').decode()})"
        except Exception:  # the store is gone too
            return f"rank {rank}"

    def wait_lost(self, timeout: float) -> str | None:
        """After a failed collective: the lost peer once the watch has seen it, or None. A
        peer is gone (the collective says so), so the one whose beat stops first is it: from
        now on ``SUSPECT_SECONDS`` of silence name a peer, not ``stale_seconds``."""
        self.stale_seconds = min(self.stale_seconds, SUSPECT_SECONDS)
        self._lost_event.wait(timeout)
        return self.lost

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        keys = [f"beat/{r}" for r in self._peers]
        beat = 0
        seen: dict[int, tuple[bytes, float]] = {}
        while not self._stop.wait(BEAT_SECONDS):
            beat += 1
            try:
                self.store.set(f"beat/{self.world.rank}", str(beat))
                values = self.store.multi_get(keys)
            except Exception as exc:  # the store's host or its network is gone
                if not self._stop.is_set():
                    self._lose(
                        f"rank 0's host (the rendezvous store at {self.world.master}) "
                        f"stopped answering ({type(exc).__name__}: {exc})"
                    )
                return
            now = time.monotonic()
            for rank, value in zip(self._peers, values, strict=True):
                last = seen.get(rank)
                if last is None or last[0] != value:
                    seen[rank] = (value, now)
                elif now - last[1] > self.stale_seconds and not self._stop.is_set():
                    self._lose(
                        f"{self.who(rank)} stopped answering (no heartbeat for "
                        f"{self.stale_seconds:g} s)"
                    )
                    return

    def _lose(self, why: str) -> None:
        self.lost = why
        self._lost_event.set()
        if self._on_lost is not None:
            self._on_lost(why)
