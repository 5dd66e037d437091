"""``specbatch train-head``: a draft head (``spec_decode/proposers/head.py``) on the target's
features.

Stages, each resumable (its output in the work directory is reused):

1. **Answers**: the target answers the distillation prompt set (``corpus.generate_answers``:
   half greedy, half T=0.8), storing its top-20 log-probabilities at every position.
2. **Labels**: those restricted to the head's vocabulary (the shipped draft's 8192 tokens for
   the default target, else the most frequent tokens of the answers), top 16 kept
   (``teacher.label_shards``).
3. **Features**: one target prefill over every row (no generation): its final-norm hidden state
   at every position, stored as bfloat16 shards (``features/``).
4. **Training**: at position ``p`` the head reads token ``p`` and the target's feature at
   ``p - 1`` and is trained towards the target's distribution of token ``p + 1`` (forward KL to
   the renormalised top-16 labels) and towards the target's feature at ``p`` (smooth L1,
   ``feature_weight``). With ``unroll`` > 1 the head is run again on its own features of the
   previous pass (each row then reads what the head predicted for the position before it, as
   its second and later drafts do in use), losses weighted 0.8 per pass. AdamW, warm-up then
   cosine; checkpoints as safetensors + JSON (``train._save``).
5. **Report**: on the held-out answers, how often the head's argmax is the target's at the
   answer positions, per draft depth (1: target features; 2: its own), and c, one head decode
   step over one target decode step (batch 1, 256 tokens of context).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.distill.corpus import answered_corpus
from specbatch.distill.pipeline import decode_ms, load_and_pack, median_ms, split_corpus
from specbatch.distill.student import select_vocabulary
from specbatch.distill.teacher import dense_batches, label_shards, load_shards
from specbatch.distill.train import fit
from specbatch.kernels.attention.dense_causal import DenseCausalMetadata, DraftPassMetadata
from specbatch.models import load_model, resolve_model_path
from specbatch.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specbatch.runner.flat_batch import TokenRun, flatten
from specbatch.spec_decode.proposers.head import EagleHead, head_config, save_head
from specbatch.tokenizer import load_tokenizer

FEATURE_SHARD = 64  # rows per feature shard
PASS_WEIGHT = 0.8  # loss weight of each further unrolled pass


@dataclass
class HeadTrainConfig:
    """Everything ``specbatch train-head`` takes (see its ``--help``)."""

    work: Path
    out: Path
    target: str | None = None
    num_prompts: int = 1200
    extra_prompts: int = 1200
    answer_tokens: int = 128
    max_len: int = 1152
    vocab_size: int = 8192
    top_k: int = 16
    steps: int = 600
    tokens_per_batch: int = 4096
    lr: float = 1e-3
    unroll: int = 2
    feature_weight: float = 0.1
    seed: int = 0
    generation_batch: int = 48
    init: Path | None = None  # a head directory to go on training instead of a fresh head


@dataclass
class HeadExample:
    ids: torch.Tensor  # [n] target ids
    top_ids: torch.Tensor  # [n, K] head-vocabulary rows of the target's likeliest next tokens
    top_p: torch.Tensor  # [n, K] their probabilities (0 where none: the last position)
    features: torch.Tensor  # [n, hidden] the target's final-norm hidden states (bfloat16)


def run(config: HeadTrainConfig) -> Path:
    work = config.work
    parts = [p for p in answered_corpus(config) if p.name != "text"]
    sequences = [s for part in parts for s in part.sequences]
    token_map = head_vocabulary(config, sequences)
    shards = []
    for part in parts:
        labels = [label for label in part.labels if label is not None]
        if len(labels) != len(part.sequences):
            raise RuntimeError(f"{part.name}: rows without stored labels (an older work dir?)")
        shards += label_shards(part.sequences, labels, token_map, work, config.top_k, part.name)
    labelled = load_shards(shards)
    packed = load_model(config.target, attention_backend="dense_causal")
    packed.pack_for_cpu()  # inference only: packed layouts
    features = target_features(packed, sequences, work)
    del packed
    target = load_model(config.target, attention_backend="dense_causal")  # plain weights
    examples = [
        HeadExample(ids, top_i, top_p, f)
        for (ids, top_i, top_p), f in zip(labelled, features, strict=True)
    ]
    prompt_lens = [n for part in parts for n in part.prompt_lens]
    answers, _ = split_corpus(examples, len(examples))
    starts, _ = split_corpus(prompt_lens, len(prompt_lens))
    tokens = sum(len(e.ids) for e in answers.train)
    print(
        f"corpus: {len(answers.train)} answers for training ({tokens} tokens), "
        f"{len(answers.held_out)} held out; head vocabulary {len(token_map)}",
        flush=True,
    )
    if config.init is None:
        head = build_head(target, token_map, config.seed)
        checkpoint = work / "checkpoint-head"
    else:  # e.g. a second stage with a longer unroll
        from specbatch.spec_decode.proposers.head import load_head

        target.requires_grad_(False)
        head = load_head(config.init, target, dtype=torch.float32)
        if list(head.config.token_map or ()) != token_map:
            raise ValueError(f"{config.init} has another vocabulary than this work directory's")
        checkpoint = work / f"checkpoint-head-from-{config.init.name}"
    train_head(head, answers.train, config, checkpoint)
    agreement = depth_agreement(head, answers.held_out, starts.held_out, config.unroll)
    directory = work / "head"
    save_head(head, directory)
    c = head_decode_ms(directory, config.target) / decode_ms(load_and_pack(config.target))
    report = {"agreement_by_depth": agreement, "c": c, "parameters": head.head_parameters()}
    (work / "head.json").write_text(json.dumps(report, indent=1))
    print(
        "head: greedy agreement by depth "
        + ", ".join(f"{d + 1}: {a:.3f}" for d, a in enumerate(agreement))
        + f"; c {c:.3f}; {head.head_parameters() / 1e6:.1f} M parameters",
        flush=True,
    )
    save_head(head, config.out)
    print(f"wrote {config.out}", flush=True)
    return config.out


def head_vocabulary(config: HeadTrainConfig, sequences: list[list[int]]) -> list[int]:
    """The shipped draft's vocabulary for the default target (the same 8192 tokens), else the
    ``vocab_size`` most frequent tokens of the answers plus the special ones."""
    path = config.work / "head-vocab.json"
    if path.exists():
        return list(json.loads(path.read_text()))
    token_map: list[int] | None = None
    if config.target is None:
        from specbatch.spec_decode.proposers.shipped import DRAFT_DIR

        raw = json.loads((DRAFT_DIR / "config.json").read_text())
        token_map = list(raw.get("specbatch_token_map") or [])
    if not token_map:
        tokenizer = load_tokenizer(resolve_model_path(config.target))
        always = set(tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)
        token_map = select_vocabulary(sequences, config.vocab_size, always)
    path.write_text(json.dumps(token_map))
    return token_map


def target_features(
    target: LlamaForCausalLM, sequences: list[list[int]], work: Path, max_tokens: int = 8192
) -> list[torch.Tensor]:
    """The target's final-norm hidden states at every position of every row (bfloat16),
    computed once into ``features/`` shards and reused (a shard is keyed by its rows)."""
    directory = work / "features"
    directory.mkdir(exist_ok=True)
    out: list[torch.Tensor] = []
    starts = range(0, len(sequences), FEATURE_SHARD)
    for number, start in enumerate(tqdm(starts, desc="target features")):
        chunk = sequences[start : start + FEATURE_SHARD]
        path = directory / f"{number:05d}.safetensors"
        key = _rows_key(chunk)
        if path.exists():
            stored = load_file(str(path))
            if stored.get("key", torch.empty(0)).tolist() == key:
                out += [stored[str(i)] for i in range(len(chunk))]
                continue
        computed: dict[str, torch.Tensor] = {"key": torch.tensor(key, dtype=torch.int64)}
        with torch.no_grad():
            for group in dense_batches([len(s) for s in chunk], max_tokens):
                rows = [chunk[i] for i in group]
                width = max(len(r) for r in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                for j, row in enumerate(rows):
                    ids[j, : len(row)] = torch.tensor(row)
                positions = torch.arange(width).repeat(len(rows))
                hidden = target(ids.view(-1), positions, DenseCausalMetadata(len(rows), width))
                hidden = hidden.view(len(rows), width, -1)
                for j, i in enumerate(group):
                    computed[str(i)] = hidden[j, : len(chunk[i])].to(torch.bfloat16).contiguous()
        tmp = path.with_suffix(".tmp")
        save_file(computed, str(tmp))
        tmp.replace(path)
        out += [computed[str(i)] for i in range(len(chunk))]
    return out


def teacher_examples(
    target: LlamaForCausalLM, sequences: list[list[int]], token_map: list[int], top_k: int
) -> list[HeadExample]:
    """Examples labelled by a target pass (no stored labels): its top-``top_k`` next-token
    probabilities within the head's vocabulary and its features, at every position."""
    columns = torch.tensor(token_map, dtype=torch.long)
    out = []
    with torch.no_grad():
        for row in sequences:
            n = len(row)
            ids = torch.tensor(row, dtype=torch.long)
            hidden = target(ids, torch.arange(n), DenseCausalMetadata(1, n))
            probs = target.compute_logits(hidden).float().softmax(-1).index_select(-1, columns)
            top_p, top_i = probs.topk(min(top_k, len(token_map)), dim=-1)
            top_p[-1] = 0.0  # the last position's next token is not in the row
            out.append(HeadExample(ids, top_i, top_p, hidden.to(torch.bfloat16)))
    return out


