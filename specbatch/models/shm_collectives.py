"""All-reduce and all-gather between the ranks of one host through one shared-memory segment.

A CPU tensor-parallel step runs two all-reduces per layer and an all-gather of the logits rows;
through gloo each is a TCP round trip between processes on the same host (~3 ms each on a
loaded 2-core host, 62 a step). Here every rank maps the same file in ``/dev/shm`` (created by
rank 0, unlinked once every rank has mapped it, so a crash leaves nothing behind), writes its
tensor into its own slot, raises its flag to the collective's number, and waits until every
flag has reached it; then each rank reads every slot.

**Same bits on every rank, and gloo's for two ranks.** An all-reduce sums the slots in rank
order on every rank (``((x0 + x1) + x2) + ...``), so every rank holds the same sum; with two
ranks that is gloo's sum too (``x0 + x1 == x1 + x0`` in IEEE arithmetic). With more ranks
gloo's ring sums each chunk in its own rotation of the ranks, so the two agree to a rounding,
not bit for bit.

**Ordering.** A flag is written after its slot and read before the slots, each a separate
store or load from Python; x86's memory model keeps stores in order and loads in order, which
is all this needs (``available`` is False elsewhere, and the group stays on gloo). Slots are
double-buffered by the collective's parity: a rank that reaches collective ``n`` has seen
every flag at ``n - 1``, so every rank has finished reading ``n - 2``, the collective whose
buffer ``n`` writes.

**A peer that dies** never raises its flag: the wait checks the peers' processes (their pids
are in the segment's header) every ``LIVENESS_SECONDS`` and raises
:class:`~specbatch.errors.TensorParallelError` naming the dead rank, and raises it too when a
living peer has not arrived within ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch

from specbatch.errors import TensorParallelError
from specbatch.utils import ceil_div

LINE = 64  # bytes: each rank's flag and pid on its own cache line
LIVENESS_SECONDS = 0.1  # how often a waiting rank checks that its peers are alive
DIRECTORY = "/dev/shm"


# this process's group, when its tensor-parallel ranks share a host's memory (``set_local``)
_local: SharedMemoryGroup | None = None


def local_group() -> SharedMemoryGroup | None:
    """The group this process's tensor-parallel collectives go through, if any."""
    return _local


def set_local(group: SharedMemoryGroup | None) -> None:
    global _local
    if _local is not None and _local is not group:
        _local.close()
    _local = group


def available() -> bool:
    """Whether this host can run the collectives (x86's store and load ordering; a
    ``/dev/shm`` to map)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(DIRECTORY)


def new_name() -> str:
    """A fresh segment name for a group (rank 0 makes it and tells the others)."""
    return f"specbatch-tp-{os.getpid()}-{secrets.token_hex(6)}"


class SharedMemoryGroup:
    """One rank's view of the segment: ``world_size`` slots of ``capacity`` bytes, twice.

    Rank 0 constructs with ``create=True`` first; the others attach to the same ``name``; rank
    0 then calls :meth:`unlink` once every rank is attached (after a barrier of the process
    group that told them the name)."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        capacity: int,
        create: bool,
        timeout: float = 600.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of {world_size}")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.capacity = ceil_div(max(capacity, LINE), LINE) * LINE
        self.timeout = timeout
        header = world_size * LINE
        size = header + 2 * world_size * self.capacity
        path = os.path.join(DIRECTORY, name)
        if create:  # sized under a private name, then renamed: the name is never half made
            making = f"{path}.{os.getpid()}"
            fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            os.rename(making, path)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            found = os.fstat(fd).st_size
            if found != size:
                raise TensorParallelError(
                    f"shared-memory segment {name} has {found} bytes, this rank expects {size} "
                    "(a different world size or capacity)"
                )
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._path = path if create else None
        # per rank, on its own line: [0] its latest collective's number, [1] its pid
        self._header = np.ndarray(
            (world_size, 2), dtype=np.int64, buffer=self._map, strides=(LINE, 8)
        )
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = header
        self._count = 0
        self._header[rank, 0] = 0
        self._header[rank, 1] = os.getpid()

    def unlink(self) -> None:
        """Remove the segment's name (rank 0, once every rank has mapped it): the memory
        lives until the last rank unmaps it."""
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None

    def close(self) -> None:
        self.unlink()
        if not self._map.closed:
            del self._header, self._bytes
            self._map.close()

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (every rank gets the same bits)."""
        flat = tensor.contiguous().view(-1)  # ``tensor`` itself when contiguous
        for piece in self._pieces(flat):
            slots = self._exchange(piece)
            piece.copy_(slots[0])
            for other in slots[1:]:
                piece.add_(other)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (the same shape on every rank), in rank order."""
        flat = tensor.contiguous().view(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        for piece, *into in zip(self._pieces(flat), *map(self._pieces, parts), strict=True):
            for target, slot in zip(into, self._exchange(piece), strict=True):
                target.copy_(slot)
        return [part.view_as(tensor) for part in parts]

    def _pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` in views of at most a slot's bytes."""
        step = max(self.capacity // flat.element_size(), 1)
        return list(flat.split(step))

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Write ``part`` into this rank's slot, wait for every rank's, and view them all
        (valid until the collective after next)."""
        self._count += 1
        count = self._count
        nbytes = part.numel() * part.element_size()
        buffer = (count % 2) * self.world_size
        own = self._slot(buffer + self.rank, nbytes)
        own.copy_(part.view(torch.uint8))
        self._header[self.rank, 0] = count  # after the slot: x86 keeps the stores in order
        self._wait(count)
        return [self._slot(buffer + r, nbytes).view(part.dtype) for r in range(self.world_size)]

    def _slot(self, index: int, nbytes: int) -> torch.Tensor:
        start = self._slots + index * self.capacity
        return self._bytes[start : start + nbytes]

    def _wait(self, count: int) -> None:
        """Until every rank has reached collective ``count``."""
        flags = self._header[:, 0]
        if (flags >= count).all():
            return
        started = checked = time.monotonic()
        while not (flags >= count).all():
            os.sched_yield()
            now = time.monotonic()
            if now - checked < LIVENESS_SECONDS:
                continue
            checked = now
            behind = [int(r) for r in np.flatnonzero(flags < count)]
            dead = [r for r in behind if not _alive(int(self._header[r, 1]))]
            if dead:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {dead} exited before collective {count} "
                    f"(rank {self.rank} waiting in shared memory)"
                )
            if now - started > self.timeout:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {behind} did not reach collective {count} "
                    f"within {self.timeout:.0f} s (rank {self.rank} waiting in shared memory)"
                )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False  # never attached
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    """A child that exited but was not reaped still answers ``kill(pid, 0)``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: trust kill
