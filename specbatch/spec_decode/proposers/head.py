"""A draft head on the target's own features (EAGLE family), and the drafting network it is.

The head predicts the target's next final-norm hidden state from the one before it: at position
``p`` it reads the embedding of token ``p`` (the target's own embedding) and the target's feature
at ``p - 1``, both RMS-normed and joined by one projection, then runs one decoder layer of the
target's shape over its own paged cache and a final norm. Its output stands in for the target's
feature at ``p``: the head's output layer (a reduced vocabulary, ``token_map`` to target ids)
turns it into the next token's distribution, and the next draft position reads it as its
feature. The head never re-reads the prompt with the target: the engine hands it the features
the target computed for every token it ran (``observe_features``), and the head catches up on
those rows (one layer, no output layer but at the last row) before its first draft.

Its cache lives on the target's block ids (one allocation governs all, as for a draft model).
Rows at draft positions read the head's own features, so after a verify its valid prefix ends
at the first draft position (``on_verified``): the accepted tokens are recomputed next step
with the target's real features, as EAGLE does (``HeadNetwork.keeps_drafts``). Trees are
EAGLE-2's dynamic trees by default (``drafting.NetworkProposer``, one head forward per level
through ``level_logits``), or leaf siblings with ``draft_tree_kind="siblings"``.

A head directory is ``config.json`` (``"architectures": ["EagleHead"]``, the layer's shape,
the token map) plus ``model.safetensors``; ``save_head`` writes one, ``load_head`` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specbatch.cache.kv_tensors import allocate_kv_caches, lazy_zeros
from specbatch.errors import ConfigError, ModelLoadError
from specbatch.kernels.attention import AttentionBackend, LayerKVCache
from specbatch.kernels.linear import Linear, packing_supported
from specbatch.models.config import ModelConfig
from specbatch.models.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm
from specbatch.models.rotary import RotaryEmbedding
from specbatch.runner.flat_batch import TokenRun, cache_slots, flatten
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.draft_trees import TreeLevel
from specbatch.spec_decode.proposers.drafting import DraftNetwork

HEAD_ARCHITECTURE = "EagleHead"
# the target's shape fields a head must match (its layer has the target's shape)
_SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


class EagleHead(nn.Module):
    """``forward(ids, positions, features, metadata)`` -> the head's features; ``compute_logits``
    over its reduced vocabulary; ``logits_in_output_vocab`` scatters them to target ids."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        if config.token_map is None or config.target_vocab_size is None:
            raise ModelLoadError("a draft head needs a token map and the target's vocabulary size")
        self.config = config
        self.backend = backend
        hidden = config.hidden_size
        self.embed_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.feature_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, backend)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = Linear(hidden, len(config.token_map), bias=False)
        self.rotary = RotaryEmbedding(config)
        # the target's token embedding, not the head's own (attach_target): kept out of the
        # module tree so it is neither saved nor trained with the head
        self._embed: list[nn.Module] = []
        self._draft_to_target: dict[torch.device, torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def cache_bytes_per_block(self, block_size: int) -> int:
        """What it keeps per cache block of ``block_size`` tokens: its layer's keys and values
        and its store of the target's features."""
        features = block_size * self.config.hidden_size * self.dtype.itemsize
        return self.config.kv_bytes_per_token(self.dtype) * block_size + features

    def attach_target(self, target: LlamaForCausalLM) -> None:
        """Embed tokens with ``target``'s embedding (the head must have been made for it)."""
        check_head_fits(self.config, target.config)
        self._embed = [target.model.embed_tokens]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self._embed:
            raise RuntimeError("the head has no target embedding attached (attach_target)")
        return self._embed[0](input_ids).to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """The head's features ``[T, hidden]``: row ``i`` from token ``input_ids[i]`` at
        ``positions[i]`` and the (target's or head's) feature of the position before it."""
        joined = torch.cat(
            [self.embed_norm(self.embed(input_ids)), self.feature_norm(features.to(self.dtype))],
            dim=-1,
        )
        x = self.fc(joined)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return self.norm(self.layer(x, cos, sin, metadata))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary (``token_map`` order) for the given rows."""
        return self.lm_head(hidden)

    def logits_in_output_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary, every id outside the head's at -inf."""
        assert self.config.target_vocab_size is not None
        assert self.config.token_map is not None
        index = self._draft_to_target.get(logits.device)
        if index is None:
            index = torch.tensor(self.config.token_map, dtype=torch.long, device=logits.device)
            self._draft_to_target[logits.device] = index
        out = logits.new_full((logits.shape[0], self.config.target_vocab_size), float("-inf"))
        out[:, index] = logits
        return out

    def bind_kv_caches(self, kv_caches: list[LayerKVCache]) -> None:
        if len(kv_caches) != 1:
            raise ValueError(f"a draft head has one layer cache, got {len(kv_caches)}")
        self.layer.self_attn.kv_cache = kv_caches[0]

    def kv_caches(self) -> list[LayerKVCache]:
        cache = self.layer.self_attn.kv_cache
        if cache is None:
            raise RuntimeError("the head has no KV cache bound")
        return [cache]

    def pack_for_cpu(self) -> bool:
        """Packed layouts for the linear weights (inference only, as ``LlamaForCausalLM``'s)."""
        if self.device.type != "cpu" or not packing_supported(self.dtype):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        return True

    def head_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def head_config(target: ModelConfig, token_map: list[int] | tuple[int, ...]) -> ModelConfig:
    """A head's config for ``target``: one layer of its shape (full attention and a dense MLP,
    whatever the target's layers are), the reduced vocabulary."""
    return target.replace(
        num_hidden_layers=1,
        vocab_size=len(token_map) + 1,
        token_map=tuple(int(t) for t in token_map),
        target_vocab_size=target.vocab_size,
        tie_word_embeddings=False,
        layer_types=(),
        num_experts=0,
        sparse_layers=(),
    )


def check_head_fits(head: ModelConfig, target: ModelConfig) -> None:
    """Refuse a head made for a target of another shape or vocabulary size."""
    wrong = [f for f in _SHAPE_FIELDS if getattr(head, f) != getattr(target, f)]
    if head.target_vocab_size != target.vocab_size:
        wrong.append("vocab_size")
    if wrong:
        details = ", ".join(
            f"{f} {getattr(head, f) if f != 'vocab_size' else head.target_vocab_size} vs "
            f"{getattr(target, f)}"
            for f in wrong
        )
        raise ConfigError(f"the draft head was made for another target ({details})")


def is_head_dir(path: Path) -> bool:
    """Whether ``path`` is a head directory (its config names the head architecture)."""
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("architectures") == [HEAD_ARCHITECTURE]


def save_head(head: EagleHead, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """``config.json`` + ``model.safetensors`` (weights in ``dtype``)."""
    directory.mkdir(parents=True, exist_ok=True)
    c = head.config
    raw: dict[str, Any] = {
        "architectures": [HEAD_ARCHITECTURE],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "target_vocab_size": c.target_vocab_size,
        "token_map": list(c.token_map or ()),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(directory / "model.tmp"))
    (directory / "model.tmp").replace(directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(raw))


def load_head(
    path: Path,
    target: LlamaForCausalLM,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> EagleHead:
    """The head in ``path``, for ``target`` (its shape checked), on the target's device and in
    its dtype unless told otherwise."""
    if not is_head_dir(path):
        raise ModelLoadError(f"{path} is not a draft head directory (config.json names no head)")
    raw = json.loads((path / "config.json").read_text())
    try:
        token_map = [int(t) for t in raw["token_map"]]
        shape = {f: int(raw[f]) for f in _SHAPE_FIELDS}
        target_vocab = int(raw["target_vocab_size"])
        eps = float(raw["rms_norm_eps"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{path}/config.json: a head config field is missing or bad: {exc}"
        ) from None
    if target_vocab != target.config.vocab_size or any(
        shape[f] != getattr(target.config, f) for f in _SHAPE_FIELDS
    ):
        raise ConfigError(
            f"the draft head {path} was made for another target (shape {shape}, vocabulary "
            f"{target_vocab}; the target has {target.config.vocab_size})"
        )
    config = head_config(target.config.replace(rms_norm_eps=eps), token_map)
    head = EagleHead(config, target.backend)
    tensors = load_file(str(path / "model.safetensors"))
    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{path}: head weights missing {missing}, unexpected {unexpected}")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ModelLoadError(
                f"{path}: {name} has shape {tuple(value.shape)}, the head needs "
                f"{tuple(expected[name].shape)}"
            )
    head.load_state_dict(tensors)
    head.to(device=device or target.device, dtype=dtype or target.dtype)
    head.attach_target(target)
    head.eval()
    return head


class HeadNetwork(DraftNetwork):
    """A draft head as a drafting network: its one layer's paged K/V and a store of the
    target's features, both on the target's block ids."""

    keeps_drafts = False  # its rows at draft positions read its own features, not the target's
    wants_features = True

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.block_size = 0
        self._feature_cache = torch.empty(0)
        self._own: dict[int, torch.Tensor] = {}  # seq_id -> the head's last feature this step

    def bind_cache(self, num_blocks: int, block_size: int) -> None:
        head = self.head
        head.bind_kv_caches(
            allocate_kv_caches(head.config, num_blocks, block_size, head.dtype, head.device)
        )
        self.block_size = block_size
        # the target's final-norm hidden state at every cache slot it computed (paged like the
        # K/V, so a prefix-cache hit finds the features of the positions it skips)
        shape = (num_blocks * block_size, head.config.hidden_size)
        if head.device.type == "cpu":  # committed page by page as written, as the K/V
            self._feature_cache = lazy_zeros(shape, head.dtype)
        else:
            self._feature_cache = torch.zeros(shape, dtype=head.dtype, device=head.device)

    def observe_features(
        self, placements: list[tuple[Sequence, int, int]], features: torch.Tensor
    ) -> None:
        """The target computed, per (sequence, first position, count), those positions (some
        perhaps drafts it will reject, whose slots are written again before anything reads
        them) with these final-norm hidden states, rows in order: kept at their cache slots
        (one write per step)."""
        if not placements:
            return
        slots = torch.cat([self._slots(seq, start, count) for seq, start, count in placements])
        self._feature_cache[slots] = features.to(self._feature_cache.dtype)

    def features_at(self, seq: Sequence, start: int, count: int) -> torch.Tensor:
        """The target's features stored for positions ``start .. start + count``."""
        return self._feature_cache[self._slots(seq, start, count)]

    def _slots(self, seq: Sequence, start: int, count: int) -> torch.Tensor:
        positions = np.arange(start, start + count)
        slots = cache_slots(np.asarray(seq.block_table), positions, self.block_size)
        return torch.from_numpy(slots).to(self._feature_cache.device)

    def level_logits(
        self, runs: list[TokenRun], levels: list[TreeLevel], wanted: list[list[int]]
    ) -> torch.Tensor:
        """Each run's first row (the last accepted token) reads the target's feature, a node
        its parent's head output (the catch-up's last for a root); the outputs at the
        ``wanted`` rows are kept for their children's rows."""
        features = []
        for level in levels:
            tree, seq = level.tree, level.seq
            features.append(self._target_features(seq, seq.num_tokens - 1, 1))
            for n in level.order:
                parent = tree.parent[n]
                features.append((self._own[seq.seq_id] if parent < 0 else tree.out[parent])[None])
        hidden = self._head_rows(runs, torch.cat(features))
        picked, first = [], 0
        for level, run, rows in zip(levels, runs, wanted, strict=True):
            for at in rows:
                level.tree.out[level.order[at - 1]] = hidden[first + at]
                picked.append(first + at)
            first += len(run.token_ids)
        index = torch.tensor(picked, dtype=torch.long, device=hidden.device)
        with torch.no_grad():
            rows_out = self.head.compute_logits(hidden.index_select(0, index)).float()
            return self.head.logits_in_output_vocab(rows_out)

    def _head_rows(self, runs: list[TokenRun], features: torch.Tensor) -> torch.Tensor:
        """The head's output features at every row of ``runs`` (trees under their masks)."""
        batch = flatten(runs, self.block_size)
        head = self.head
        with torch.no_grad():
            metadata = head.backend.build_metadata(batch.attention, head.device)
            input_ids = torch.from_numpy(batch.input_ids).to(head.device)
            positions = torch.from_numpy(batch.positions).to(head.device)
            return head(input_ids, positions, features.to(head.device), metadata)

    def draft_logits(self, runs: list[TokenRun], seqs: list[Sequence], step: int) -> torch.Tensor:
        if step == 0:  # the catch-up rows read the target's features
            features = torch.cat(
                [
                    self._target_features(seq, run.start_position, len(run.token_ids))
                    for seq, run in zip(seqs, runs, strict=True)
                ]
            )
        else:  # a draft reads the head's own output of the draft before it
            features = torch.stack([self._own[seq.seq_id] for seq in seqs])
        hidden = self._head_rows(runs, features)
        ends = np.cumsum([len(run.token_ids) for run in runs]) - 1
        last = hidden.index_select(0, torch.from_numpy(ends).to(hidden.device))
        self._own = {seq.seq_id: last[i] for i, seq in enumerate(seqs)}
        with torch.no_grad():
            return self.head.logits_in_output_vocab(self.head.compute_logits(last).float())

    def _target_features(self, seq: Sequence, start: int, count: int) -> torch.Tensor:
        """The features rows ``start .. start + count`` read: the target's at the position
        before each (zeros before position 0)."""
        if start > 0:
            return self.features_at(seq, start - 1, count)
        zero = self._feature_cache.new_zeros(1, self._feature_cache.shape[1])
        if count == 1:
            return zero
        return torch.cat([zero, self.features_at(seq, 0, count - 1)])

    def forget(self, seq: Sequence) -> None:
        self._own.pop(seq.seq_id, None)