def _rows_key(chunk: list[list[int]]) -> list[int]:
    """A cheap identity of a shard's rows: their count, lengths and a rolling sum of ids."""
    total = 0
    for row in chunk:
        for t in row:
            total = (total * 1_000_003 + t + 1) % (1 << 61)
    return [len(chunk), *(len(r) for r in chunk), total]


def build_head(target: LlamaForCausalLM, token_map: list[int], seed: int) -> EagleHead:
    """A fresh head for ``target`` in float32: its layer starts as a copy of the target's last
    layer, its output rows as the target's (tied) output rows of the head's vocabulary, and
    its input projection passes the feature through (the token's half starts small)."""
    torch.manual_seed(seed)
    config = head_config(target.config, token_map)
    head = EagleHead(config, target.backend)
    last = target.model.layers[-1]
    assert isinstance(last, LlamaDecoderLayer)
    head.layer.load_state_dict(last.state_dict())
    hidden = config.hidden_size
    with torch.no_grad():
        assert head.fc.weight is not None
        assert head.lm_head.weight is not None
        head.fc.weight.normal_(0.0, 0.02)
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        output = target.lm_head.weight if target.lm_head is not None else None
        rows = (output if output is not None else target.model.embed_tokens.weight).detach()
        head.lm_head.weight.copy_(rows[torch.tensor(token_map)].float())
        head.norm.weight.copy_(target.model.norm.weight.detach().float())
    head.float()
    target.requires_grad_(False)
    head.attach_target(target)
    return head


