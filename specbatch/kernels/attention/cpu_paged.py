"""The CPU attention backend: short queries read the paged cache in place, in C.

Decodes, verify queries and tree nodes (at most ``SHORT_QUERY`` query tokens per sequence) go to
``cpu_paged_attention.c``: one work unit per (sequence, 256-position chunk) walks the blocks
through the block table, every position's K/V rows read once for all the sequence's query heads
and tokens (GQA folded), online softmax in float32, no gather and no padding to the longest
sequence. What a batch-64 decode step spent copying contexts out of the cache and attending
over padded rows it now spends reading the cache once (see ``benchmarks/cpu_attention.py``).
Prefill chunks keep the reference path (``torch_ref.py``): their gather is paid once for many
query rows, and ``scaled_dot_product_attention`` is matrix-multiply bound there.

The C file is compiled at first use with the system C compiler (``cc -O3 -march=native
-fopenmp``) into the user cache and loaded with ctypes; where no compiler works the backend
says so once and keeps the reference path for every query.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specbatch.kernels.attention.base import AttentionInputs, LayerKVCache
from specbatch.kernels.attention.torch_ref import (
    SHORT_QUERY,
    TorchAttentionBackend,
    TorchAttentionMetadata,
)
from specbatch.utils import cache_dir

logger = logging.getLogger("specbatch")

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
MAX_HEAD_DIM = 256  # the merge keeps one row on the stack
# Positions per work unit: units are spread over the threads, so one long sequence still uses
# every core; the boundaries are absolute positions (a row's arithmetic never depends on the
# batch). 256 keeps a unit's K/V in L2 and its merge cheap.
CHUNK_POSITIONS = 256

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_failed = False


def _cpu_signature() -> str:
    """What ``-march=native`` compiled for: a shared cache must not hand one CPU's binary to
    another."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return os.uname().machine + flags


def _compile(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent process sees all of it or nothing


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use), or None where it cannot be built."""
    global _library, _load_failed
    with _lock:
        if _library is not None or _load_failed:
            return _library
        key = hashlib.sha256(
            SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode()
        ).hexdigest()[:16]
        target = cache_dir() / "kernels" / f"cpu_paged_attention-{key}.so"
        try:
            if not target.is_file():
                _compile(target)
            library = ctypes.CDLL(str(target))
        except OSError as exc:
            _load_failed = True
            logger.warning(
                "the CPU attention kernel could not be built (%s); short queries use the "
                "slower reference path",
                exc,
            )
            return None
        function = library.paged_attention_short
        function.restype = ctypes.c_int
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        function.argtypes = [
            pointer, i64, i64,  # q, strides
            pointer, i64, i64,  # out, strides
            pointer, pointer, ctypes.c_int,  # caches, bf16
            pointer, pointer, pointer,  # q_start, q_len, seq_len
            pointer, i64,  # block tables, stride
            pointer, i64,  # tree mask, stride
            i64, i64, i64, i64, i64, i64,  # seqs, heads, kv heads, head dim, block, chunk
            ctypes.c_float, ctypes.c_int,  # scale, threads
        ]  # fmt: skip
        _library = library
        return _library


@dataclass
class ShortQueries:
    """Host arrays the kernel reads for the step's short-query sequences (kept alive here)."""

    q_start: np.ndarray  # [S] int64: flat row of each sequence's first query token
    q_len: np.ndarray  # [S] int64
    seq_len: np.ndarray  # [S] int64
    block_tables: np.ndarray  # [S, W] int64, contiguous
    tree: np.ndarray | None  # [T, width] uint8, contiguous


@dataclass
class CpuPagedMetadata(TorchAttentionMetadata):
    """The reference metadata (writes, prefill groups) plus the kernel's short queries."""

    inputs: AttentionInputs | None = None  # the step's layout (for caches the kernel cannot read)
    short: ShortQueries | None = None


class CpuPagedBackend(TorchAttentionBackend):
    """Paged attention on the CPU: the C kernel for short queries, the reference for prefill."""

    name = "cpu"

    def build_metadata(
        self, inputs: AttentionInputs, device: torch.device
    ) -> TorchAttentionMetadata:
        query_lens = np.asarray(inputs.query_lens, dtype=np.int64)
        short = np.flatnonzero(query_lens <= SHORT_QUERY)
        fits = self.head_dim <= MAX_HEAD_DIM and device.type == "cpu"
        if not len(short) or not fits or load_library() is None:
            return self.reference_metadata(inputs, device)
        reference = self.reference_metadata(inputs, device, short_group=False)
        tree = None
        if inputs.tree_mask is not None:
            tree = np.ascontiguousarray(inputs.tree_mask, dtype=np.uint8)
        return CpuPagedMetadata(
            num_tokens=reference.num_tokens,
            write_rows=reference.write_rows,
            write_slots=reference.write_slots,
            groups=reference.groups,
            inputs=inputs,
            short=ShortQueries(
                q_start=np.ascontiguousarray(inputs.query_start_loc[short], dtype=np.int64),
                q_len=np.ascontiguousarray(query_lens[short]),
                seq_len=np.ascontiguousarray(inputs.seq_lens[short], dtype=np.int64),
                block_tables=np.ascontiguousarray(inputs.block_tables[short], dtype=np.int64),
                tree=tree,
            ),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache | None,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise RuntimeError("no KV cache bound to the model: call bind_kv_caches first")
        short = getattr(metadata, "short", None)
        if short is not None and kv_cache[0].dtype not in (torch.float32, torch.bfloat16):
            assert isinstance(metadata, CpuPagedMetadata)  # e.g. a float16 cache: reference
            assert metadata.inputs is not None
            metadata, short = self.reference_metadata(metadata.inputs, q.device), None
        self.write_kv(k, v, kv_cache, metadata)
        # Every query attends in float32, whichever path serves it: a prefill's bits must not
        # depend on whether its step also held short queries (it would, in bfloat16).
        queries = q if q.dtype == torch.float32 and q.stride(-1) == 1 else q.float()
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=torch.float32)
        if short is not None:
            self._attend_short(queries, kv_cache, short, out)
        attended = self.attend_groups(queries, kv_cache, metadata.groups, out)
        return (out if attended is None else attended).to(q.dtype)

    def _attend_short(
        self, q: torch.Tensor, kv_cache: LayerKVCache, short: ShortQueries, out: torch.Tensor
    ) -> None:
        key_cache, value_cache = kv_cache
        library = load_library()
        assert library is not None
        tree = short.tree
        block_size = key_cache.shape[1]
        status = library.paged_attention_short(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            int(key_cache.dtype == torch.bfloat16),
            short.q_start.ctypes.data,
            short.q_len.ctypes.data,
            short.seq_len.ctypes.data,
            short.block_tables.ctypes.data,
            short.block_tables.shape[1],
            None if tree is None else tree.ctypes.data,
            0 if tree is None else tree.shape[1],
            len(short.q_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            block_size,
            block_size * max(1, CHUNK_POSITIONS // block_size),
            self.scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
