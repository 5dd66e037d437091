"""Megatron-style tensor parallelism for the Llama family: which slice of each weight a rank
holds, and the collectives that make the sliced model compute the whole one.

Per decoder layer: the fused QKV and gate/up projections are column-parallel (each rank holds
its attention heads' rows and its share of the MLP's rows, and computes them without talking to
anyone), the attention output and down projections row-parallel (each rank multiplies its
columns, one all-reduce sums the parts). Key/value heads are split like the query heads, or
replicated when there are fewer of them than ranks (each rank keeps the one its query heads
share; as vLLM does). The embedding and the LM head are vocabulary-parallel: each rank holds
``ceil(vocab / N)`` rows (the last padded with zeros), a lookup takes the rank's own ids and an
all-reduce adds the others', and logits are all-gathered only for the rows that are sampled or
verified (the model runner asks for those rows alone). Norms and rotary tables are replicated.

Every rank reads each checkpoint tensor and keeps its slice (``shard_weights``): a rank never
holds more than its shard plus the one tensor being sliced.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from specbatch.errors import ConfigError
from specbatch.models.config import ModelConfig
from specbatch.models.shm_collectives import local_group
from specbatch.utils import ceil_div


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world_size`` splitting a model of ``config``."""

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_splittable(self.config, self.world_size)

    @property
    def heads(self) -> int:
        return self.config.num_attention_heads // self.world_size

    @property
    def kv_replicated(self) -> bool:
        return self.config.num_key_value_heads < self.world_size

    @property
    def kv_heads(self) -> int:
        if self.kv_replicated:
            return 1
        return self.config.num_key_value_heads // self.world_size

    @property
    def kv_head_start(self) -> int:
        """The first key/value head this rank holds."""
        if self.kv_replicated:
            return self.rank // (self.world_size // self.config.num_key_value_heads)
        return self.rank * self.kv_heads

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def vocab(self) -> int:
        """Embedding/LM-head rows per rank (the vocabulary padded to a multiple of ranks)."""
        return ceil_div(self.config.vocab_size, self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def local_config(self) -> ModelConfig:
        """The shapes this rank's model is built with."""
        return replace(
            self.config,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab,
        )

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name`` (HF naming)."""
        hd = self.config.head_dim
        stem = name.rsplit(".", 1)[0]
        if stem.endswith("self_attn.q_proj"):
            return tensor.narrow(0, self.rank * self.heads * hd, self.heads * hd)
        if stem.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return tensor.narrow(0, self.kv_head_start * hd, self.kv_heads * hd)
        if stem.endswith("self_attn.o_proj"):
            return tensor.narrow(1, self.rank * self.heads * hd, self.heads * hd)
        if stem.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return tensor.narrow(0, self.rank * self.intermediate, self.intermediate)
        if stem.endswith("mlp.down_proj"):
            return tensor.narrow(1, self.rank * self.intermediate, self.intermediate)
        if stem in ("model.embed_tokens", "lm_head"):
            start = self.vocab_start
            rows = tensor.narrow(0, start, max(0, min(self.vocab, tensor.shape[0] - start)))
            if rows.shape[0] == self.vocab:
                return rows
            padded = tensor.new_zeros((self.vocab, *tensor.shape[1:]))
            padded[: rows.shape[0]] = rows
            return padded
        return tensor

    def shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor, str]]
    ) -> Iterator[tuple[str, torch.Tensor, str]]:
        for name, tensor, origin in weights:
            yield name, self.shard(name, tensor), origin


def check_splittable(config: ModelConfig, world_size: int) -> None:
    """Raise ``ConfigError`` naming what cannot be split ``world_size`` ways."""
    if world_size == 1:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        raise ConfigError(
            f"tensor_parallel_size {world_size} does not divide the model's {heads} attention heads"
        )
    if kv % world_size and world_size % kv:
        raise ConfigError(
            f"tensor_parallel_size {world_size} and the model's {kv} key/value heads: one "
            "must divide the other (heads split, or replicated when fewer than ranks)"
        )
    if config.intermediate_size % world_size:
        raise ConfigError(
            f"tensor_parallel_size {world_size} does not divide the model's intermediate size "
            f"{config.intermediate_size}"
        )


class TensorParallel:
    """The collectives of a sharded model on the default process group."""

    def __init__(self, plan: ShardPlan) -> None:
        self.plan = plan

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        local = local_group()
        if local is not None:  # CPU ranks of one host: through shared memory
            return local.all_reduce(tensor)
        dist.all_reduce(tensor)
        return tensor

    def embed(self, embedding: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the full vocabulary from each rank's slice (zeros for others' ids)."""
        plan = self.plan
        local = input_ids - plan.vocab_start
        mine = (local >= 0) & (local < plan.vocab)
        rows = embedding(torch.where(mine, local, torch.zeros_like(local)))
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        return self.all_reduce(rows)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Each rank's vocabulary columns of the same rows, joined (padding dropped)."""
        local = local_group()
        if local is not None:
            parts = local.all_gather(logits)
        else:
            parts = [torch.empty_like(logits) for _ in range(self.plan.world_size)]
            dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.plan.config.vocab_size]

    def install(self, model: torch.nn.Module) -> None:
        """All-reduce the output of every row-parallel projection."""

        def reduce_output(
            _module: torch.nn.Module, _inputs: object, output: torch.Tensor
        ) -> torch.Tensor:
            return self.all_reduce(output)

        for name, module in model.named_modules():
            if name.endswith(("self_attn.o_proj", "mlp.down_proj")):
                module.register_forward_hook(reduce_output)
