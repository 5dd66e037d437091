"""Per-layer CPU operations in C (``cpu_ops.c``) for float32 and bfloat16 rows: RMSNorm, rotary,
the gated activation (SwiGLU, GeGLU), and a whole decoder layer in one call when every linear's
form has a C kernel.

At decode sizes torch spends more on dispatching a layer's small ops than on their work; one
ctypes call does each, and ``decoder_layer`` runs a whole layer (norms, quantized linears,
rotary, K/V write, attention, residuals) without returning to Python (``kernels/fused_layers.py``
has what that saves). The layer calls the very kernels the per-op path calls (by address: each
weight form's, ``paged_attention``, ``write_kv``) and this file's own RMSNorm, rotary and gated
activation, which the per-op path also uses on CPU rows, so the two give the same bits (tested).
Where no compiler works, callers keep torch's implementations (these functions return
None/False).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specbatch.kernels.cbuild import NATIVE_FLAGS, NativeLibrary

SOURCE = Path(__file__).with_name("cpu_ops.c")


def _declare(library: ctypes.CDLL) -> None:
    """The C functions' signatures."""
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.rms_norm.restype = None
    library.rms_norm.argtypes = [
        pointer, i64, i64, i64, pointer, ctypes.c_float, pointer, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    library.rotary.restype = None
    library.rotary.argtypes = [
        pointer, i64, i64, i64, i64, i64, pointer, pointer, ctypes.c_int
    ]  # fmt: skip
    library.glu_mul.restype = None
    library.glu_mul.argtypes = [
        pointer, i64, i64, pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int
    ]  # fmt: skip
    library.set_sgemm_compute.restype = None
    library.set_sgemm_compute.argtypes = [pointer]
    library.decoder_layer.restype = ctypes.c_int
    library.decoder_layer.argtypes = [pointer, pointer, pointer]
    library.decoder_layer_bf16.restype = ctypes.c_int
    library.decoder_layer_bf16.argtypes = [pointer, pointer, pointer]


NATIVE = NativeLibrary(
    SOURCE, NATIVE_FLAGS, "the CPU layer operations", "torch's are used instead", _declare
)


def load_library() -> ctypes.CDLL | None:
    """The compiled operations (built on first use), or None where they cannot be built."""
    return NATIVE.load()


_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension of CPU rows ``[T, D]``
    (float32, or bfloat16 computed in float32 as HF Llama does; rows may be strided, elements
    contiguous); None where this path does not apply (another dtype, device or layout, or no
    compiled library)."""
    if (
        x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.stride(1) != 1
        or not weight.is_contiguous()
        or weight.shape[0] != x.shape[1]
        or (library := NATIVE.load()) is None
    ):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    library.rms_norm(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


MAX_ROTARY_DIM = 512  # the C rotary holds a head on its stack (MAX_DIM in cpu_ops.c)


def rotary_(
    qkv: torch.Tensor,
    heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_stride: int | None = None,
) -> bool:
    """Rotate the first ``head_dim`` values of each of the first ``heads`` heads (``head_stride``
    apart, default ``head_dim``: a partial rotary leaves the rest of a head as it is) of every
    row of ``qkv`` ``[T, N]`` in place (cos and sin ``[T, 1, head_dim]`` as
    ``RotaryEmbedding.cos_sin`` gives them); False, changing nothing, where this path does not
    apply."""
    if (
        qkv.dtype not in _DTYPES
        or cos.dtype != qkv.dtype
        or sin.dtype != qkv.dtype
        or qkv.device.type != "cpu"
        or qkv.dim() != 2
        or qkv.stride(1) != 1
        or head_dim > MAX_ROTARY_DIM
        or not (cos.is_contiguous() and sin.is_contiguous())
        or (library := NATIVE.load()) is None
    ):
        return False
    library.rotary(
        qkv.data_ptr(),
        qkv.shape[0],
        heads,
        head_dim,
        qkv.stride(0),
        head_dim if head_stride is None else head_stride,
        cos.data_ptr(),
        sin.data_ptr(),
        int(qkv.dtype == torch.bfloat16),
    )
    return True


def glu_mul(gate_up: torch.Tensor, width: int, gelu: bool = False) -> torch.Tensor | None:
    """``silu(gate) * up`` (with ``gelu``: ``gelu_tanh(gate) * up``, Gemma's GeGLU) for CPU rows
    ``[gate | up]`` of ``2 * width`` (float32, or bfloat16 computed in float32); None where
    this path does not apply."""
    if (
        gate_up.dtype not in _DTYPES
        or gate_up.device.type != "cpu"
        or gate_up.dim() != 2
        or not gate_up.is_contiguous()
        or (library := NATIVE.load()) is None
    ):
        return None
    out = torch.empty(gate_up.shape[0], width, dtype=gate_up.dtype)
    library.glu_mul(
        gate_up.data_ptr(),
        gate_up.shape[0],
        width,
        out.data_ptr(),
        int(gate_up.dtype == torch.bfloat16),
        int(gelu),
        torch.get_num_threads(),
    )
    return out


class StackedPartSpec(ctypes.Structure):
    """``StackedPart`` of ``cpu_ops.c``: one part of a stacked weight."""

    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("kind", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("n", ctypes.c_int64),
    ]


class QuantLinearSpec(ctypes.Structure):
    """``QuantLinear`` of ``cpu_ops.c``: a weight form's kernel, its kind code, its bytes."""

    _fields_ = [("fn", ctypes.c_void_p), ("kind", ctypes.c_int), ("data", ctypes.c_void_p)]


class LayerSpec(ctypes.Structure):
    """``Layer`` of ``cpu_ops.c``: what one decoder layer holds (pointers into its tensors)."""

    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("qkv", QuantLinearSpec),
        ("o", QuantLinearSpec),
        ("gate_up", QuantLinearSpec),
        ("down", QuantLinearSpec),
        ("qkv_bias", ctypes.c_void_p),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attn", ctypes.c_void_p),
        ("post_mlp", ctypes.c_void_p),
        ("rotary_dim", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("local_rope", ctypes.c_int),
    ]


class LayerStepSpec(ctypes.Structure):
    """``LayerStep`` of ``cpu_ops.c``: what a step gives every layer."""

    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("q_start", ctypes.c_void_p),
        ("q_len", ctypes.c_void_p),
        ("seq_len", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("bt_stride", ctypes.c_int64),
        ("tree", ctypes.c_void_p),
        ("tree_stride", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("chunk", ctypes.c_int64),
        ("threads", ctypes.c_int),
        ("attention", ctypes.c_void_p),
        ("write", ctypes.c_void_p),
        ("cos_local", ctypes.c_void_p),
        ("sin_local", ctypes.c_void_p),
        ("window_slots", ctypes.c_void_p),
        ("window_tables", ctypes.c_void_p),
        ("window_bt_stride", ctypes.c_int64),
    ]


def decoder_layer(layer: LayerSpec, step: LayerStepSpec, x: torch.Tensor) -> None:
    """Run one decoder layer on the residual stream ``x`` (float32 or, with AMX tiles,
    bfloat16 ``[T, hidden]``, contiguous, updated in place)."""
    library = NATIVE.load()
    assert library is not None
    run = library.decoder_layer_bf16 if x.dtype == torch.bfloat16 else library.decoder_layer
    if run(ctypes.byref(layer), ctypes.byref(step), x.data_ptr()) != 0:
        raise MemoryError("the fused CPU decoder layer could not allocate its scratch memory")
