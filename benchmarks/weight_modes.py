"""The CPU weight modes side by side: peak memory and greedy text against float32.

    python benchmarks/weight_modes.py [--prompts 32] [--max-tokens 128]

Each mode (``float32``, ``bfloat16``, ``quantization="gguf"``) runs in a fresh process (so its
peak resident memory, ``VmHWM``, is its own) on the first chat turns of the Spec-Bench dev file:
once at batch 1 (one prompt) and once with every prompt at once, then each prompt again alone
(prefix caching on: the batch left their prompts in the cache). Prints the peak memory, the
weights' bytes, how many prompts' greedy tokens equal float32's (with the median number of
tokens before a first difference), and how many give the same tokens alone as in the batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_conditions

DATASET = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "specbench_dev.jsonl"
MODES = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "gguf": {"quantization": "gguf"}}


def child(mode: str, count: int, max_tokens: int) -> None:
    from specbatch import LLM, SamplingParams

    prompts = [json.loads(line)["turns"][0] for line in DATASET.open()][:count]
    llm = LLM(max_num_seqs=count, max_model_len=2048, **MODES[mode])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    outputs = llm.chat(messages, params, use_tqdm=False)
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    alone = [list(llm.chat([m], params, use_tqdm=False)[0].outputs[0].token_ids) for m in messages]
    result = {
        "peak_mib": peak / 1024,
        "weights_mib": llm.llm_engine.model.weight_bytes() / 2**20,
        "tokens": tokens,
        "alone_equal": sum(a == b for a, b in zip(alone, tokens, strict=True)),
    }
    print(json.dumps(result))


def run(mode: str, count: int, max_tokens: int) -> dict:
    command = [sys.executable, __file__, "--child", mode, str(count), str(max_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    print_conditions(
        "CPU weight modes: peak memory and greedy text against float32",
        prompts=f"{args.prompts} first turns of {DATASET.name}",
        max_tokens=args.max_tokens,
    )
    reference = None
    for mode in MODES:
        single = run(mode, 1, args.max_tokens)
        batch = run(mode, args.prompts, args.max_tokens)
        reference = reference or batch["tokens"]
        same = sum(a == b for a, b in zip(batch["tokens"], reference, strict=True))
        firsts = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(batch["tokens"], reference, strict=True)
        ]
        print(
            f"{mode:9s} weights {batch['weights_mib']:5.0f} MiB, peak RSS batch 1 "
            f"{single['peak_mib']:5.0f} MiB, batch {args.prompts} {batch['peak_mib']:5.0f} MiB; "
            f"greedy text equal to float32 on {same}/{len(reference)} prompts (median tokens "
            f"before a difference: {statistics.median(firsts):.0f}); alone as in the batch "
            f"on {batch['alone_equal']}/{len(reference)}"
        )


if __name__ == "__main__":
    main()