def head_loss(
    head: EagleHead, batch: list[HeadExample], unroll: int, feature_weight: float
) -> torch.Tensor:
    """Soft cross-entropy to the target's next-token labels plus the feature regression, over
    the real positions, summed over ``unroll`` passes (each on the previous pass's features)."""
    width = max(len(e.ids) for e in batch)
    k = batch[0].top_ids.shape[1]
    hidden = head.config.hidden_size
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    top_i = torch.zeros(len(batch), width, k, dtype=torch.long)
    top_p = torch.zeros(len(batch), width, k)
    feats = torch.zeros(len(batch), width, hidden)
    for row, e in enumerate(batch):
        n = len(e.ids)
        ids[row, :n] = e.ids.long()
        top_i[row, :n] = e.top_ids.long()
        top_p[row, :n] = e.top_p.float()
        feats[row, :n] = e.features.float()
    target = top_p / top_p.sum(-1, keepdim=True).clamp_min(1e-8)
    real = (top_p.sum(-1) > 0).float()
    positions = torch.arange(width).repeat(len(batch))
    metadata = DraftPassMetadata(len(batch), width)  # each pass attends as its draft does
    previous = _shifted(feats)
    total = torch.zeros(())
    for depth in range(unroll):
        out = head(ids.view(-1), positions, previous.view(-1, hidden), metadata)
        out = out.view(len(batch), width, hidden)
        logprobs = torch.log_softmax(head.compute_logits(out).float(), -1)
        cross = -(target * logprobs.gather(-1, top_i)).sum(-1)
        regress = F.smooth_l1_loss(out, feats, reduction="none").mean(-1)
        mask = real.clone()
        mask[:, :depth] = 0.0  # rows whose feature chain would reach before position 0
        per_row = (cross + feature_weight * regress) * mask
        total = total + PASS_WEIGHT**depth * per_row.sum() / mask.sum().clamp_min(1.0)
        previous = _shifted(out)
    return total


