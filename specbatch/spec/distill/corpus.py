"""The distillation corpus: the target's own answers to the prompt set, plus real text.

Stored as JSON lines of token ids (``generations.jsonl``, ``text.jsonl``) in the work
directory; generation appends and skips ids already present, so an interrupted run resumes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from specbatch.sampling_params import SamplingParams
from specbatch.spec.distill.prompts import build_prompts, stdlib_source_chunks
from specbatch.tokenizer import Tokenizer


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
) -> Path:
    """Let the target answer ``num_prompts`` chat prompts (half greedy, half at T=0.8)."""
    from specbatch.engine.llm import LLM

    out = work / "generations.jsonl"
    done = {row["id"] for row in read_jsonl(out)}
    prompts = build_prompts(num_prompts, seed)
    todo = [i for i in range(len(prompts)) if i not in done]
    if not todo:
        return out
    llm = LLM(target, max_model_len=2048, max_num_seqs=batch, seed=seed)
    tokenizer = llm.get_tokenizer()
    room = min(1024, llm.llm_engine.max_model_len - max_tokens - 1)  # prompt tokens kept
    with (
        out.open("a") as handle,
        tqdm(total=len(prompts), initial=len(done), desc="target answers") as bar,
    ):
        for start in range(0, len(todo), batch):
            ids = todo[start : start + batch]
            chats = [{"prompt_token_ids": _prompt_ids(tokenizer, prompts[i], room)} for i in ids]
            params = [
                SamplingParams(
                    temperature=0.0 if i % 2 else 0.8, seed=seed + i, max_tokens=max_tokens
                )
                for i in ids
            ]
            for i, chat, result in zip(
                ids, chats, llm.generate(chats, params, use_tqdm=False), strict=True
            ):
                tokens = list(chat["prompt_token_ids"]) + result.outputs[0].token_ids
                handle.write(json.dumps({"id": i, "token_ids": tokens}) + "\n")
            handle.flush()
            bar.update(len(ids))
    return out


def _prompt_ids(tokenizer: Tokenizer, prompt: str, room: int) -> list[int]:
    """The chat-formatted prompt (plain text for a model without a chat template), keeping its
    last ``room`` tokens."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(prompt)[-room:]
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)[-room:]


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


def load_sequences(work: Path, max_len: int) -> list[list[int]]:
    """Every corpus row, cut to ``max_len`` tokens, in a fixed order: the target's answers
    first (``num_answer_sequences`` of them), then the plain text."""
    rows = list(read_jsonl(work / "generations.jsonl")) + list(read_jsonl(work / "text.jsonl"))
    return [row["token_ids"][:max_len] for row in rows if len(row["token_ids"]) >= 8]


def num_answer_sequences(work: Path) -> int:
    """How many of ``load_sequences``' rows are the target's answers (they come first)."""
    return sum(1 for row in read_jsonl(work / "generations.jsonl") if len(row["token_ids"]) >= 8)
