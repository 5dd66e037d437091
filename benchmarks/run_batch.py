"""``specbatch run-batch`` throughput against ``LLM.generate`` on the same prompts, same run.

    python benchmarks/run_batch.py --dataset ../shared/data/specbench_dev.jsonl \
        --num-prompts 1000 --max-tokens 128

The prompts are the dev file's first turns, cycled to ``--num-prompts``, as chat requests at
temperature 0. ``generate``: their chat token ids through ``LLM.generate`` (one call, every
prompt at once). ``run-batch``: the same requests written as an OpenAI batch file and run by
``BatchJob`` (what ``specbatch run-batch`` runs) into a results file, with an engine of the
same configuration. Both count the completion tokens they return; the ratio is run-batch
tok/s over generate tok/s (the file path must not cost throughput: target >= 0.95). Engines are
made one at a time (each holds its own KV reservation); ``--repeats`` alternates them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_specbench, print_conditions
from specbatch import LLM, SamplingParams
from specbatch.batch import BatchJob
from specbatch.models.default_model import served_model_name


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": 2048,
        "speculative_config": {"method": args.speculative},
    }


def run_generate(args: argparse.Namespace, texts: list[str]) -> tuple[float, int, list[str]]:
    llm = LLM(**engine_kwargs(args))
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}])[1] for t in texts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    gc.collect()
    return seconds, tokens, [o.outputs[0].text for o in outputs]


def run_batch(
    args: argparse.Namespace, source: Path, folder: Path
) -> tuple[float, int, dict[str, str]]:
    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    out = folder / f"results-{time.monotonic_ns()}.jsonl"
    start = time.perf_counter()
    summary = BatchJob(
        engine, served_model_name(args.model, engine.model_path), progress=False
    ).run(source, out)
    seconds = time.perf_counter() - start
    texts = {}
    for line in out.read_text().splitlines():
        record = json.loads(line)
        texts[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    del llm, engine
    gc.collect()
    return seconds, summary.completion_tokens, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--speculative", choices=["auto", "off"], default="auto")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    pool = [p.text for p in load_specbench(args.dataset)]
    texts = [pool[i % len(pool)] for i in range(args.num_prompts)]
    print_conditions(
        "run-batch vs LLM.generate (same prompts, same engine configuration)",
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        distinct_prompts=len(pool),
        max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        speculative=args.speculative,
        repeats=args.repeats,
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "requests.jsonl"
        with source.open("w") as f:
            for i, text in enumerate(texts):
                line = {
                    "custom_id": f"request-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "messages": [{"role": "user", "content": text}],
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                    },
                }
                f.write(json.dumps(line) + "\n")
        ratios = []
        for repeat in range(args.repeats):
            g_seconds, g_tokens, g_texts = run_generate(args, texts)
            b_seconds, b_tokens, b_texts = run_batch(args, source, folder)
            same = sum(b_texts[f"request-{i}"] == t for i, t in enumerate(g_texts))
            g_rate, b_rate = g_tokens / g_seconds, b_tokens / b_seconds
            ratios.append(b_rate / g_rate)
            print(
                f"repeat {repeat}: generate {g_tokens} tokens in {g_seconds:.1f} s "
                f"({g_rate:.1f} tok/s); run-batch {b_tokens} tokens in {b_seconds:.1f} s "
                f"({b_rate:.1f} tok/s); ratio x{b_rate / g_rate:.3f}; "
                f"identical text {same}/{len(texts)}",
                flush=True,
            )
    print(
        f"run-batch / generate: median x{statistics.median(ratios):.3f} "
        f"({min(ratios):.3f}..{max(ratios):.3f}) over {len(ratios)} repeat(s)"
    )


if __name__ == "__main__":
    main()
