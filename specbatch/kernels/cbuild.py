"""C kernels compiled at first use with the system C compiler and loaded with ctypes.

A kernel's shared library is built once into ``cache_dir()/kernels``, named by a hash of its
source and the headers it includes by a quoted path (``simd.h``), the compiler flags and the
CPU's flags (``-march=native`` output must not move between CPUs through a shared cache), and
swapped into place atomically so concurrent processes never load half a file. Callers keep the
loaded library (or the failure) for the life of the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from specbatch.utils import cache_dir

logger = logging.getLogger("specbatch")

NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_build_lock = threading.Lock()  # one compile at a time in this process


def _cpu_signature() -> str:
    """What ``-march=native`` compiled for: a shared cache must not hand one CPU's binary to
    another."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return os.uname().machine + flags


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def _source_bytes(source: Path, seen: set[Path] | None = None) -> bytes:
    """``source`` followed by every file it includes by a quoted path, recursively (each once):
    an edit to a shared header must rebuild every library that includes it."""
    seen = set() if seen is None else seen
    seen.add(source.resolve())
    text = source.read_bytes()
    parts = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        header = source.parent / name.decode()
        if header.resolve() not in seen:
            parts.append(name + b"\0" + _source_bytes(header, seen))
    return b"\0".join(parts)


def library_path(source: Path, flags: Sequence[str]) -> Path:
    """Where the library built from ``source`` with ``flags`` on this CPU is cached."""
    key = hashlib.sha256(
        _source_bytes(source) + " ".join(flags).encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


def _compile(source: Path, flags: Sequence[str], target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *flags, str(source), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent process sees all of it or nothing


def load_c_library(
    source: Path, flags: Sequence[str], description: str, fallback: str
) -> ctypes.CDLL | None:
    """The library built from ``source`` (compiled now unless cached), or None where it cannot
    be built or loaded, after a warning that names the kernel (``description``) and what the
    caller does instead (``fallback``). Each call retries a failed build and warns again:
    :class:`NativeLibrary` keeps the result."""
    with _build_lock:
        target = library_path(source, flags)
        try:
            if not target.is_file():
                _compile(source, flags, target)
            return ctypes.CDLL(str(target))
        except OSError as exc:
            logger.warning("%s could not be built (%s); %s", description, exc, fallback)
            return None


class NativeLibrary:
    """A C file built at first use and loaded once per process, its functions declared; a build
    that fails is warned about once and remembered (callers then take their fallback)."""

    def __init__(
        self,
        source: Path,
        flags: Sequence[str],
        description: str,
        fallback: str,
        declare: Callable[[ctypes.CDLL], None],
    ) -> None:
        self.source, self.flags = source, tuple(flags)
        self.description, self.fallback, self.declare = description, fallback, declare
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._failed = False

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, or None where it cannot be built. Once settled, no lock: hot
        paths call this every layer."""
        if self._library is not None or self._failed:
            return self._library
        with self._lock:
            if self._library is None and not self._failed:
                library = load_c_library(self.source, self.flags, self.description, self.fallback)
                if library is None:
                    self._failed = True
                else:
                    self.declare(library)
                    self._library = library
            return self._library

    def fresh(self) -> NativeLibrary:
        """The same library, not loaded yet (tests of the build and its fallback)."""
        return NativeLibrary(self.source, self.flags, self.description, self.fallback, self.declare)
