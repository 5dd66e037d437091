"""Every decoder layer of a model as one C call, where all its linears are GGUF blocks, all
float32 in MKL's packed layout (``kernels.sgemm``), or all bfloat16 AMX tiles
(``kernels.amx_linear``; ``cpu_ops.decoder_layer_bf16``).

``cpu_ops.decoder_layer`` runs a layer (norms, quantized projections, rotary, K/V write,
attention, residuals) without returning to Python; it calls the very kernels the per-op path
calls (by address) and the same C norm, rotary and SiLU-gate, so both paths give the same bits
(``tests/models/test_gguf_quantized.py``, ``tests/models/test_fused_float_layers.py``). On SmolLM2 a
batch-1 decode forward takes 4.9 ms fused against 7.7 ms per op (``python
benchmarks/verify_cost.py --modes gguf gguf-per-op --batch-sizes 1``): ~90 us per layer had
gone to torch dispatch and Python around the linears.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from specbatch.kernels import amx_linear, cpu_ops, gguf_linear, sgemm
from specbatch.kernels.attention import cpu_paged
from specbatch.kernels.attention.cpu_paged import CpuPagedBackend, KernelQueries

if TYPE_CHECKING:
    from specbatch.kernels.linear import Linear
    from specbatch.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class FusedLayers:
    """When a model's layers can run fused, and their arguments (per layer: built once per
    cache binding; per step: once per step)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.enabled = True  # False: the per-op path even where fused layers apply
        self._applies: bool | None = None
        self._layers: list[cpu_ops.LayerSpec] | None = None
        self._kernels: tuple[int, ...] = ()

    def reconsider(self) -> None:
        """The model's weights changed kind: decide again whether fused layers apply."""
        self._applies = None

    def forget_layers(self) -> None:
        """The caches were bound anew: the layers' arguments point into the old ones."""
        self._layers = None

    def applies(self) -> bool:
        """On the CPU with the C attention backend and every library built: a float32 model
        whose layers' linears are all GGUF blocks or all MKL-packed, or a bfloat16 one whose
        layers' linears are all AMX tiles."""
        if self._applies is None:
            kind = self.linear_kind() if self._model_fits() else None
            self._kernels = self._kernel_addresses(kind) if kind is not None else ()
            self._applies = bool(self._kernels)
        return self._applies

    def _model_fits(self) -> bool:
        model = self.model
        return (
            self.enabled
            and model.device.type == "cpu"
            and isinstance(model.backend, CpuPagedBackend)
            and model.config.head_dim <= cpu_ops.MAX_ROTARY_DIM
        )

    def linear_kind(self) -> str | None:
        """What every layer linear multiplies with: "gguf" (GGUF blocks), "sgemm" (float32,
        MKL's packed layout), "tiles" (bfloat16 AMX tiles), or None (mixed, plain, oneDNN)."""
        model, linears = self.model, self.model.layer_linears()
        if model.dtype == torch.bfloat16:
            return "tiles" if all(m.tiles is not None for m in linears) else None
        if model.dtype != torch.float32:
            return None
        if all(m.sgemm is not None for m in linears):
            return "sgemm"
        return "gguf" if model.multiplies_blocks() else None

    @staticmethod
    def _kernel_addresses(kind: str) -> tuple[int, ...]:
        """The kernels a fused layer calls (the linear: GGUF's, MKL's packed GEMM behind
        ``cpu_ops.sgemm_linear``, or the AMX tiles'; attention, K/V write), by address, or ()
        where a library cannot be built."""
        ops, attention = cpu_ops.load_library(), cpu_paged.load_library()
        if ops is None or attention is None:
            return ()
        if kind == "sgemm":
            compute = sgemm.compute_address()
            if not compute:
                return ()
            ops.set_sgemm_compute(compute)
            linear = ctypes.cast(ops.sgemm_linear, ctypes.c_void_p).value or 0
        elif kind == "tiles":
            linear = amx_linear.linear_address()
        else:
            library = gguf_linear.load_library()
            if library is None:
                return ()
            linear = ctypes.cast(library.gguf_linear, ctypes.c_void_p).value or 0
        if not linear:
            return ()
        functions = (attention.paged_attention, attention.write_kv)
        return (linear, *(ctypes.cast(f, ctypes.c_void_p).value or 0 for f in functions))

    def step(
        self, metadata: object, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor
    ) -> cpu_ops.LayerStepSpec | None:
        """The step's part of the fused layers' arguments, or None where they do not apply."""
        queries = getattr(metadata, "queries", None)
        if queries is None or torch.is_grad_enabled() or not self.applies():
            return None
        cache = self._decoder_layers()[0].self_attn.kv_cache
        dtype = self.model.dtype
        if cache is None or cache[0].dtype != dtype or x.dtype != dtype:
            return None
        if queries.max_slot >= cache[0].shape[0] * cache[0].shape[1]:
            raise IndexError(f"KV slot {queries.max_slot} is outside the cache")
        return _step_spec(
            cast(KernelQueries, queries), cos, sin, x, cache[0].shape[1], self._kernels
        )

    def run(self, step: cpu_ops.LayerStepSpec, x: torch.Tensor) -> torch.Tensor:
        """Every layer on the residual stream ``x``; the stream after the last one."""
        x = x.contiguous()
        if self._layers is None:
            self._layers = [_layer_spec(layer) for layer in self._decoder_layers()]
        for spec in self._layers:
            cpu_ops.decoder_layer(spec, step, x)
        return x

    def _decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [cast("LlamaDecoderLayer", layer) for layer in self.model.model.layers]


