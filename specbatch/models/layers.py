"""The decoder layer of every family (``models/families.py``), over a flat ragged batch and a
paged cache: the Llama block, with the relatives' features switched on by the config.

Parameter names follow HF transformers so checkpoints map one to one, except that q/k/v and
gate/up projections are fused into one matrix each (fewer, larger matmuls). Where Gemma's block
puts norms after attention and the MLP too, its four norms keep HF's names
(``post_attention_layernorm`` is then the post-attention norm, ``pre_feedforward_layernorm``
the MLP's input norm; in the Llama block ``post_attention_layernorm`` is the MLP's input norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbatch.kernels import cpu_ops
from specbatch.kernels.attention import AttentionBackend, GroupedMetadata, LayerKVCache
from specbatch.kernels.fused_layers import FusedLayer
from specbatch.kernels.linear import Linear
from specbatch.models.config import ModelConfig
from specbatch.models.rotary import apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF Llama does (Gemma's ``1 + w`` is
    stored as its sum: ``families.hf_norm_shift``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # CPU inference: one C call where it applies
            fast = cpu_ops.rms_norm(x, self.weight, self.eps)
            if fast is not None:
                return fast
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k norms, rotary embedding (of the leading
    ``rotary_dim`` dimensions), paged attention through the backend (over the layer's sliding
    window, if it has one), output."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.window = config.layer_window(layer)
        self.backend = backend
        self.kv_cache: LayerKVCache | None = None

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: object
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._normed_heads(qkv, self.q_norm, self.k_norm)
        # q and k rotate together: one set of rotary ops per layer instead of two (in place, in
        # one C call, for CPU inference).
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim)
        if torch.is_grad_enabled() or not cpu_ops.rotary_(
            qkv, heads, self.rotary_dim, cos, sin, self.head_dim
        ):
            qk = self._rotated(qk, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if isinstance(metadata, GroupedMetadata):  # its cache group's layout
            metadata = metadata.for_layer(self.window)
        out = self.backend.forward(
            qk[:, : self.num_heads],
            qk[:, self.num_heads :],
            v,
            self.kv_cache,
            metadata,
            window=self.window,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _normed_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
        """``qkv`` with each query and key head normalised over head_dim (Qwen3, Gemma 3)."""
        tokens, dim = qkv.shape[0], self.head_dim
        q = q_norm(qkv[:, : self.q_size].reshape(-1, dim)).view(tokens, self.q_size)
        k = k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, dim))
        return torch.cat([q, k.view(tokens, self.kv_size), qkv[:, self.q_size + self.kv_size :]], 1)

    def _rotated(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rotary(qk, cos, sin)
        rotated = apply_rotary(qk[..., : self.rotary_dim], cos, sin)
        return torch.cat([rotated, qk[..., self.rotary_dim :]], dim=-1)


class LlamaMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU with tanh GELU) with the gate and up projections
    fused."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate_size = size
        self.gelu = config.hidden_act == "gelu_tanh"
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if not torch.is_grad_enabled():  # CPU inference: one C call
            activation = cpu_ops.glu_mul(gate_up, self.intermediate_size, self.gelu)
            if activation is not None:
                return self.down_proj(activation)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        gated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gated * up)


class SparseMoE(nn.Module):
    """Routed experts (Qwen2-MoE, Qwen3-MoE): each token's top-k experts of a softmax over all
    of them (in float32), their outputs weighted and summed in expert order; Qwen2-MoE adds a
    shared expert gated by a sigmoid. A token's sum depends only on its own experts, so a row's
    bits do not depend on its batch-mates where the experts' products do not (the block and
    packed forms)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        size = config.moe_intermediate_size
        self.experts = nn.ModuleList(LlamaMLP(config, size) for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(config, shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts and their weights ``[T, top_k]`` (weights in x's
        dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():  # ascending: every row sums in one order
            rows, slot = torch.nonzero(chosen == expert, as_tuple=True)
            y = self.experts[expert](x.index_select(0, rows)) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class LlamaDecoderLayer(nn.Module):
    """Attention and MLP, each with its input norm and residual add (and, with sandwich
    norms, a norm of its output before the add)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, backend, layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp: LlamaMLP | SparseMoE = (
            SparseMoE(config) if config.layer_sparse(layer) else LlamaMLP(config)
        )
        # a sliding layer of a model whose sliding layers rotate with their own base
        self.local_rope = self.self_attn.window is not None and config.rope_local_theta is not None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: object
    ) -> torch.Tensor:
        if self.sandwich:
            attn = self.self_attn(self.input_layernorm(x), cos, sin, metadata)
            x = x + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(mlp)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))

    @property
    def fusable(self) -> bool:
        """Whether the fused CPU call can run this layer: a dense MLP (not experts)."""
        return isinstance(self.mlp, LlamaMLP)

    def fused_layer(self) -> FusedLayer:
        """This layer as the fused CPU call takes it (only where :attr:`fusable`)."""
        attn, mlp = self.self_attn, self.mlp
        assert isinstance(mlp, LlamaMLP)
        norm2 = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        return FusedLayer(
            norm1=self.input_layernorm.weight,
            norm2=norm2.weight,
            eps=self.input_layernorm.eps,
            scale=attn.backend.scale,
            qkv=attn.qkv_proj.form,
            o=attn.o_proj.form,
            gate_up=mlp.gate_up_proj.form,
            down=mlp.down_proj.form,
            qkv_bias=attn.qkv_proj.bias,
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=mlp.intermediate_size,
            kv_cache=attn.kv_cache,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            post_attn=self.post_attention_layernorm.weight if self.sandwich else None,
            post_mlp=self.post_feedforward_layernorm.weight if self.sandwich else None,
            rotary_dim=attn.rotary_dim,
            window=attn.window,
            softcap=attn.backend.softcap,
            gelu=mlp.gelu,
            local_rope=self.local_rope,
        )
