"""The sampler at batch: top-k/top-p by candidate tiers against sorting every row.

    python benchmarks/sampler.py [--rows 64] [--repeats 5]

Logits are SmolLM2-135M's own (float32), from the last positions of chat-templated Spec-Bench
prompts, ``--rows`` of them. For each setting, the time of ``target_probs`` (the distribution
every row samples from) with the tiers and with sorting every row (``CANDIDATE_TIERS = ()``),
measured in the same run, and where the rows' top-k/nucleus sets end: within the 256 largest
logits, within 4096, or past them (sorted whole). Then greedy rows (``sample`` with every row
greedy: the argmax) at 1, 5 and ``--rows`` rows, ``row_argmax`` (numpy's on the CPU) against
torch's ``argmax``, the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import print_conditions
from specbatch.kernels import sampling
from specbatch.kernels.sampling import SamplingRow, SamplingTensors, target_probs
from specbatch.models import load_model
from specbatch.models.default_model import default_model_path
from specbatch.sampling_params import SamplingParams
from specbatch.tokenizer import load_tokenizer
from tests.helpers import PagedHarness

DATASET = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "specbench_dev.jsonl"
SETTINGS = {
    "T=1.0 top_p=0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "T=0.8 top_k=50": SamplingParams(temperature=0.8, top_k=50),
    "T=0.7 top_p=0.9 top_k=40": SamplingParams(temperature=0.7, top_p=0.9, top_k=40),
    "T=1.3 top_p=0.95": SamplingParams(temperature=1.3, top_p=0.95),
}


def model_logits(rows: int) -> torch.Tensor:
    """``rows`` rows of the model's logits: the last 8 positions of each chat prompt."""
    path = default_model_path()
    model, tokenizer = load_model(path), load_tokenizer(path)
    prompts = [json.loads(line)["turns"][0] for line in DATASET.open()]
    out: list[torch.Tensor] = []
    for text in prompts[: -(-rows // 8)]:
        _, ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        out.append(PagedHarness(model, num_blocks=96).forward([(0, ids)])[0][-8:])
    return torch.cat(out)[:rows]


def time_probs(logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    rows = [SamplingRow(params, [], [], position=0) for _ in range(logits.shape[0])]
    tensors = SamplingTensors.build(rows, logits.shape[1], logits.device)
    target_probs(logits, tensors)  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        target_probs(logits, tensors)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def tiers_reached(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """Rows whose sets end within each tier, then the rows sorted whole."""
    scaled = logits / params.temperature
    vocab = logits.shape[1]
    top_k = torch.full((len(scaled),), min(params.top_k, vocab) or vocab)
    top_p = torch.full((len(scaled),), params.top_p)
    pending = torch.arange(len(scaled))
    counts = []
    for candidates in sampling.CANDIDATE_TIERS:
        _, done = sampling._within_candidates(
            scaled[pending], candidates, top_k[pending], top_p[pending]
        )
        counts.append(int(done.sum()))
        pending = pending[~done]
    return [*counts, len(pending)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print_conditions(
        "target_probs at batch: candidate tiers vs sorting every row",
        rows=f"{args.rows} rows of SmolLM2-135M logits (vocabulary 49152)",
        tiers=sampling.CANDIDATE_TIERS,
        repeats=args.repeats,
    )
    logits = model_logits(args.rows)
    tiers = sampling.CANDIDATE_TIERS
    for name, params in SETTINGS.items():
        fast = time_probs(logits, params, args.repeats)
        sampling.CANDIDATE_TIERS = ()
        try:
            sorted_ms = time_probs(logits, params, args.repeats)
        finally:
            sampling.CANDIDATE_TIERS = tiers
        within = tiers_reached(logits, params)
        print(
            f"{name:26s} tiers {fast:7.1f} ms, sort every row {sorted_ms:7.1f} ms "
            f"({sorted_ms / fast:4.1f}x); rows ending within 256 / 4096 / sorted whole: "
            + " / ".join(map(str, within))
        )
    for count in (1, 5, args.rows):
        greedy = time_greedy(logits[:count], args.repeats)
        plain = time_greedy(logits[:count], args.repeats, torch_argmax=True)
        print(
            f"greedy, {count:3d} rows: row_argmax {1e3 * greedy:7.1f} us, torch argmax "
            f"{1e3 * plain:7.1f} us ({plain / greedy:4.1f}x)"
        )


def time_greedy(logits: torch.Tensor, repeats: int, torch_argmax: bool = False) -> float:
    """Milliseconds of ``sample`` for greedy rows (with torch's argmax in place of
    ``row_argmax`` if ``torch_argmax``)."""
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], 0) for _ in logits]
    original = sampling.row_argmax
    if torch_argmax:
        sampling.row_argmax = lambda x: x.argmax(-1)
    try:
        samples = []
        for _ in range(max(repeats, 1) * 20):
            start = time.perf_counter()
            sampling.sample(logits, rows, torch.Generator())
            samples.append(time.perf_counter() - start)
    finally:
        sampling.row_argmax = original
    return statistics.median(samples) * 1e3


if __name__ == "__main__":
    main()
