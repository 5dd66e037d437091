"""Shared benchmark helpers: conditions banner, prompts, timing statistics, HF baseline,
resident memory."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def print_conditions(title: str, **conditions: Any) -> None:
    """Print what a benchmark measured under, before any number."""
    import specbatch

    print(f"== {title}")
    versions = {
        "specbatch": specbatch.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, torch threads "
        f"{torch.get_num_threads()}, cuda={torch.cuda.is_available()}"
    )
    for key, value in conditions.items():
        print(f"{key}: {value}")


@dataclass
class Prompt:
    text: str
    category: str


def load_specbench(
    path: str | Path, categories: Sequence[str] | None = None, limit_per_category: int | None = None
) -> list[Prompt]:
    """First turns of the Spec-Bench questions in ``path`` (jsonl), optionally filtered."""
    prompts: list[Prompt] = []
    per_category: dict[str, int] = {}
    with open(path) as handle:
        for line in handle:
            row = json.loads(line)
            category = row["category"]
            if categories and category not in categories:
                continue
            if limit_per_category and per_category.get(category, 0) >= limit_per_category:
                continue
            per_category[category] = per_category.get(category, 0) + 1
            prompts.append(Prompt(row["turns"][0], category))
    return prompts


def median_and_spread(values: Sequence[float]) -> tuple[float, float]:
    """Median and half the min-max range."""
    return statistics.median(values), (max(values) - min(values)) / 2


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """The median wall time of ``fn`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def hf_model(path: Path, dtype: torch.dtype) -> Any:
    """HF transformers on the same weights (a GGUF file or a HF directory)."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        ).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def hf_generate_tokens(
    model: Any, batches: Sequence[Sequence[Sequence[int]]], output_len: int, pad_id: int
) -> int:
    """Greedy ``generate`` over left-padded static batches; returns tokens generated."""
    total = 0
    for batch in batches:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, prompt in enumerate(batch):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_id,
            )
        total += (out.shape[1] - width) * len(batch)
    return total


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def resident_bytes(ranges: list[tuple[int, int]]) -> int:
    """Resident bytes of this process's mappings that overlap the given address ranges (read
    from ``/proc/self/smaps``: the KV cache is committed as its blocks are first used)."""
    total, current = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                current = (start, end)
            elif (
                head == "Rss:"
                and current is not None
                and any(s < current[1] and current[0] < e for s, e in ranges)
            ):
                total += int(line.split()[1]) * 1024
    return total


def kv_ranges(engine: Any) -> list[tuple[int, int]]:
    """The address ranges of an engine's KV caches (the target's and a draft model's)."""
    ranges = []
    models = [engine.model] + ([engine.draft_model] if engine.draft_model is not None else [])
    for model in models:
        for layer in model.model.layers:
            for tensor in layer.self_attn.kv_cache or ():
                start = tensor.data_ptr()
                ranges.append((start, start + tensor.numel() * tensor.element_size()))
    return ranges
