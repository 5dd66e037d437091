"""Where a decode step's time goes: cProfile over decode steps of a running batch.

    python benchmarks/step_profile.py [--batch 64] [--dtype bfloat16] [--quantization gguf]

``--batch`` requests of 40-63 random tokens are admitted and decoded for 60 steps (so contexts
are ~100-120 positions), then 20 steps are timed plainly and 20 under cProfile. Prints the mean
step time and the functions taking the most time of their own (the linears are oneDNN's
``_linear_pointwise`` or ``gguf_linear``'s kernel, attention the ``_attend`` call).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_conditions
from specbatch import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    print_conditions(
        "decode steps under cProfile",
        batch=args.batch,
        dtype=args.dtype,
        quantization=args.quantization,
    )
    llm = LLM(
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.batch,
        max_model_len=2048,
        kv_cache_gib=1.0,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    rng = random.Random(0)
    for i in range(args.batch):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(40, 64))]
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
    for _ in range(60):
        engine.step()
    start = time.perf_counter()
    for _ in range(20):
        engine.step()
    print(f"decode step: {(time.perf_counter() - start) / 20 * 1e3:.1f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        engine.step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