def _linears(layer: LlamaDecoderLayer) -> tuple[Linear, Linear, Linear, Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _step_spec(
    queries: KernelQueries,
    cos: torch.Tensor,
    sin: torch.Tensor,
    x: torch.Tensor,
    block: int,
    kernels: tuple[int, ...],
) -> cpu_ops.LayerStepSpec:
    q_start, q_len, seq_len, tables, table_stride, tree, tree_stride, num_seqs = (
        queries.sequence_args
    )
    linear, attention, write = kernels
    return cpu_ops.LayerStepSpec(
        tokens=x.shape[0],
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        slots=queries.slots_pointer,
        q_start=q_start,
        q_len=q_len,
        seq_len=seq_len,
        block_tables=tables,
        bt_stride=table_stride,
        tree=tree,
        tree_stride=tree_stride,
        num_seqs=num_seqs,
        chunk=cpu_paged.chunk_positions(block),
        threads=torch.get_num_threads(),
        linear=linear,
        attention=attention,
        write=write,
    )


def _layer_spec(layer: LlamaDecoderLayer) -> cpu_ops.LayerSpec:
    """The fused layer's arguments for ``layer`` (its linears GGUF blocks, MKL-packed or AMX
    tiles, its cache bound)."""
    attn = layer.self_attn
    assert attn.kv_cache is not None
    specs = []
    for linear in _linears(layer):
        if linear.quantized is not None:
            weight = linear.quantized
            specs.append(
                cpu_ops.QuantLinearSpec(gguf_linear.kernel_kind(weight), weight.data.data_ptr())
            )
            continue
        held = linear.sgemm or linear.tiles
        assert held is not None
        specs.append(cpu_ops.QuantLinearSpec(0, held.data.data_ptr()))
    bias = attn.qkv_proj.bias
    return cpu_ops.LayerSpec(
        norm1=layer.input_layernorm.weight.data_ptr(),
        norm2=layer.post_attention_layernorm.weight.data_ptr(),
        eps=layer.input_layernorm.eps,
        scale=attn.backend.scale,
        qkv=specs[0],
        o=specs[1],
        gate_up=specs[2],
        down=specs[3],
        qkv_bias=None if bias is None else bias.data_ptr(),
        hidden=layer.input_layernorm.weight.shape[0],
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        intermediate=layer.mlp.intermediate_size,
        block_size=attn.kv_cache[0].shape[1],
        key_cache=attn.kv_cache[0].data_ptr(),
        value_cache=attn.kv_cache[1].data_ptr(),
    )
