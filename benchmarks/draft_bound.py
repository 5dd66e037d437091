"""What the default drafters could gain at one batch size, at most, per Spec-Bench category.

    python benchmarks/draft_bound.py --dataset ../shared/data/specbench_dev.jsonl --batch 8

The ceiling on speculation's gain that the drafters themselves set, whatever controller picks
their drafts. The target generates greedily (speculation off); on those texts the shipped draft
model runs teacher-forced (its likeliest token and that token's probability at every answer
position) and prompt lookup is asked what it would draft at every position (n-grams of 1-4
tokens, as the hybrid's lookup). A draft at position i is right when it is the target's token:
the draft model's run of right drafts from i is its accepted length there (a chain's later
drafts condition on the earlier ones, which are the target's tokens while they are right),
lookup's is the length of its proposal's prefix that matches.

Costs are measured in the same run at ``--batch`` sequences of 200-token contexts: the target's
forward of 1 to ``k + 1`` tokens per sequence, and a decode step of the draft model. In units of
one sequence's decode token: its ``j``-th draft's verify row costs ``r_j = (T(j + 1) - T(j)) /
T(1)`` (``T(n)``: the forward of ``n`` tokens per sequence; rows are not equally dear: at batch 8
the first is cheaper than the fourth), a draft-model forward ``c = draft decode / T(1)`` (per
sequence when all draft).

Per category, the tokens per unit of cost (speculation off: 1) of:

* ``oracle``: every step knows which drafts will be accepted and drafts exactly those, from the
  better of lookup and the draft model, with no proposer cost. No controller can beat it with
  these drafters at these costs.
* ``oracle+c``: the same, paying the draft model's forwards (lookup stays free).
* ``lookup``: lookup's proposal (up to ``k`` tokens) whenever it has one, nothing otherwise,
  the best ``k`` in hindsight.
* ``gated``: lookup (up to ``k``) where it has a proposal, else the draft model, with the best
  confidence gates in hindsight: the first draft only if its probability is at least ``t1``,
  more while the probability that all so far are right is at least ``t``, at most ``k``; its
  forwards paid.
* ``best``: the better of ``lookup``, ``gated`` and 1 (no drafts).

A sequence's steps are simulated one after the other at these per-sequence costs; a draft
forward that only some sequences run costs each of them more than ``c``, so ``gated`` and
``oracle+c`` are optimistic too.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.code_edit_prompt import CODE_EDIT_PROMPTS
from benchmarks.common import Prompt, load_specbench, print_conditions, write_json
from specbatch import LLM, SamplingParams
from specbatch.kernels.attention.dense_causal import DenseCausalMetadata
from specbatch.models import load_model
from specbatch.models.default_model import default_model_path
from specbatch.models.llama import LlamaForCausalLM
from specbatch.spec_decode.proposers.shipped import default_draft_path
from specbatch.spec_decode.proposers.ngram import NgramIndex
from tests.helpers import PagedHarness

LOOKUP_N = (1, 4)  # the hybrid's lookup: the longest suffix of 1 to 4 tokens found earlier
GATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
CHAIN_GATES = (0.2, 0.3, 0.5, 0.7)


@dataclass
class Text:
    """One answer's positions: the draft model's run of right drafts and its likeliest token's
    probability, and lookup's proposal's matching length, at each."""

    draft_run: list[int]
    draft_prob: list[float]
    lookup_run: list[int]
    lookup_len: list[int]  # tokens lookup proposes (up to k; 0: no match)


def answer_texts(prompts: list[Prompt], max_tokens: int) -> list[tuple[str, list[int], int]]:
    """(category, prompt + greedy answer, prompt length) per prompt."""
    llm = LLM(speculative_config={"method": "off"}, max_num_seqs=32)
    tokenizer = llm.llm_engine.tokenizer
    ids = [tokenizer.encode_chat([{"role": "user", "content": p.text}])[1] for p in prompts]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    del llm
    return [
        (p.category, prompt + list(out.outputs[0].token_ids), len(prompt))
        for p, prompt, out in zip(prompts, ids, outs, strict=True)
    ]


def runs_of(right: list[bool]) -> list[int]:
    """At each position, how many consecutive positions from it are right."""
    run, out = 0, [0] * len(right)
    for i in range(len(right) - 1, -1, -1):
        run = run + 1 if right[i] else 0
        out[i] = run
    return out


def measure_text(draft: LlamaForCausalLM, tokens: list[int], start: int, k: int) -> Text:
    n = len(tokens)
    with torch.no_grad():
        hidden = draft(torch.tensor(tokens), torch.arange(n), DenseCausalMetadata(1, n))
        logits = draft.logits_in_output_vocab(draft.compute_logits(hidden).float())
        prob, best = torch.softmax(logits, dim=-1).max(dim=-1)
    answer = range(start, n)  # position i predicts tokens[i] from tokens[:i]
    right = [int(best[i - 1]) == tokens[i] for i in answer]
    index = NgramIndex(*LOOKUP_N)
    lookup_run, lengths = [], []
    for i in answer:
        proposal, _ = index.match(tokens[:i], k)
        agreed = 0
        while agreed < len(proposal) and i + agreed < n and proposal[agreed] == tokens[i + agreed]:
            agreed += 1
        lookup_run.append(agreed)
        lengths.append(len(proposal))
    return Text(runs_of(right), [float(prob[i - 1]) for i in answer], lookup_run, lengths)


def simulate(
    text: Text, rows: list[float], c: float, policy: str, gates: tuple[float, float, int]
) -> tuple[int, float]:
    """(tokens, cost) of generating ``text`` step by step under ``policy``; ``rows[n]``: what
    ``n`` drafts add to a step."""
    t1, t, k = gates
    i, tokens, cost = 0, 0, 0.0
    n = len(text.draft_run)
    while i < n:
        if policy == "oracle" or policy == "oracle+c":
            by_draft = min(text.draft_run[i], k)
            by_lookup = min(text.lookup_run[i], k)
            paid = c * by_draft if policy == "oracle+c" else 0.0
            if by_lookup >= by_draft or rows[by_draft] + paid >= by_draft:
                accepted, step = by_lookup, 1 + rows[by_lookup]
            else:
                accepted, step = by_draft, 1 + rows[by_draft] + paid
        elif text.lookup_len[i] and policy in ("lookup", "gated"):
            drafted = min(k, text.lookup_len[i])  # every proposed row is paid
            accepted, step = min(text.lookup_run[i], drafted), 1 + rows[drafted]
        elif policy == "gated":
            step = 1 + c
            if text.draft_prob[i] < t1:
                accepted = 0
            else:
                drafted, confidence = 1, text.draft_prob[i]
                while drafted < k and i + drafted < n and confidence >= t:
                    confidence *= text.draft_prob[i + drafted]
                    drafted += 1
                accepted = min(text.draft_run[i], drafted)
                step += rows[drafted] + c * (drafted - 1)
        else:
            accepted, step = 0, 1.0
        accepted = min(accepted, n - i - 1)
        tokens += accepted + 1
        cost += step
        i += accepted + 1
    return tokens, cost


def ratio(
    texts: list[Text], rows: list[float], c: float, policy: str, gates: tuple[float, float, int]
) -> float:
    tokens = cost = 0.0
    for text in texts:
        a, b = simulate(text, rows, c, policy, gates)
        tokens += a
        cost += b
    return tokens / cost


def step_ms(model: LlamaForCausalLM, batch: int, shapes: list[int], repeats: int) -> list[float]:
    """Median milliseconds of a forward of ``n`` tokens per sequence over ``batch`` sequences, for
    each ``n`` in ``shapes``, timed in interleaved rounds after two untimed ones, from 200 tokens
    of context (logits of every row, as the engine computes them)."""
    gen = torch.Generator().manual_seed(0)
    per_sequence = -(-(200 + (repeats + 2) * sum(shapes)) // 16)
    harness = PagedHarness(model, num_blocks=batch * per_sequence + 8)
    for seq in range(batch):
        harness.forward([(seq, torch.randint(100, 8000, (200,), generator=gen).tolist())])
    samples: list[list[float]] = [[] for _ in shapes]
    for attempt in range(repeats + 2):
        for n, times in zip(shapes, samples, strict=True):
            begin = time.perf_counter()
            harness.forward([(seq, [7] * n) for seq in range(batch)])
            if attempt >= 2:
                times.append(time.perf_counter() - begin)
    return [statistics.median(times) * 1e3 for times in samples]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="batch size the costs are taken at")
    parser.add_argument("-k", type=int, default=8, help="most drafts a step")
    parser.add_argument("--repeats", type=int, default=15, help="timed forwards per shape")
    parser.add_argument("--no-code-edit", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    prompts = load_specbench(args.dataset, args.categories, args.prompts_per_category)
    if not args.no_code_edit:
        prompts += [Prompt(text, "code_editing") for text in CODE_EDIT_PROMPTS]
    answers = answer_texts(prompts, args.max_tokens)

    target = load_model(default_model_path())
    target.pack_for_cpu()
    forward = step_ms(target, args.batch, list(range(1, args.k + 2)), args.repeats)
    del target
    draft = load_model(default_draft_path())
    draft.pack_for_cpu()
    (draft_decode,) = step_ms(draft, args.batch, [1], args.repeats)
    decode = forward[0]
    rows = [(t - decode) / decode for t in forward]  # rows[n]: what n drafts add
    c = draft_decode / decode
    print_conditions(
        "ceiling of the default drafters' gain (greedy; see the docstring)",
        batch=args.batch,
        target_decode_ms=f"{decode:.1f}",
        forward_ms_by_tokens_per_sequence=" ".join(f"{t:.1f}" for t in forward),
        draft_decode_ms=f"{draft_decode:.2f}",
        rows_added_by_drafts=" ".join(f"{x:.2f}" for x in rows),
        draft_forward_c=f"{c:.3f}",
        k=args.k,
        max_tokens=args.max_tokens,
        prompts_per_category=args.prompts_per_category,
    )

    dense = load_model(default_draft_path(), attention_backend="dense_causal")
    texts: dict[str, list[Text]] = {}
    for category, tokens, start in answers:
        texts.setdefault(category, []).append(measure_text(dense, tokens, start, args.k))

    # how well the draft's probability of its likeliest token predicts that the target agrees
    pooled = [
        (prob, run > 0)
        for group in texts.values()
        for text in group
        for prob, run in zip(text.draft_prob, text.draft_run, strict=True)
    ]
    print("\ndraft probability of its token -> share of positions, share the target agrees with")
    for low in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        rights = [right for prob, right in pooled if low <= prob < low + 0.1 or low == 0.9 < prob]
        share = len(rights) / len(pooled)
        agreed = sum(rights) / max(len(rights), 1)
        print(f"  {low:.1f}-{low + 0.1:.1f}: {share:5.2f} of positions, agreed {agreed:.2f}")

    policies = ("oracle", "oracle+c", "lookup", "gated", "best")
    table = []
    print(f"\n{'category':>16} " + " ".join(f"{p:>9}" for p in policies) + "  gated's (t1, t, k)")
    for category, group in sorted(texts.items()):
        row = {
            "oracle": ratio(group, rows, c, "oracle", (0, 0, args.k)),
            "oracle+c": ratio(group, rows, c, "oracle+c", (0, 0, args.k)),
            "lookup": max(ratio(group, rows, c, "lookup", (0, 0, k)) for k in range(1, args.k + 1)),
        }
        gated = max(
            (ratio(group, rows, c, "gated", (t1, t, k)), (t1, t, k))
            for t1 in GATES
            for t in CHAIN_GATES
            for k in (1, 2, 4, args.k)
        )
        row["gated"] = gated[0]
        row["best"] = max(row["lookup"], row["gated"], 1.0)
        draft_share = statistics.mean(
            sum(run > 0 for run in text.draft_run) / len(text.draft_run) for text in group
        )
        table.append({"category": category, **row, "gates": gated[1], "draft_right": draft_share})
        print(
            f"{category:>16} "
            + " ".join(f"{row[p]:>9.3f}" for p in policies)
            + f"  {gated[1]}  (draft right at {draft_share:.2f} of positions)"
        )
    geomeans = {p: math.exp(statistics.mean(math.log(row[p]) for row in table)) for p in policies}
    print(f"{'geomean':>16} " + " ".join(f"{geomeans[p]:>9.3f}" for p in policies))
    write_json(
        args.json, {"conditions": vars(args), "rows": rows, "c": c, "table": table, **geomeans}
    )


if __name__ == "__main__":
    main()
