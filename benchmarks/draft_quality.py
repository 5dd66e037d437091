"""How well a draft model agrees with its target, per Spec-Bench category.

    python benchmarks/draft_quality.py --dataset ../shared/data/specbench_dev.jsonl

The target generates with the draft proposing ``--k`` tokens every step (batch 1, greedy, then
again at T=1). From the per-position acceptance counts of the verify steps it reports, per
category: alpha, the per-token acceptance rate given a correct prefix
(accepted at position j / attempts at position j, pooled over j), the acceptance rate at each
position, and the mean accepted length (tokens per verify step, bonus included) for every k from
2 to ``--k``; and c, one draft decode step over one target decode step, measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_specbench, print_conditions, write_json
from specbatch import LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.distill.pipeline import decode_ms, load_and_pack
from specbatch.spec_decode.proposers.shipped import default_draft_path


def acceptance(per_pos: list[int], drafts: int, k: int) -> dict[str, Any]:
    attempts = [drafts] + per_pos[: k - 1]
    alpha = sum(per_pos[:k]) / max(sum(attempts), 1)
    by_position = [per_pos[j] / attempts[j] if attempts[j] else 0.0 for j in range(k)]
    lengths = {f"k{n}": 1 + sum(per_pos[:n]) / max(drafts, 1) for n in range(2, k + 1)}
    return {"alpha": alpha, "by_position": by_position, **lengths}


def measure(
    engine: LLMEngine, prompts: list[list[int]], temperature: float, max_tokens: int, k: int
) -> dict[str, Any]:
    per_pos = [0] * k
    drafts = 0
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
    return acceptance(per_pos, drafts, k)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--draft", default=None, help="default: the shipped draft")
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    engine = LLMEngine(
        EngineConfig(
            model=args.target,
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
    draft_path = args.draft or str(default_draft_path())
    c = decode_ms(load_and_pack(draft_path)) / decode_ms(load_and_pack(args.target))
    print_conditions(
        "draft quality (batch 1, acceptance per position)",
        target=engine.model_path.name,
        draft=draft_path,
        k=args.k,
        max_tokens=args.max_tokens,
        dataset=args.dataset,
        prompts_per_category=args.prompts_per_category,
        c=f"{c:.3f}",
    )
    rows = []
    for category, prompts in sorted(by_category.items()):
        greedy = measure(engine, prompts, 0.0, args.max_tokens, args.k)
        sampled = measure(engine, prompts, 1.0, args.max_tokens, args.k)
        rows.append({"category": category, "greedy": greedy, "t1": sampled})
        print(
            f"{category}: greedy alpha {greedy['alpha']:.3f}, T=1 alpha {sampled['alpha']:.3f}",
            flush=True,
        )
    print()
    ks = [f"k{n}" for n in range(2, args.k + 1)]
    print(
        f"{'category':>16} {'alpha':>6} {'a(T=1)':>7} "
        + " ".join(f"{k:>5}" for k in ks)
        + "   accepted at position 1..k (greedy)"
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
    print(f"{'mean':>16} {mean_alpha:>6.3f} {mean_t1:>7.3f}   c = {c:.3f}")
    write_json(
        args.json,
        {
            "conditions": vars(args),
            "c": c,
            "rows": rows,
            "mean_alpha_greedy": mean_alpha,
            "mean_alpha_t1": mean_t1,
        },
    )


if __name__ == "__main__":
    main()
