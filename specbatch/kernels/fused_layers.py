"""Every decoder layer of a model as one C call, where each of its linears' weight forms has a
C kernel (``WeightForm.fused_part``) for the model's activations: GGUF blocks and MKL-packed
float32 in a float32 model, AMX tiles in a bfloat16 one.

``cpu_ops.decoder_layer`` runs a layer (norms, projections, rotary, K/V write, attention,
residuals) without returning to Python; it calls the very kernels the per-op path calls (by
address: each form's own) and the same C norm, rotary and gated activation, so both paths give the
same bits (``tests/models/test_gguf_quantized.py``, ``tests/models/test_fused_float_layers.py``).
On SmolLM2 a batch-1 decode forward takes 4.9 ms fused against 7.7 ms per op (``python
benchmarks/verify_cost.py --modes gguf gguf-per-op --batch-sizes 1``): ~90 us per layer had
gone to torch dispatch and Python around the linears.

This module knows no model class: a model describes its layers as :class:`FusedLayer` values
(:class:`FusableModel`), so the kernels room stays below the models room.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from specbatch.kernels import cpu_ops
from specbatch.kernels.attention import AttentionBackend, GroupedMetadata, LayerKVCache, cpu_paged
from specbatch.kernels.attention.cpu_paged import CpuPagedBackend, KernelQueries
from specbatch.kernels.weight_forms import FusedPart, WeightForm


@dataclass(frozen=True)
class FusedLayer:
    """What a Llama-style decoder layer gives the fused call: its norms, its four linears'
    forms, its shapes and its bound cache."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    eps: float
    scale: float
    qkv: WeightForm
    o: WeightForm
    gate_up: WeightForm
    down: WeightForm
    qkv_bias: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    kv_cache: LayerKVCache | None
    # the relatives' features (models/families.py): float32 layers only
    q_norm: torch.Tensor | None = None  # per-head norms before rotary
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # norms of the attention's and the MLP's outputs
    post_mlp: torch.Tensor | None = None
    rotary_dim: int | None = None  # None: the whole head
    window: int | None = None  # a sliding layer's
    softcap: float | None = None  # of its attention scores
    gelu: bool = False  # GeGLU, not SwiGLU
    local_rope: bool = False  # rotates with the step's local cos/sin

    @property
    def plain(self) -> bool:
        """Whether it is the Llama block (which the bfloat16 call also runs)."""
        return (
            self.q_norm is None
            and self.post_attn is None
            and self.rotary_dim in (None, self.head_dim)
            and self.window is None
            and self.softcap is None
            and not self.gelu
            and not self.local_rope
        )

    @property
    def forms(self) -> tuple[WeightForm, WeightForm, WeightForm, WeightForm]:
        return self.qkv, self.o, self.gate_up, self.down


