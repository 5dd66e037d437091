"""Does the KV pool's size, or the order its free list hands blocks out, move a decode step?

    python benchmarks/kv_block_order.py --dataset ../shared/data/specbench_dev.jsonl

Speculation off, batch 1 (the prompts one at a time: code_editing, writing and qa), engines in
lockstep by tokens emitted (``spec_decode.run_lockstep``), every output the same. The engines
differ only in their KV pool: ``max_num_seqs`` 16, 64 and 128 (the pool is sized from it) with
the pool's own free list (first in, first out: a sequence's blocks come in ascending order, so
its block table walks memory forwards), and one of 128 whose free list hands out the most
recently freed block first (last in, first out: a table in descending order). Printed: tok/s
per engine and its ratio to the first, per repeat.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.code_edit_prompt import CODE_EDIT_PROMPTS
from benchmarks.common import load_specbench, print_conditions
from benchmarks.spec_decode import run, run_lockstep
from specbatch import LLMEngine
from specbatch.cache.block_pool import BlockPool
from specbatch.config import EngineConfig


def last_in_first_out(pool: BlockPool) -> None:
    """Make ``pool`` hand out the most recently freed blocks first."""

    def allocate(self: BlockPool, count: int) -> list[int]:
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=True)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    pool.allocate = types.MethodType(allocate, pool)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    engines: dict[str, LLMEngine] = {}
    for name, seqs in (("fifo16", 16), ("fifo64", 64), ("fifo128", 128), ("lifo128", 128)):
        config = EngineConfig(
            max_model_len=2048,
            max_num_seqs=seqs,
            enable_prefix_caching=False,
            speculative_config={"method": "off"},
        )
        engines[name] = LLMEngine(config)
    last_in_first_out(engines["lifo128"].cache.pool)
    data = load_specbench(args.dataset, None)
    texts = list(CODE_EDIT_PROMPTS[:2])
    for category, count in (("writing", 2), ("qa", 4)):
        texts += [p.text for p in data if p.category == category][:count]
    tokenizer = engines["fifo16"].tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}])[1] for t in texts]
    print_conditions(
        "KV pool size and block order, speculation off, batch 1 (lockstep)",
        engines={name: engine.num_kv_blocks for name, engine in engines.items()},
        prompts=len(prompts),
        max_tokens=args.max_tokens,
        repeats=args.repeats,
    )
    for engine in engines.values():  # warm-up
        run(engine, prompts[:1], 8, 1)
    for r in range(args.repeats):
        results = run_lockstep(engines, prompts, args.max_tokens, 1)
        base = results["fifo16"]
        same = all(res["outputs"] == base["outputs"] for res in results.values())
        cells = " ".join(
            f"{name} {res['tok_s']:.1f} tok/s (x{res['tok_s'] / base['tok_s']:.3f})"
            for name, res in results.items()
        )
        print(f"repeat {r + 1}: {cells}" + ("" if same else "  OUTPUT DIFFERS"), flush=True)


if __name__ == "__main__":
    main()