def _shifted(features: torch.Tensor) -> torch.Tensor:
    """Row ``p`` gets the feature of position ``p - 1`` (zeros at position 0)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def train_head(
    head: EagleHead, examples: list[HeadExample], config: HeadTrainConfig, checkpoint: Path
) -> list[float]:
    """Train ``head`` in place (resuming from ``checkpoint`` if there)."""
    return fit(
        head,
        examples,
        [len(e.ids) for e in examples],
        lambda batch: head_loss(head, batch, config.unroll, config.feature_weight),
        config.steps,
        config.tokens_per_batch,
        config.lr,
        checkpoint,
        config.seed,
        desc="train head",
        save_every=100,
        warmup=50,
    )


def depth_agreement(
    head: EagleHead, examples: list[HeadExample], prompt_lens: list[int], depths: int
) -> list[float]:
    """How often the head's argmax equals the target's at the answer positions, at each draft
    depth (1: the row reads the target's feature; d: it reads the head's own from d - 1 passes
    earlier, attending as that draft does in the engine: ``DraftPassMetadata``)."""
    agree = [0] * depths
    total = [0] * depths
    with torch.no_grad():
        for e, start in zip(examples, prompt_lens, strict=True):
            n = len(e.ids)
            feats = e.features.float()[None]
            previous = _shifted(feats)
            scored = e.top_p[:, 0].float() > 0
            first = max(0, start - 1)
            metadata = DraftPassMetadata(1, n)
            for depth in range(depths):
                out = head(e.ids.long(), torch.arange(n), previous.view(n, -1), metadata)
                best = head.compute_logits(out).argmax(-1)
                hits = (best == e.top_ids[:, 0].long()) & scored
                rows = torch.arange(n) >= max(first, depth)
                agree[depth] += int((hits & rows).sum())
                total[depth] += int((scored & rows).sum())
                previous = _shifted(out.view(1, n, -1))
    return [a / max(t, 1) for a, t in zip(agree, total, strict=True)]


def head_decode_ms(
    directory: Path, target_path: str | None = None, context: int = 256, repeats: int = 30
) -> float:
    """Median time of one single-token head step (no catch-up) at ``context``, batch 1, on the
    packed CPU path the engine uses."""
    from specbatch.spec_decode.proposers.head import load_head

    target = load_model(target_path)
    head = load_head(directory, target, dtype=torch.float32)
    head.pack_for_cpu()
    block_size = 16
    blocks = context // block_size + 1
    head.bind_kv_caches(
        allocate_kv_caches(head.config, blocks, block_size, head.dtype, head.device)
    )
    batch = flatten([TokenRun([1], context - 1, list(range(blocks)))], block_size)
    features = torch.zeros(1, head.config.hidden_size)
    metadata = head.backend.build_metadata(batch.attention, head.device)
    ids = torch.from_numpy(batch.input_ids)
    positions = torch.from_numpy(batch.positions)

    def step() -> None:
        with torch.no_grad():
            out = head(ids, positions, features, metadata)
            head.logits_in_output_vocab(head.compute_logits(out).float())

    return median_ms(step, head.device, repeats)
