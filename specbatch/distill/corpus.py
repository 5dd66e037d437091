"""The distillation corpus: the target's own answers to the prompt set, plus real text.

Stored as JSON lines of token ids in the work directory: ``generations.jsonl`` (answers to
``build_prompts``), ``generations-extra.jsonl`` (answers to ``extra_prompts``), ``text.jsonl``.
Generation appends and skips ids already present, so an interrupted run resumes; answer rows
record their prompt length. The target's top-``LABEL_TOP`` log-probabilities at every position,
which the engine computes while generating (``logprobs``/``prompt_logprobs``), are kept beside
them in ``labels/`` (safetensors), so these rows need no separate teacher pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specbatch.distill.prompts import build_prompts, extra_prompts, stdlib_source_chunks
from specbatch.outputs import PositionLogprobs, RequestOutput
from specbatch.sampling_params import SamplingParams
from specbatch.tokenizer import Tokenizer

ANSWER_FILES = ("generations.jsonl", "generations-extra.jsonl")  # base, extra prompt families
LABEL_TOP = 20  # the most log-probabilities the engine reports per position


def read_jsonl(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    with path.open() as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def generate_answers(
    target: str | None,
    work: Path,
    num_prompts: int,
    max_tokens: int,
    batch: int,
    seed: int,
    extra: bool = False,
) -> Path:
    """Let the target answer ``num_prompts`` chat prompts (half greedy, half at T=0.8): those of
    ``build_prompts``, or with ``extra`` those of ``extra_prompts``."""
    from specbatch.engine.llm import LLM

    out = work / ANSWER_FILES[extra]
    done = {row["id"] for row in read_jsonl(out)}
    prompts = (extra_prompts if extra else build_prompts)(num_prompts, seed)
    todo = [i for i in range(len(prompts)) if i not in done]
    if not todo:
        return out
    llm = LLM(target, max_model_len=2048, max_num_seqs=batch, seed=seed)
    tokenizer = llm.get_tokenizer()
    room = min(1024, llm.llm_engine.max_model_len - max_tokens - 1)  # prompt tokens kept
    (work / "labels").mkdir(exist_ok=True)
    with (
        out.open("a") as handle,
        tqdm(total=len(prompts), initial=len(done), desc="target answers") as bar,
    ):
        for start in range(0, len(todo), batch):
            ids = todo[start : start + batch]
            chats = [{"prompt_token_ids": _prompt_ids(tokenizer, prompts[i], room)} for i in ids]
            params = [
                SamplingParams(
                    temperature=0.0 if i % 2 else 0.8,
                    seed=seed + i,
                    max_tokens=max_tokens,
                    logprobs=LABEL_TOP,
                    prompt_logprobs=LABEL_TOP,
                    detokenize=False,
                )
                for i in ids
            ]
            results = llm.generate(chats, params, use_tqdm=False)
            labels_name = f"{out.stem}-{ids[0]:06d}.safetensors"
            tensors = {}
            for i, result in zip(ids, results, strict=True):
                tensors[f"{i}.ids"], tensors[f"{i}.logprobs"] = position_labels(result)
            save_file(tensors, str(work / "labels" / labels_name))  # before the rows name it
            for i, result in zip(ids, results, strict=True):
                tokens = list(result.prompt_token_ids) + result.outputs[0].token_ids
                row = {
                    "id": i,
                    "prompt_len": len(result.prompt_token_ids),
                    "labels": labels_name,
                    "token_ids": tokens,
                }
                handle.write(json.dumps(row) + "\n")
            handle.flush()
            bar.update(len(ids))
    return out


def generate_all_answers(
    target: str | None,
    work: Path,
    counts: tuple[int, int],
    max_tokens: int,
    batch: int,
    seed: int,
) -> None:
    """The answers to ``counts`` = (base prompts, extra prompts), each set resumable."""
    work.mkdir(parents=True, exist_ok=True)
    generate_answers(target, work, counts[0], max_tokens, batch, seed)
    if counts[1]:
        generate_answers(target, work, counts[1], max_tokens, batch, seed, extra=True)


def position_labels(result: RequestOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``LABEL_TOP`` next-token log-probabilities at every position of a
    finished request (prompt then output): ``[n, LABEL_TOP]`` ids (int32) and log-probabilities
    (float16, ``-inf`` where the engine reported fewer entries, and on the last row, whose next
    token was never scored)."""
    assert result.prompt_logprobs is not None
    assert result.outputs[0].logprobs is not None
    # prompt_logprobs[j] scores token j given the ones before it: position j - 1's next token
    per_position: list[PositionLogprobs | None] = [
        *result.prompt_logprobs[1:],
        *result.outputs[0].logprobs,
    ]
    n = len(result.prompt_token_ids) + len(result.outputs[0].token_ids)
    ids = torch.zeros(n, LABEL_TOP, dtype=torch.int32)
    logprobs = torch.full((n, LABEL_TOP), float("-inf"), dtype=torch.float32)
    for position, entries in enumerate(per_position[: n - 1]):
        if not entries:
            continue
        best = sorted(entries.items(), key=lambda e: -e[1].logprob)[:LABEL_TOP]
        ids[position, : len(best)] = torch.tensor([token for token, _ in best])
        logprobs[position, : len(best)] = torch.tensor([lp.logprob for _, lp in best])
    return ids, logprobs.half()