class FusableModel(Protocol):
    """A model whose layers the fused call can run."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def backend(self) -> AttentionBackend: ...

    def fused_layers(self) -> Sequence[FusedLayer]:
        """Its decoder layers, in order; none where one is of a kind the call cannot run."""
        ...


class FusedLayers:
    """When a model's layers can run fused, and their arguments (per layer: built once per
    cache binding; per step: once per step)."""

    def __init__(self, model: FusableModel, enabled: bool = True) -> None:
        """``enabled=False``: the per-op path even where fused layers apply (the reference the
        fused call is tested against: a model's ``fused`` replaced by one made so)."""
        self.model = model
        self._enabled = enabled
        self._applies: bool | None = None
        self._described: Sequence[FusedLayer] | None = None
        self._layers: list[cpu_ops.LayerSpec] | None = None
        self._kernels: tuple[int, int] | None = None

    def reconsider(self) -> None:
        """The model's weights changed form: decide again whether fused layers apply."""
        self._applies = None
        self.forget_layers()

    def forget_layers(self) -> None:
        """The caches were bound anew: the layers' arguments point into the old ones."""
        self._described = None
        self._layers = None

    def _layer_list(self) -> Sequence[FusedLayer]:
        """The model's layers as it describes them (once per binding: a step must not pay for
        thirty descriptions)."""
        if self._described is None:
            self._described = self.model.fused_layers()
        return self._described

    def applies(self) -> bool:
        """On the CPU with the C attention backend and every library built, where every layer
        linear's form has a kernel for the model's activations."""
        if self._applies is None:
            self._kernels = self._attention_kernels() if self._model_fits() else None
            layers = self._layer_list()
            self._applies = (
                self._kernels is not None
                and bool(layers)
                and all(_parts(layer, self.model.dtype) is not None for layer in layers)
            )
        return self._applies

    def _model_fits(self) -> bool:
        model = self.model
        return (
            self._enabled
            and model.device.type == "cpu"
            and model.dtype in (torch.float32, torch.bfloat16)
            and isinstance(model.backend, CpuPagedBackend)
            and model.backend.head_dim <= cpu_ops.MAX_ROTARY_DIM
        )

    @staticmethod
    def _attention_kernels() -> tuple[int, int] | None:
        """The attention and K/V-write kernels a fused layer calls, by address, or None where
        a library cannot be built."""
        ops, attention = cpu_ops.load_library(), cpu_paged.load_library()
        if ops is None or attention is None:
            return None
        functions = (attention.paged_attention, attention.write_kv)
        paged, write = (ctypes.cast(f, ctypes.c_void_p).value or 0 for f in functions)
        return (paged, write) if paged and write else None

    def step(
        self,
        metadata: object,
        cos: torch.Tensor,
        sin: torch.Tensor,
        x: torch.Tensor,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> cpu_ops.LayerStepSpec | None:
        """The step's part of the fused layers' arguments (``local``: the cos/sin of sliding
        layers with their own rotary), or None where they do not apply."""
        grouped = isinstance(metadata, GroupedMetadata)
        full = metadata.full if isinstance(metadata, GroupedMetadata) else metadata
        queries = getattr(full, "queries", None)
        window = None
        if isinstance(metadata, GroupedMetadata):
            window = getattr(metadata.window, "queries", None)
        if queries is None or (grouped and window is None):
            return None
        if torch.is_grad_enabled() or not self.applies():
            return None
        layers, dtype = self._layer_list(), self.model.dtype
        # every layer of a cache group has caches of one shape: its first stands for it
        sliding = next((layer for layer in layers if layer.window), None)
        full_layer = next((layer for layer in layers if not layer.window), None)
        groups = ((full_layer, queries), (sliding, queries if window is None else window))
        for layer, mine in groups:  # each group's queries against its own cache
            if layer is None:
                continue
            cache = layer.kv_cache
            if cache is None or cache[0].dtype != dtype or x.dtype != dtype:
                return None
            if mine.max_slot >= cache[0].shape[0] * cache[0].shape[1]:
                raise IndexError(f"KV slot {mine.max_slot} is outside the cache")
        if queries.tree is not None and sliding is not None:
            raise ValueError("tree-shaped queries cannot attend a sliding window")
        assert self._kernels is not None
        block = layers[0].kv_cache[0].shape[1]  # type: ignore[index]
        spec = _step_spec(cast(KernelQueries, queries), cos, sin, x, block, self._kernels)
        if local is not None:
            spec.cos_local, spec.sin_local = local[0].data_ptr(), local[1].data_ptr()
        if window is not None:
            tables, stride = window.sequence_args[3:5]
            spec.window_slots, spec.window_tables, spec.window_bt_stride = (
                window.slots_pointer,
                tables,
                stride,
            )
        return spec

    def run(self, step: cpu_ops.LayerStepSpec, x: torch.Tensor) -> torch.Tensor:
        """Every layer on the residual stream ``x``; the stream after the last one."""
        x = x.contiguous()
        if self._layers is None:
            dtype = self.model.dtype
            self._layers = [_layer_spec(layer, dtype) for layer in self._layer_list()]
        for spec in self._layers:
            cpu_ops.decoder_layer(spec, step, x)
        return x


def _parts(layer: FusedLayer, dtype: torch.dtype) -> list[FusedPart] | None:
    """The layer's four linears' fused parts, or None where one has none for ``dtype``
    activations (or the bfloat16 call lacks one of its features)."""
    if dtype == torch.bfloat16 and not layer.plain:
        return None
    parts = [form.fused_part() for form in layer.forms]
    if any(part is None or part.activation != dtype for part in parts):
        return None
    return cast(list[FusedPart], parts)


def _step_spec(
    queries: KernelQueries,
    cos: torch.Tensor,
    sin: torch.Tensor,
    x: torch.Tensor,
    block: int,
    kernels: tuple[int, int],
) -> cpu_ops.LayerStepSpec:
    q_start, q_len, seq_len, tables, table_stride, tree, tree_stride, num_seqs = (
        queries.sequence_args
    )
    attention, write = kernels
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
        attention=attention,
        write=write,
    )


def _layer_spec(layer: FusedLayer, dtype: torch.dtype) -> cpu_ops.LayerSpec:
    """The fused layer's arguments for ``layer`` (every form with a kernel, its cache bound)."""
    assert layer.kv_cache is not None
    parts = _parts(layer, dtype)
    assert parts is not None, "applies() checked every form"
    qkv, o, gate_up, down = (cpu_ops.QuantLinearSpec(p.linear, p.kind, p.data) for p in parts)
    return cpu_ops.LayerSpec(
        norm1=layer.norm1.data_ptr(),
        norm2=layer.norm2.data_ptr(),
        eps=layer.eps,
        scale=layer.scale,
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        qkv_bias=None if layer.qkv_bias is None else layer.qkv_bias.data_ptr(),
        hidden=layer.norm1.shape[0],
        heads=layer.heads,
        kv_heads=layer.kv_heads,
        head_dim=layer.head_dim,
        intermediate=layer.intermediate,
        block_size=layer.kv_cache[0].shape[1],
        key_cache=layer.kv_cache[0].data_ptr(),
        value_cache=layer.kv_cache[1].data_ptr(),
        q_norm=_pointer(layer.q_norm),
        k_norm=_pointer(layer.k_norm),
        post_attn=_pointer(layer.post_attn),
        post_mlp=_pointer(layer.post_mlp),
        rotary_dim=layer.head_dim if layer.rotary_dim is None else layer.rotary_dim,
        window=layer.window or 0,
        softcap=layer.softcap or 0.0,
        gelu=int(layer.gelu),
        local_rope=int(layer.local_rope),
    )


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
