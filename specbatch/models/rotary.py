"""Rotary position embeddings (half-split layout, as HF Llama), with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import torch

from specbatch.models.config import ModelConfig


def rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies ``[rotary_dim / 2]`` in float32, after any scaling (the
    rotated dimensions: all of a head but for a partial rotary)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scaled(
            inv_freq,
            scaling.factor,
            scaling.low_freq_factor,
            scaling.high_freq_factor,
            scaling.original_max_position_embeddings,
        )
    if config.rope_freq_factors is not None:
        # GGUF files of Llama-3.x carry the scaling as precomputed per-frequency divisors.
        # On the CPU like inv_freq: the loader builds the model under a meta-device context.
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
        inv_freq = inv_freq / factors
    return inv_freq


def _llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, old_context: int
) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes cos/sin for a step's positions once; every layer reuses them.

    On the CPU they are rows of a table of every position so far (grown by doubling, per
    dtype): the seven torch calls for one position took 40 us alone and 0.16 ms a step in a
    batch-1 gguf engine (of ~10.5), the lookup 11 us alone. Its memory: the cos and sin of
    every position up to twice the largest seen, head_dim values each (float32: 4 MB for
    SmolLM2's head_dim 64 at 8K positions, 128 MB for head_dim 128 at 128K). The table's rows
    are the direct computation's (``compute``, element by element the same operations; a test
    compares them). An accelerator computes them directly (the same under CUDA graphs' capture)."""

    def __init__(self, config: ModelConfig) -> None:
        self._inv_freq_cpu = rotary_inv_freq(config)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, head_dim]`` cos and sign-folded sin for flat token positions ``[T]``."""
        if positions.device.type != "cpu" or not positions.numel():
            return self.compute(positions, dtype)
        cos, sin = self._tables.get(dtype, (None, None))
        last = int(positions.max())
        if cos is None or sin is None or last >= len(cos):
            size = max(1024, 2 * (0 if cos is None else len(cos)), last + 1)
            cos, sin = self._tables[dtype] = self.compute(torch.arange(size), dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def compute(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` computed for these positions (the table's rows, and the reference)."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(positions.device)
            self._inv_freq[positions.device] = inv_freq
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        # Folding the sign of rotate-half into sin makes the rotation 3 ops (see apply_rotary).
        cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``: first half paired with second half (HF layout).

    ``x * cos + swap_halves(x) * sin`` with ``sin`` already carrying rotate-half's sign.
    """
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)
