"""Soft labels: the target's next-token distribution at every corpus position, top-K kept.

The target scores whole sequences (dense causal attention, no cache). Its distribution is
restricted to the draft's vocabulary and its K most likely entries are stored (draft row ids as
int16, probabilities as float16) in safetensors shards of ``SHARD_SEQUENCES`` sequences each,
named after the corpus part they score. Each shard records a digest of what it scored (token ids,
draft vocabulary, K): an existing shard with the same digest is reused, so an interrupted run
resumes and a grown corpus only scores its new sequences; any other is scored again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specbatch.kernels.attention.dense_causal import DenseCausalMetadata
from specbatch.models.llama import LlamaForCausalLM

SHARD_SEQUENCES = 256


@dataclass
class SoftLabels:
    """One shard: sequences concatenated, with per-position top-K teacher probabilities."""

    input_ids: torch.Tensor  # [total] int32 (target ids)
    topk_ids: torch.Tensor  # [total, K] int16 (draft rows)
    topk_probs: torch.Tensor  # [total, K] float16
    lengths: torch.Tensor  # [S] int32

    def sequences(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        out, start = [], 0
        for n in self.lengths.tolist():
            out.append(
                (
                    self.input_ids[start : start + n],
                    self.topk_ids[start : start + n],
                    self.topk_probs[start : start + n],
                )
            )
            start += n
        return out


def dense_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length so that ``len(group) * longest <= max_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def run_dense(model: LlamaForCausalLM, rows: list[list[int]], pad: int = 0) -> torch.Tensor:
    """Logits ``[B, L, vocab]`` of right-padded rows (padding never influences real tokens)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    positions = torch.arange(width).repeat(len(rows))
    hidden = model(ids.view(-1), positions, DenseCausalMetadata(len(rows), width))
    return model.compute_logits(hidden).view(len(rows), width, -1)


def score_corpus(
    teacher: LlamaForCausalLM,
    sequences: list[list[int]],
    token_map: list[int],
    work: Path,
    top_k: int,
    max_tokens: int,
    part: str = "shard",
) -> list[Path]:
    """Write (or reuse) the soft-label shards ``teacher/{part}-NNNNN`` of ``sequences``, scored
    by ``teacher``; returns their paths."""
    columns = torch.tensor(token_map, dtype=torch.long)

    def score(start: int, chunk: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        labels: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.empty(0),) * 2] * len(chunk)
        for group in dense_batches([len(s) for s in chunk], max_tokens):
            with torch.no_grad():
                logits = run_dense(teacher, [chunk[i] for i in group])
                dist = logits.float().softmax(-1).index_select(-1, columns)
                top_p, top_i = dist.topk(top_k, dim=-1)
            for row, i in enumerate(group):
                n = len(chunk[i])
                labels[i] = top_i[row, :n].to(torch.int16), top_p[row, :n].half()
        return labels

    return _write_shards(sequences, token_map, work, top_k, part, score)


def label_shards(
    sequences: list[list[int]],
    labels: list[tuple[torch.Tensor, torch.Tensor]],
    token_map: list[int],
    work: Path,
    top_k: int,
    part: str,
) -> list[Path]:
    """Soft-label shards made from labels stored at generation time (``corpus.position_labels``:
    the target's top log-probabilities over its whole vocabulary) instead of a teacher pass:
    restricted to the draft vocabulary, the ``top_k`` most likely kept."""
    target_to_draft = torch.full((max(token_map) + 1,), -1, dtype=torch.long)
    target_to_draft[torch.tensor(token_map)] = torch.arange(len(token_map))

    def restrict(start: int, chunk: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for seq, (target_ids, logprobs) in zip(
            chunk, labels[start : start + len(chunk)], strict=True
        ):
            target_ids = target_ids[: len(seq)].long()
            known = target_ids < len(target_to_draft)
            rows = torch.where(
                known, target_to_draft[target_ids.clamp_max(len(target_to_draft) - 1)], -1
            )
            p = logprobs[: len(seq)].float().exp().masked_fill(rows < 0, 0.0)
            p, order = p.topk(min(top_k, p.shape[1]), dim=-1)
            rows = rows.gather(-1, order).clamp_min(0)
            if p.shape[1] < top_k:  # fewer stored than asked: pad with zero probability
                pad = top_k - p.shape[1]
                p = torch.cat([p, p.new_zeros(len(p), pad)], -1)
                rows = torch.cat([rows, rows.new_zeros(len(rows), pad)], -1)
            out.append((rows.to(torch.int16), p.half()))
        return out

    return _write_shards(sequences, token_map, work, top_k, part, restrict)


ChunkLabels = Callable[[int, list[list[int]]], list[tuple[torch.Tensor, torch.Tensor]]]


def _write_shards(
    sequences: list[list[int]],
    token_map: list[int],
    work: Path,
    top_k: int,
    part: str,
    chunk_labels: ChunkLabels,
) -> list[Path]:
    """Shards ``teacher/{part}-NNNNN`` of ``SHARD_SEQUENCES`` rows each: one whose stored digest
    matches is kept, any other gets ``chunk_labels(start, rows)`` (per row: top-K draft ids and
    probabilities) and is written atomically (a temporary file renamed)."""
    directory = work / "teacher"
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    starts = range(0, len(sequences), SHARD_SEQUENCES)
    for number, start in enumerate(tqdm(starts, desc=f"{part} shards")):
        path = directory / f"{part}-{number:05d}.safetensors"
        paths.append(path)
        chunk = sequences[start : start + SHARD_SEQUENCES]
        digest = shard_digest(chunk, token_map, top_k)
        if path.exists() and _stored_digest(path) == digest:
            continue
        ids, probs = zip(*chunk_labels(start, chunk), strict=True)
        tensors = {
            "input_ids": torch.tensor([t for s in chunk for t in s], dtype=torch.int32),
            "topk_ids": torch.cat(ids),
            "topk_probs": torch.cat(probs),
            "lengths": torch.tensor([len(s) for s in chunk], dtype=torch.int32),
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"digest": digest})
        tmp.replace(path)
    return paths


def shard_digest(chunk: list[list[int]], token_map: list[int], top_k: int) -> str:
    """What a shard's labels depend on besides the teacher: its rows, the vocabulary, K."""
    h = hashlib.sha256(f"{top_k}:{len(chunk)}".encode())
    h.update(torch.tensor(token_map, dtype=torch.int64).numpy().tobytes())
    for row in chunk:
        h.update(torch.tensor([len(row), *row], dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _stored_digest(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("digest")
    except Exception:  # an unreadable shard (e.g. cut short) is simply scored again
        return None


def load_shards(paths: list[Path]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    sequences = []
    for path in paths:
        sequences += SoftLabels(**load_file(str(path))).sequences()
    return sequences
