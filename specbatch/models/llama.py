"""The causal LM of every family (Llama 2/3, SmolLM2, Mistral, Qwen2, Gemma 2/3, Qwen3,
Qwen2/3-MoE, Phi-3: ``models/families.py``) over a flat ragged batch and a paged cache; its
layers are ``models/layers.py``'s.

Parameter names follow HF transformers so checkpoints map one to one, except that q/k/v and
gate/up projections are fused into one matrix each (fewer, larger matmuls); ``load_weights`` packs
the HF shards into them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn

from specbatch.errors import ModelLoadError
from specbatch.kernels.attention import AttentionBackend, LayerKVCache
from specbatch.kernels.block_forms import (
    BlockForm,
    RepackedForm,
    block_form,
    holds_blocks,
    q8_0_form,
    stacked_blocks,
)
from specbatch.kernels.fused_layers import FusedLayer, FusedLayers
from specbatch.kernels.linear import Linear, packed_form, packing_supported
from specbatch.kernels.onednn import OneDnnWeight, measure_row_padding
from specbatch.kernels.sgemm import SgemmWeight
from specbatch.kernels.weight_forms import DenseForm, WeightForm
from specbatch.models.config import ModelConfig, RopeScaling
from specbatch.models.layers import LlamaDecoderLayer, RMSNorm
from specbatch.models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from specbatch.models.tensor_parallel import TensorParallel


class QuantizedEmbedding(nn.Module):
    """A token embedding kept as GGUF blocks: a lookup dequantises only the rows it takes."""

    def __init__(self, form: BlockForm) -> None:
        super().__init__()
        self.form = form

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.form.rows(input_ids)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        shape = (config.vocab_size, config.hidden_size)
        weight = torch.empty(shape)
        # On the meta device (the loader's first pass) the random init would import
        # torch._dynamo (and Triton, where installed) for nothing: skip it there only, so a model
        # built for training (a distilled student) draws its init from the RNG as before.
        self.embed_tokens = nn.Embedding(*shape, _weight=weight if weight.is_meta else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# A tied head's packed forms: MKL's (float32) or oneDNN's, never AMX tiles (TileWeight was
# 0.34x of oneDNN on the LM head at 256 rows, kernels/amx_linear.py).
_TIED_HEAD_FORMS = (SgemmWeight, OneDnnWeight)

# HF checkpoint shard name (its last part: an expert's too) -> (fused name, shard index)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM: ``forward`` gives hidden states, ``compute_logits`` logits."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend)
        self.rotary = RotaryEmbedding(config)
        # sliding layers with their own rotary base (Gemma 3), unscaled
        self.local_rotary = (
            RotaryEmbedding(
                config.replace(
                    rope_theta=config.rope_local_theta,
                    rope_scaling=RopeScaling(),
                    rope_freq_factors=None,
                )
            )
            if config.rope_local_theta is not None
            else None
        )
        # A tied LM head is a Linear sharing the embedding's form (dense: its very parameter).
        tied = DenseForm(self.model.embed_tokens) if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, form=tied)
        self.fused = FusedLayers(self)
        self._token_maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # Under tensor parallelism (``specbatch.parallel``): the shapes this rank holds (``config``
        # is then the whole model's) and the collectives joining the ranks' parts.
        self.local_config = config
        self.tp: TensorParallel | None = None

    def shard_over(self, tp: TensorParallel) -> None:
        """Make this rank's slice of a model (built with the slice's shapes, weights loaded)
        compute the whole model with the other ranks: ``config`` becomes the whole model's."""
        self.local_config, self.config = self.config, tp.plan.config
        self.tp = tp
        tp.install(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def cache_bytes_per_block(self, block_size: int) -> int:
        """What its paged cache takes per block of ``block_size`` tokens (this rank's heads):
        what a cache sized for it, as a draft beside a target, must reserve."""
        return self.local_config.kv_bytes_per_token(self.dtype) * block_size

    def bind_kv_caches(self, kv_caches: list[LayerKVCache]) -> None:
        """Give each layer its ``(key_cache, value_cache)`` pair of the paged cache."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"expected {len(self.model.layers)} layer caches, got {len(kv_caches)}"
            )
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            cast(LlamaDecoderLayer, layer).self_attn.kv_cache = cache
        self.fused.forget_layers()  # they point into the caches

    def kv_caches(self) -> list[LayerKVCache]:
        """Each layer's bound ``(key_cache, value_cache)``."""
        caches = [cast(LlamaDecoderLayer, layer).self_attn.kv_cache for layer in self.model.layers]
        if any(cache is None for cache in caches):
            raise RuntimeError("the model has no KV cache bound")
        return [cache for cache in caches if cache is not None]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: object
    ) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` for a flat ragged batch of ``T`` tokens.

        ``input_ids`` are always target-vocabulary ids (a reduced-vocabulary draft maps them).
        """
        if self.config.token_map is not None:
            input_ids = self._maps(input_ids.device)[0][input_ids]
        if self.tp is not None:
            x = self.tp.embed(self.model.embed_tokens, input_ids)
        else:
            x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:  # in x's dtype, as HF's Gemma
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        local = None if self.local_rotary is None else self.local_rotary.cos_sin(positions, x.dtype)
        step = self.fused.step(metadata, cos, sin, x, local) if self.tp is None else None
        if step is not None:  # every layer in one C call each (same bits as the loop below)
            return self.model.norm(self.fused.run(step, x))
        for layer in self.model.layers:
            if local is not None and cast(LlamaDecoderLayer, layer).local_rope:
                x = layer(x, *local, metadata)
            else:
                x = layer(x, cos, sin, metadata)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for the given hidden-state rows only."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def fused_layers(self) -> list[FusedLayer]:
        """Every decoder layer as the fused CPU call takes it (``kernels.fused_layers``); none
        where a layer has a feature the call lacks."""
        layers = [cast(LlamaDecoderLayer, layer) for layer in self.model.layers]
        if not all(layer.fusable for layer in layers):
            return []
        return [layer.fused_layer() for layer in layers]

    def weight_forms(self) -> list[WeightForm]:
        """Every weight form held, in module order, each once (a tied head shares the
        embedding's)."""
        forms = {
            id(m.form): m.form for m in self.modules() if isinstance(m, Linear | QuantizedEmbedding)
        }
        return list(forms.values())

    def weight_bytes(self) -> int:
        """Bytes of weights held: parameters (dense forms' weights among them) and every other
        form's own bytes."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total + sum(form.nbytes for form in self.weight_forms())

    def logits_in_output_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary: a reduced-vocabulary draft's rows scattered to their
        target ids, every other id at -inf (probability 0); unchanged for other models."""
        if self.config.token_map is None:
            return logits
        _, draft_to_target = self._maps(logits.device)
        out = logits.new_full((logits.shape[0], self.config.output_vocab_size), float("-inf"))
        # scatter_ along rows: ~2x faster than advanced-index assignment at 8 rows
        columns = draft_to_target.expand(logits.shape[0], len(draft_to_target))
        return out.scatter_(1, columns, logits[:, : len(draft_to_target)])

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(target id -> draft row, draft row -> target id) for a reduced-vocabulary draft."""
        if device not in self._token_maps:
            assert self.config.token_map is not None
            assert self.config.target_vocab_size is not None
            draft_to_target = torch.tensor(self.config.token_map, dtype=torch.long)
            other = len(draft_to_target)
            target_to_draft = torch.full((self.config.target_vocab_size,), other, dtype=torch.long)
            target_to_draft[draft_to_target] = torch.arange(other)
            self._token_maps[device] = (target_to_draft.to(device), draft_to_target.to(device))
        return self._token_maps[device]

    def pack_for_cpu(self) -> bool:
        """Re-lay every dense linear weight out in its packed form (inference only; see
        ``kernels.linear``); a model whose layer forms all have C kernels runs them fused
        (``kernels.fused_layers``).

        Returns False, changing nothing, where packing is unsupported (float16, no oneDNN).
        """
        if self.device.type != "cpu" or not packing_supported(self.dtype):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        head = self.lm_head.form
        if isinstance(head, DenseForm) and head.owner is self.model.embed_tokens:
            self.lm_head.use_form(packed_form(head.weight.detach(), _TIED_HEAD_FORMS))
        self._measure_row_padding()
        self.fused.reconsider()
        return True

    def quantize_for_cpu(self) -> None:
        """Hold every linear weight (and a tied embedding, which is also the LM head) as Q8_0
        blocks multiplied by the GGUF kernel, as a file's Q8_0 matrices are: for a float32
        model on the CPU (a draft under a target of GGUF blocks, see ``spec_decode.factory``).
        Quantized with ggml's rounding (``gguf_linear.quantize_q8_0``), so deterministic."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ValueError(
                f"Q8_0 blocks hold a float32 model on the CPU, not {self.dtype} on {self.device}"
            )
        for module in self.modules():
            if isinstance(module, Linear) and module.weight is not None:
                module.use_form(q8_0_form(module.weight))
        embedding = self.model.embed_tokens
        if self.config.tie_word_embeddings and isinstance(embedding, nn.Embedding):
            self._use_embedding_form(q8_0_form(embedding.weight))
        self.fused.reconsider()

    def quantized_digest(self) -> str:
        """sha256 over every Q4_1/Q8_0 weight's dequantised float32 values (what
        :meth:`quantize_for_cpu` makes), in module order (the tied head once): the same
        whichever form holds the blocks."""
        digest = hashlib.sha256()
        for form in self.weight_forms():
            if isinstance(form, RepackedForm):
                digest.update(form.dequantize().numpy().tobytes())
        return digest.hexdigest()

    def layer_linears(self) -> list[Linear]:
        """Every linear of every decoder layer."""
        return [m for m in self.model.layers.modules() if isinstance(m, Linear)]

    def multiplies_blocks(self) -> bool:
        """Whether every linear of every decoder layer multiplies GGUF blocks."""
        return all(holds_blocks(m.form) for m in self.layer_linears())

    def _measure_row_padding(self) -> None:
        """Give every oneDNN-packed product the row padding measured on this model's own
        products."""
        forms = [f for f in self.weight_forms() if isinstance(f, OneDnnWeight)]
        if not forms:
            return
        for form in forms:  # measured as they are, unpadded
            form.padding = ()
        with torch.no_grad():
            padding = measure_row_padding(
                [f.multiply for f in forms], [f.in_features for f in forms], self.dtype
            )
        for form in forms:
            form.padding = padding

    def use_quantized_weights(self, weights: Iterable[tuple[str, str, np.ndarray]]) -> set[str]:
        """Keep the matrices given as GGUF blocks (``(hf_name, ggml type, raw rows)``, see
        ``gguf_checkpoint.iter_gguf_quantized``) as stored and multiply with them as they are
        (``kernels.block_forms``); the plain weights they replace are dropped (on a model still
        on the meta device, they are never allocated). A fused projection whose shards come in
        different types is a stack of their forms; one missing a shard stays plain. Returns the
        HF names of the tensors now held as blocks; a tensor whose bytes are not whole rows of
        blocks is a ``ModelLoadError`` naming it."""
        shards: dict[str, dict[int, tuple[str, str, np.ndarray]]] = {}
        whole: set[str] = set()
        for name, kind, raw in weights:
            target, shard = self._target_of(name)
            # a fused tensor in the file (Phi-3's qkv): its one part stands for every shard
            index = 0 if shard is None else shard
            shards.setdefault(target, {})[index] = (name, kind, raw)
            if shard is None:
                whole.add(target)
        modules = dict(self.named_modules())
        replaced: set[str] = set()
        for target, parts in shards.items():
            module = modules.get(target.removesuffix(".weight"))
            ordered = [parts[i] for i in sorted(parts)]
            try:
                if target == "model.embed_tokens.weight":
                    (_, kind, raw), hidden = ordered[0], self.config.hidden_size
                    self._use_embedding_form(block_form(kind, raw, hidden))
                elif isinstance(module, Linear) and (
                    target in whole or len(parts) == self._num_shards(target)
                ):
                    blocks = [(kind, raw) for _, kind, raw in ordered]
                    module.use_form(stacked_blocks(blocks, module.in_features))
                else:
                    continue
            except ValueError as exc:
                raise ModelLoadError(f"tensor {ordered[0][0]!r}: {exc}") from None
            replaced.update(name for name, _, _ in ordered)
        self.fused.reconsider()
        return replaced

    def _use_embedding_form(self, form: BlockForm) -> None:
        """Look tokens up in ``form``, which a tied LM head shares."""
        self.model.embed_tokens = QuantizedEmbedding(form)  # type: ignore[assignment]
        if self.config.tie_word_embeddings:
            self.lm_head.use_form(form)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]], source: str) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be covered.

        ``weights`` yields ``(name, tensor, file)``; ``source`` names the checkpoint in the error
        about missing tensors.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set[int]] = {}
        for name, tensor, origin in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied checkpoints sometimes store the copy anyway
            target, shard = self._target_of(name)
            if target not in params:
                raise ModelLoadError(f"{origin}: unexpected tensor {name!r} for this architecture")
            param = params[target]
            destination = param.data if shard is None else self._shard_view(target, param, shard)
            if tuple(tensor.shape) != tuple(destination.shape):
                raise ModelLoadError(
                    f"{origin}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            whole = range(self._num_shards(target)) if shard is None else (shard,)
            loaded.setdefault(target, set()).update(whole)  # a fused file tensor: every shard
        missing = [n for n in params if len(loaded.get(n, ())) < self._num_shards(n)]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"{source}: missing {len(missing)} tensor(s): {shown}")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF names, fused matrices split back (inverse of load_weights)."""
        out: dict[str, torch.Tensor] = {}
        shard_names: dict[str, dict[int, str]] = {}
        for hf_part, (fused_part, index) in _FUSED_SHARDS.items():
            shard_names.setdefault(fused_part, {})[index] = hf_part
        for name, param in self.named_parameters():
            stem, _, kind = name.rpartition(".")
            prefix, _, part = stem.rpartition(".")
            if part not in shard_names:
                out[name] = param.detach()
                continue
            for index, piece in enumerate(param.detach().split(self._shard_sizes(name), dim=0)):
                out[f"{prefix}.{shard_names[part][index]}.{kind}"] = piece
        return out

    @staticmethod
    def _target_of(name: str) -> tuple[str, int | None]:
        """The (fused) parameter an HF tensor goes to, and its shard index there (None: the
        whole parameter): ``...self_attn.k_proj.weight`` is shard 1 of ``...qkv_proj``."""
        stem, _, kind = name.rpartition(".")
        prefix, _, part = stem.rpartition(".")
        if part in _FUSED_SHARDS:
            fused, index = _FUSED_SHARDS[part]
            return f"{prefix}.{fused}.{kind}", index
        return name, None

    def _shard_view(self, target: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        sizes = self._shard_sizes(target)
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])

    def _shard_sizes(self, target: str) -> list[int]:
        c = self.local_config
        if ".qkv_proj." in target:
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        mlp = self.get_submodule(target.rsplit(".", 2)[0])  # an MLP: an expert's has its size
        size = int(getattr(mlp, "intermediate_size", c.intermediate_size))
        return [size, size]

    def _num_shards(self, target: str) -> int:
        fused = ".qkv_proj." in target or ".gate_up_proj." in target
        return len(self._shard_sizes(target)) if fused else 1