def _prompt_ids(tokenizer: Tokenizer, prompt: str, room: int) -> list[int]:
    """The chat-formatted prompt (plain text for a model without a chat template), keeping its
    last ``room`` tokens."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(prompt)[-room:]
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])[1][-room:]


def tokenize_text(target: str | None, work: Path, max_chars: int) -> Path:
    """Standard-library source text as token-id rows (real, non-chat text)."""
    from specbatch.models import resolve_model_path
    from specbatch.tokenizer import load_tokenizer

    out = work / "text.jsonl"
    if out.exists():
        return out
    tokenizer = load_tokenizer(resolve_model_path(target))
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as handle:
        for i, chunk in enumerate(stdlib_source_chunks(max_chars)):
            handle.write(
                json.dumps(
                    {"id": i, "token_ids": tokenizer.encode(chunk, add_special_tokens=False)}
                )
                + "\n"
            )
    tmp.replace(out)
    return out


@dataclass
class CorpusPart:
    """The rows of one corpus file, cut to length, with their stored target labels (None for a
    row generated without them, and for plain text)."""

    name: str
    sequences: list[list[int]]
    labels: list[tuple[torch.Tensor, torch.Tensor] | None]
    prompt_lens: list[int]  # 0 where unknown (plain text)


class CorpusSettings(Protocol):
    """What building a corpus takes from ``distill-draft``'s or ``train-head``'s config."""

    target: str | None
    work: Path
    num_prompts: int
    extra_prompts: int
    answer_tokens: int
    generation_batch: int
    seed: int
    max_len: int


def answered_corpus(settings: CorpusSettings, text_chars: int = 0) -> list[CorpusPart]:
    """The target's answers to the prompt families (generated into the work directory the
    first time) and, with ``text_chars``, that much plain text, as corpus parts."""
    generate_all_answers(
        settings.target,
        settings.work,
        (settings.num_prompts, settings.extra_prompts),
        settings.answer_tokens,
        settings.generation_batch,
        settings.seed,
    )
    if text_chars:
        tokenize_text(settings.target, settings.work, text_chars)
    return corpus_parts(settings.work, settings.max_len)


def corpus_parts(work: Path, max_len: int, text_max_len: int = 512) -> list[CorpusPart]:
    """The corpus in a fixed order: the target's answers first (every part but ``text``,
    cut to ``max_len`` tokens), then the plain text (cut to ``text_max_len``)."""
    parts = []
    for name in ANSWER_FILES:
        rows = [r for r in read_jsonl(work / name) if len(r["token_ids"]) >= 8]
        files: dict[str, dict[str, torch.Tensor]] = {}
        labels: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for row in rows:
            if "labels" not in row:
                labels.append(None)
                continue
            if row["labels"] not in files:
                files[row["labels"]] = load_file(str(work / "labels" / row["labels"]))
            stored = files[row["labels"]]
            labels.append((stored[f"{row['id']}.ids"], stored[f"{row['id']}.logprobs"]))
        parts.append(
            CorpusPart(
                Path(name).stem,
                [r["token_ids"][:max_len] for r in rows],
                labels,
                [r.get("prompt_len", 0) for r in rows],
            )
        )
    text = [
        row["token_ids"][:text_max_len]
        for row in read_jsonl(work / "text.jsonl")
        if len(row["token_ids"]) >= 8
    ]
    parts.append(CorpusPart("text", text, [None] * len(text), [0] * len(text)))
    return [part for part in parts if part.sequences]


def load_sequences(work: Path, max_len: int, text_max_len: int = 512) -> list[list[int]]:
    """Every row of ``corpus_parts``, in its order."""
    return [s for part in corpus_parts(work, max_len, text_max_len) for s in part.sequences]
