"""How well a drafter agrees with its target, per Spec-Bench category.

    python benchmarks/draft_quality.py --dataset ../shared/data/specbench_dev.jsonl
    python benchmarks/draft_quality.py --dataset ../shared/data/specbench_dev.jsonl \
        --head -k 5 --prompts-per-category 1 --categories ...

The target generates with the drafter proposing ``--k`` tokens every step (fixed chains: no
controller, no confidence stop; batch 1, greedy, then again at T=1): a draft model
(``--draft``, default the shipped one) or, with ``--head [DIR]``, a draft head (default the
shipped one). From the per-position acceptance counts of the verify steps it reports, per
category: alpha, the per-token acceptance rate given a correct prefix (accepted at position j /
attempts at position j, pooled over j), the acceptance rate at each position given the one
before was accepted, and the mean accepted length (tokens per verify step, bonus included) for
every k from 2 to ``--k``; for a draft model c, one draft decode step over one target decode
step, measured here.

With ``--head``, the head then runs offline on the texts the engine generated greedily, the way
``specbatch train-head`` evaluates it (``DraftPassMetadata``: depth d reads the head's own
outputs of d - 1 earlier passes and attends as a chain's d-th draft does), and the share of
answer positions where its argmax is the target's is printed per depth beside the engine's
acceptance given the previous draft, pooled over the prompts. The two agree when the engine
drafts what training measured; a gap between them is an engine bug or a training/use mismatch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import load_specbench, print_conditions, write_json
from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.distill.pipeline import decode_ms, load_and_pack
from specbatch.kernels.attention.dense_causal import DenseCausalMetadata, DraftPassMetadata
from specbatch.models import load_model
from specbatch.spec_decode.proposers.head import load_head
from specbatch.spec_decode.proposers.shipped import HEAD_DIR, default_draft_path


def acceptance(per_pos: list[int], drafts: int, k: int) -> dict[str, Any]:
    attempts = [drafts] + per_pos[: k - 1]
    alpha = sum(per_pos[:k]) / max(sum(attempts), 1)
    by_position = [per_pos[j] / attempts[j] if attempts[j] else 0.0 for j in range(k)]
    lengths = {f"k{n}": 1 + sum(per_pos[:n]) / max(drafts, 1) for n in range(2, k + 1)}
    return {"alpha": alpha, "by_position": by_position, **lengths}


def measure(
    engine: LLMEngine, prompts: list[list[int]], temperature: float, max_tokens: int, k: int
) -> tuple[list[int], int, list[list[int]]]:
    """Accepted drafts per position, verify steps with drafts, and each prompt + its answer."""
    per_pos = [0] * k
    drafts = 0
    texts = []
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"q{temperature}-{i}",
            prompt,
            SamplingParams(temperature=temperature, max_tokens=max_tokens),
        )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    m = out.metrics
                    drafts += m.num_drafts
                    for j, count in enumerate(m.num_accepted_tokens_per_pos[:k]):
                        per_pos[j] += count
                    texts.append(prompt + list(out.outputs[0].token_ids))
    return per_pos, drafts, texts


def offline_agreement(head_dir: Path, texts: list[tuple[list[int], int]], k: int) -> list[float]:
    """Per depth, the share of answer positions where the head's argmax is the target's, the
    head run as training evaluates it; ``texts``: (prompt + answer, prompt length)."""
    target = load_model(None, attention_backend="dense_causal")
    head = load_head(head_dir, target, dtype=torch.float32)
    agree, total = [0] * k, [0] * k
    with torch.no_grad():
        for tokens, start in texts:
            text = torch.tensor(tokens)
            n = len(text)
            hidden = target(text, torch.arange(n), DenseCausalMetadata(1, n))
            truth = target.compute_logits(hidden).argmax(-1)
            features = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
            metadata = DraftPassMetadata(1, n)
            for depth in range(k):
                rows = head(text, torch.arange(n), features, metadata)
                best = head.logits_in_output_vocab(head.compute_logits(rows).float()).argmax(-1)
                answer = slice(start - 1 + depth, n - 1)  # the rows predicting answer tokens
                agree[depth] += int((best[answer] == truth[answer]).sum())
                total[depth] += len(range(n)[answer])
                features = torch.cat([torch.zeros_like(rows[:1]), rows[:-1]])
    return [a / max(t, 1) for a, t in zip(agree, total, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--draft", default=None, help="default: the shipped draft")
    parser.add_argument(
        "--head", type=Path, nargs="?", const=HEAD_DIR, default=None, help="a draft head"
    )
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.head is not None and args.target is not None:
        parser.error("--head measures the shipped head's target (the default model)")

    spec: dict[str, Any] = {
        "method": "eagle" if args.head else "draft_model",
        "model": str(args.head) if args.head else args.draft,
        "num_speculative_tokens": args.k,
        "adaptive_k": False,  # k drafts every step, every one judged
        "draft_confidence_threshold": 0.0,
    }
    engine = LLMEngine(
        EngineConfig(
            model=args.target,
            dtype="float32",  # the target dequantised, as when the drafts were measured
            quantization=None,
            max_model_len=2048,
            max_num_seqs=1,
            enable_prefix_caching=False,
            speculative_config=spec,
        )
    )
    tokenizer = engine.tokenizer
    by_category: dict[str, list[list[int]]] = defaultdict(list)
    for prompt in load_specbench(args.dataset, args.categories, args.prompts_per_category):
        _, ids = tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
        by_category[prompt.category].append(ids)
    drafter = str(args.head) if args.head else args.draft or str(default_draft_path())
    c = None
    if args.head is None:
        c = decode_ms(load_and_pack(drafter)) / decode_ms(load_and_pack(args.target))
    print_conditions(
        "draft quality (batch 1, fixed chains, acceptance per position)",
        target=engine.model_path.name,
        drafter=f"{'head' if args.head else 'draft model'} {drafter}",
        k=args.k,
        max_tokens=args.max_tokens,
        dataset=args.dataset,
        prompts_per_category=args.prompts_per_category,
        c="-" if c is None else f"{c:.3f}",
    )
    rows: list[dict[str, Any]] = []
    pooled, pooled_drafts, texts = [0] * args.k, 0, []
    for category, prompts in sorted(by_category.items()):
        per_pos, drafts, answers = measure(engine, prompts, 0.0, args.max_tokens, args.k)
        pooled = [a + b for a, b in zip(pooled, per_pos, strict=True)]
        pooled_drafts += drafts
        texts += [(text, len(p)) for text, p in zip(answers, prompts, strict=True)]
        greedy = acceptance(per_pos, drafts, args.k)
        sampled = acceptance(*measure(engine, prompts, 1.0, args.max_tokens, args.k)[:2], args.k)
        rows.append({"category": category, "greedy": greedy, "t1": sampled})
        print(
            f"{category}: greedy alpha {greedy['alpha']:.3f}, T=1 alpha {sampled['alpha']:.3f}",
            flush=True,
        )
    offline = offline_agreement(args.head, texts, args.k) if args.head else None
    print_table(rows, args.k, c)
    given = acceptance(pooled, pooled_drafts, args.k)["by_position"]
    if offline is not None:
        print(
            "\ndepth                          " + " ".join(f"{d:>6}" for d in range(1, args.k + 1))
        )
        print("engine: accepted given previous " + " ".join(f"{v:6.3f}" for v in given))
        print("offline: agreement              " + " ".join(f"{v:6.3f}" for v in offline))
    write_json(
        args.json,
        {
            "conditions": {**vars(args), "head": str(args.head) if args.head else None},
            "c": c,
            "rows": rows,
            "mean_alpha_greedy": statistics.mean(r["greedy"]["alpha"] for r in rows),
            "mean_alpha_t1": statistics.mean(r["t1"]["alpha"] for r in rows),
            "given_previous": given,
            "offline_agreement": offline,
        },
    )


def print_table(rows: list[dict[str, Any]], k: int, c: float | None) -> None:
    print()
    ks = [f"k{n}" for n in range(2, k + 1)]
    print(
        f"{'category':>16} {'alpha':>6} {'a(T=1)':>7} "
        + " ".join(f"{k:>5}" for k in ks)
        + "   accepted at position 1..k given the one before (greedy)"
    )
    for r in rows:
        g = r["greedy"]
        print(
            f"{r['category']:>16} {g['alpha']:>6.3f} {r['t1']['alpha']:>7.3f} "
            + " ".join(f"{g[k]:>5.2f}" for k in ks)
            + "   "
            + " ".join(f"{p:.2f}" for p in g["by_position"])
        )
    mean_alpha = statistics.mean(r["greedy"]["alpha"] for r in rows)
    mean_t1 = statistics.mean(r["t1"]["alpha"] for r in rows)
    print(
        f"{'mean':>16} {mean_alpha:>6.3f} {mean_t1:>7.3f}   c = {'-' if c is None else f'{c:.3f}'}"
    )


if __name__ == "__main__":
    main()
