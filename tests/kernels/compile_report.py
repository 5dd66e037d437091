"""Compile a Triton launch ahead of time for an NVIDIA GPU, on a machine without one.

Triton's compiler and ``ptxas`` (shipped inside Triton's wheel) run anywhere, so the code a
launch would get on an sm_80 or sm_90 GPU can be built and inspected on a CPU: whether it
compiles at all (the interpreter accepts programs the compiler rejects), how many registers it
needs and whether it spills to local memory, its shared memory, and whether the KV loads are
software-pipelined (``cp.async``) and the matrix products use Hopper's ``wgmma``.

The launch is specialised the way Triton's JIT would specialise it (pointer alignment, integers
divisible by 16, integers equal to 1), from the actual arguments. It needs a process where
``TRITON_INTERPRET`` is off: under the interpreter Triton's own library functions
(``tl.cdiv``, ...) are interpreted objects the compiler cannot call.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specbatch.kernels.attention.triton_backend import KernelLaunch

_TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class CompileReport:
    """What the compiled kernel of one launch uses on one architecture."""

    name: str
    arch: int
    registers: int  # per thread
    stack_bytes: int  # local memory per thread: > 0 means register spills
    shared_bytes: int
    ptx: str

    @property
    def pipelined_loads(self) -> bool:
        """Global loads go through ``cp.async`` into shared memory (software pipelining)."""
        return "cp.async" in self.ptx

    @property
    def uses_wgmma(self) -> bool:
        return "wgmma.mma_async" in self.ptx

    def count(self, instruction: str) -> int:
        return len(re.findall(rf"\b{re.escape(instruction)}\b", self.ptx))


def _tools() -> Path:
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        raise RuntimeError(f"Triton's NVIDIA tools (ptxas, cuobjdump) are not in {tools}")
    return tools


def _specialise(value: Any) -> tuple[str, str | None, Any]:
    """(type, attribute, constant) as Triton's JIT would see this argument."""
    if isinstance(value, torch.Tensor):
        aligned = value.data_ptr() % 16 == 0
        return "*" + _TRITON_TYPES[value.dtype], "D" if aligned else None, None
    if isinstance(value, bool):
        return "u1", None, None
    if isinstance(value, int):
        if value == 1:
            return "constexpr", None, 1
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        return kind, "D" if value % 16 == 0 else None, None
    if isinstance(value, float):
        return "fp32", None, None
    raise TypeError(f"cannot specialise a launch argument of type {type(value).__name__}")


def compile_launch(launch: KernelLaunch, arch: int) -> CompileReport:
    """Compile ``launch`` for ``sm_<arch>`` and read back its resource use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_launch needs a process with TRITON_INTERPRET unset")
    tools = _tools()
    kernel = launch.kernel
    names = kernel.arg_names
    signature: dict[str, str] = {}
    constants: dict[str, Any] = dict(launch.constants)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    positional = iter(launch.args)
    for index, name in enumerate(names):
        if name in launch.constants:
            signature[name] = "constexpr"
            continue
        kind, attribute, constant = _specialise(next(positional))
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = constant
        if attribute == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constants, attrs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {usage!r}")
    return CompileReport(
        name=kernel.__name__,
        arch=arch,
        registers=int(found.group(1)),
        stack_bytes=int(found.group(2)),
        shared_bytes=int(compiled.metadata.shared),
        ptx=compiled.asm["ptx"],
    )
