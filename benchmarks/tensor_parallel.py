"""Tensor parallelism on this machine: the same requests with 1, 2, ... ranks, same run.

    python benchmarks/tensor_parallel.py --sizes 1 3 --batch-sizes 1 16 --max-tokens 64

On a 2-core CPU no gain is expected (the ranks share the cores and every layer adds two gloo
all-reduces); the point is that the split model computes the same text, measured for the record:
tok/s per (ranks, batch), the ratio to one rank, and whether the greedy text equals one rank's.
SmolLM2-135M splits 1 or 3 ways (9 query heads, 3 KV heads). Speculation is off unless
``--speculative auto``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_specbench, print_conditions
from specbatch import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="../shared/data/specbench_dev.jsonl")
    parser.add_argument("--model", default=None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speculative", choices=["auto", "off"], default="off")
    args = parser.parse_args()
    pool = [p.text for p in load_specbench(args.dataset)]
    print_conditions(
        "tensor parallelism: ranks vs one process (greedy, EOS ignored)",
        sizes=args.sizes,
        batch_sizes=args.batch_sizes,
        max_tokens=args.max_tokens,
        speculative=args.speculative,
    )
    baseline: dict[int, tuple[float, list[list[int]]]] = {}
    for size in args.sizes:
        llm = LLM(
            args.model,
            dtype="float32",
            max_model_len=1024,
            max_num_seqs=max(args.batch_sizes),
            tensor_parallel_size=size,
            speculative_config=None if args.speculative == "auto" else {"method": "off"},
        )
        tokenizer = llm.get_tokenizer()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        for batch in args.batch_sizes:
            prompts = [
                tokenizer.encode_chat([{"role": "user", "content": pool[i % len(pool)]}])[1]
                for i in range(batch)
            ]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            rate = sum(map(len, tokens)) / seconds
            if batch not in baseline:
                baseline[batch] = (rate, tokens)
            base_rate, base_tokens = baseline[batch]
            print(
                f"tp={size} batch={batch:<3} {rate:8.1f} tok/s  x{rate / base_rate:.2f} of "
                f"tp={args.sizes[0]}  same text: {tokens == base_tokens}",
                flush=True,
            )
        llm.shutdown()
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
