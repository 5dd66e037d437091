"""The distillation loop: match the target's soft labels (forward KL on its top-K), resumable.

Loss per position: cross-entropy of the student's distribution over the draft vocabulary
against the teacher's top-K probabilities renormalised (forward KL up to a constant; DistillSpec
found distribution matching beats plain next-token loss for drafters). Checkpoints hold the
student, the optimizer moments and the step as safetensors plus a JSON file: nothing is pickled.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specbatch.distill.teacher import dense_batches
from specbatch.kernels.attention.dense_causal import DenseCausalMetadata
from specbatch.models.llama import LlamaForCausalLM

Example = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
E = TypeVar("E")


def distillation_loss(student: LlamaForCausalLM, batch: list[Example]) -> torch.Tensor:
    """Mean soft cross-entropy over the real (unpadded) positions of a batch."""
    width = max(len(ids) for ids, _, _ in batch)
    k = batch[0][1].shape[1]
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    top_i = torch.zeros(len(batch), width, k, dtype=torch.long)
    top_p = torch.zeros(len(batch), width, k)
    for row, (seq, labels, probs) in enumerate(batch):
        n = len(seq)
        ids[row, :n] = seq.long()
        top_i[row, :n] = labels.long()
        top_p[row, :n] = probs.float()
    target = top_p / top_p.sum(-1, keepdim=True).clamp_min(1e-8)  # padding rows stay 0
    positions = torch.arange(width).repeat(len(batch))
    hidden = student(ids.view(-1), positions, DenseCausalMetadata(len(batch), width))
    logits = student.compute_logits(hidden)[:, :-1]  # the last row ("other") is never produced
    logprobs = torch.log_softmax(logits.float(), -1).view(len(batch), width, -1)
    per_position = -(target * logprobs.gather(-1, top_i)).sum(-1)
    real = (top_p.sum(-1) > 0).float()
    return (per_position * real).sum() / real.sum().clamp_min(1.0)


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    student: LlamaForCausalLM,
    examples: list[Example],
    steps: int,
    tokens_per_batch: int,
    lr: float,
    checkpoint: Path,
    seed: int,
    save_every: int = 200,
) -> list[float]:
    """Train ``student`` in place for ``steps`` steps (resuming from ``checkpoint`` if there)."""
    return fit(
        student,
        examples,
        [len(e[0]) for e in examples],
        lambda batch: distillation_loss(student, batch),
        steps,
        tokens_per_batch,
        lr,
        checkpoint,
        seed,
        desc="distill",
        save_every=save_every,
        warmup=100,
    )


def fit(
    model: torch.nn.Module,
    examples: Sequence[E],
    lengths: list[int],
    loss_of: Callable[[list[E]], torch.Tensor],
    steps: int,
    tokens_per_batch: int,
    lr: float,
    checkpoint: Path,
    seed: int,
    desc: str,
    save_every: int,
    warmup: int,
) -> list[float]:
    """The loop every trainer here shares: batches of about ``tokens_per_batch`` tokens drawn
    at random, AdamW, warm-up (at most ``warmup`` steps) then cosine, gradient clipping, a
    progress bar, a checkpoint every ``save_every`` steps and at the end; resumes from
    ``checkpoint``. ``model`` is trained in place; the losses of the steps run."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    start = _resume(model, optimizer, checkpoint)
    groups = dense_batches(lengths, tokens_per_batch)
    rng = random.Random(seed)
    order = [rng.randrange(len(groups)) for _ in range(steps)]
    losses: list[float] = []
    model.train()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=desc)
    began = time.monotonic()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup=min(warmup, steps // 10 + 1))
        loss = loss_of([examples[i] for i in groups[order[step]]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
        if (step + 1) % save_every == 0 or step + 1 == steps:
            _save(model, optimizer, checkpoint, step + 1, time.monotonic() - began)
    model.eval()
    return losses


def _save(
    student: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint: Path,
    step: int,
    seconds: float,
) -> None:
    checkpoint.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in student.state_dict().items()}
    state = optimizer.state_dict()
    for index, moments in state["state"].items():
        for key, value in moments.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value).detach().contiguous()
    save_file(tensors, str(checkpoint / "state.tmp"))
    (checkpoint / "state.tmp").replace(checkpoint / "state.safetensors")
    meta = {"step": step, "seconds": seconds, "param_groups": state["param_groups"]}
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def _resume(student: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> int:
    state_path, meta_path = checkpoint / "state.safetensors", checkpoint / "meta.json"
    if not (state_path.exists() and meta_path.exists()):
        return 0
    tensors = load_file(str(state_path))
    meta = json.loads(meta_path.read_text())
    student.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            moments.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": moments, "param_groups": meta["param_groups"]})
    return int(meta["step"])
