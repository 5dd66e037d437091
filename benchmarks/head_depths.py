"""A draft head's acceptance by depth in the engine against its agreement offline, same texts.

The engine drafts fixed chains of ``--k`` with the head (greedy, batch 1) on the first prompt of
each Spec-Bench category; per depth it prints the share of drafts accepted and that share
given the draft before was accepted. Then, on the texts the engine generated, the head runs
offline the way ``specbatch train-head`` evaluates it (``DraftPassMetadata``: depth d reads the
head's own outputs of d - 1 earlier passes and attends as a chain's d-th draft does) and the
share of answer positions where its argmax is the target's is printed per depth. The two
agree when the engine drafts what training measured; a gap between them is an engine bug or a
training/use mismatch, a gap between the head's ``head.json`` and these is the prompts.

    python benchmarks/head_depths.py --dataset ../shared/data/specbench_dev.jsonl [--head DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specbatch import LLM, SamplingParams
from specbatch.kernels.attention.dense_causal import DenseCausalMetadata, DraftPassMetadata
from specbatch.models import load_model, resolve_model_path
from specbatch.spec_decode.proposers.shipped import HEAD_DIR
from specbatch.spec_decode.proposers.head import load_head
from specbatch.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", required=True, help="Spec-Bench jsonl")
    parser.add_argument("--head", type=Path, default=HEAD_DIR)
    parser.add_argument("--prompts", type=int, default=8, help="categories (one prompt each)")
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    first: dict[str, str] = {}
    for line in Path(args.dataset).read_text().splitlines():
        row = json.loads(line)
        first.setdefault(row["category"], row["turns"][0])
    prompts = list(first.values())[: args.prompts]
    tokenizer = load_tokenizer(resolve_model_path(None))
    ids = [tokenizer.encode_chat([{"role": "user", "content": p}])[1] for p in prompts]
    print(f"head {args.head}, k {args.k}, {len(ids)} prompts, {args.max_tokens} tokens, greedy")
    spec = {
        "method": "eagle",
        "model": str(args.head),
        "num_speculative_tokens": args.k,
        "adaptive_k": False,
        "draft_confidence_threshold": 0.0,
    }
    llm = LLM(speculative_config=spec, max_num_seqs=1)
    outputs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    stats = llm.llm_engine.stats
    drafted, accepted = stats.num_drafts_per_pos, stats.num_accepted_tokens_per_pos
    shares = [a / max(d, 1) for a, d in zip(accepted, drafted, strict=True)]
    given = [accepted[0] / max(drafted[0], 1)] + [
        accepted[d] / max(accepted[d - 1], 1) for d in range(1, len(accepted))
    ]
    del llm
    target = load_model(None, attention_backend="dense_causal")
    head = load_head(args.head, target, dtype=torch.float32)
    agree, total = [0] * args.k, [0] * args.k
    with torch.no_grad():
        for prompt, out in zip(ids, outputs, strict=True):
            text = torch.tensor(prompt + list(out.outputs[0].token_ids))
            n = len(text)
            hidden = target(text, torch.arange(n), DenseCausalMetadata(1, n))
            truth = target.compute_logits(hidden).argmax(-1)
            features = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
            metadata = DraftPassMetadata(1, n)
            for depth in range(args.k):
                rows = head(text, torch.arange(n), features, metadata)
                best = head.logits_in_output_vocab(head.compute_logits(rows).float()).argmax(-1)
                answer = slice(len(prompt) - 1 + depth, n - 1)  # predicting answer tokens
                agree[depth] += int((best[answer] == truth[answer]).sum())
                total[depth] += len(range(n)[answer])
                features = torch.cat([torch.zeros_like(rows[:1]), rows[:-1]])
    print("depth                      " + " ".join(f"{d + 1:>6}" for d in range(args.k)))
    print("engine: accepted           " + " ".join(f"{v:6.3f}" for v in shares))
    print("engine: given the previous " + " ".join(f"{v:6.3f}" for v in given))
    offline = [a / max(t, 1) for a, t in zip(agree, total, strict=True)]
    print("offline: agreement         " + " ".join(f"{v:6.3f}" for v in offline))


if __name__ == "__main__":
    main()
