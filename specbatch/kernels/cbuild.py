"""C kernels compiled at first use with the system C compiler and loaded with ctypes.

A kernel's shared library is built once into ``cache_dir()/kernels``, named by a hash of its
source, the compiler flags and the CPU's flags (``-march=native`` output must not move between
CPUs through a shared cache), and swapped into place atomically so concurrent processes never
load half a file. Callers keep the loaded library (or the failure) for the life of the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
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


def library_path(source: Path, flags: Sequence[str]) -> Path:
    """Where the library built from ``source`` with ``flags`` on this CPU is cached."""
    key = hashlib.sha256(
        source.read_bytes() + " ".join(flags).encode() + _cpu_signature().encode()
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
    caller does instead (``fallback``). Callers keep the result: each call retries a failed
    build and warns again."""
    with _build_lock:
        target = library_path(source, flags)
        try:
            if not target.is_file():
                _compile(source, flags, target)
            return ctypes.CDLL(str(target))
        except OSError as exc:
            logger.warning("%s could not be built (%s); %s", description, exc, fallback)
            return None
