"""Repeated work across requests: speculation with the store of other requests' tokens (the
default's ``suffix`` way) against the same default without it, prompt lookup alone and off.

    python benchmarks/repeated_work.py --workloads extraction agent --batch-sizes 1 16 \
        --extraction-requests 500 --conversations 1 16 --turns 20

Workloads, built here (greedy, so every engine emits the same tokens; checked):

* ``extraction``: a ``specbatch run-batch`` file of chat requests, one question and one JSON
  schema (``response_format``: the keys are the grammar's forced tokens) over varied
  synthetic personnel records (three wordings); run by ``BatchJob`` (what ``run-batch``
  runs) with ``max_num_seqs`` the batch size. The store learns across the file's lines: the
  answers share their shape and, often, their values' wording.
* ``agent``: conversations that re-send their whole history each turn (an agent loop); the
  user asks for one edit of a Python function per turn (rename, add a docstring, a type hint,
  a guard...), the assistant's answer goes into the next turn's history. ``--conversations``
  run side by side, a turn of all of them per wave (batch = conversations).

Specs (each named by its ``speculative_config``): ``default`` (``None``: auto, the store on),
``no-suffix`` (``{"method": "auto", "suffix_store_tokens": 0}``), ``ngram``
(``{"method": "ngram"}``: prompt lookup alone), ``off`` (``{"method": "off"}``). One engine at
a time (each holds its KV reservation), in an order rotated every repeat; tok/s is completion
tokens over the workload's wall time, and each spec's ratio is over ``off`` of the same repeat.
Spec-Bench (the issue's workload c) is ``benchmarks/spec_decode.py --proposers default
default:suffix_store_tokens=0``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_conditions
from specbatch import LLM, SamplingParams, StructuredOutputsParams
from specbatch.batch import BatchJob
from specbatch.models.default_model import served_model_name

SPECS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "no-suffix": {"method": "auto", "suffix_store_tokens": 0},
    "ngram": {"method": "ngram"},
    "off": {"method": "off"},
}

FIRST = ["Maria", "John", "Aiko", "Lars", "Fatima", "Pedro", "Chen", "Olga", "Kwame", "Sofia"]
LAST = ["Silva", "Smith", "Tanaka", "Berg", "Haddad", "Costa", "Wang", "Petrova", "Mensah"]
CITIES = ["Lisbon", "Boston", "Osaka", "Oslo", "Cairo", "Recife", "Shanghai", "Kyiv", "Accra"]
JOBS = ["engineer", "nurse", "teacher", "accountant", "pilot", "chef", "lawyer", "designer"]
COMPANIES = ["Acme Corp", "Globex", "Initech", "Umbrella", "Stark Industries", "Wayne Enterprises"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "job": {"type": "string"},
        "company": {"type": "string"},
        "started": {"type": "integer"},
    },
    "required": ["name", "age", "city", "job", "company", "started"],
    "additionalProperties": False,
}


def extraction_prompt(rng: random.Random) -> str:
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    age, started = rng.randint(22, 64), rng.randint(1995, 2024)
    city, job, company = rng.choice(CITIES), rng.choice(JOBS), rng.choice(COMPANIES)
    record = rng.choice(
        [
            f"{name} ({age}) lives in {city}. {name.split()[0]} has worked as a {job} at "
            f"{company} since {started}.",
            f"Employee file: {company} hired {name}, aged {age}, as a {job} in {started}; "
            f"home town {city}.",
            f"In {started}, {name} joined {company}. The {age}-year-old {job} is based in {city}.",
        ]
    )
    return (
        f"Record: {record}\n\nWhat are this person's name, age, city, job, company, and the "
        "year they started? Answer in JSON."
    )


FUNCTION = """def total(items, rate):
    result = 0
    for item in items:
        price = item["price"] * item["count"]
        result = result + price
    return result * (1 + rate)"""
EDITS = [
    "Rename the variable `result` to `subtotal`.",
    "Add a docstring that says what the function returns.",
    "Add type hints: items is a list of dicts, rate is a float.",
    "Return 0 early when items is empty.",
    "Rename `price` to `line_total`.",
    "Use `+=` instead of `subtotal = subtotal + ...`.",
    "Raise ValueError when rate is negative.",
    "Rename the function to `order_total`.",
    "Round the result to 2 decimals.",
    "Skip items whose count is 0.",
]


def agent_turn(turn: int, conversation: int) -> str:
    edit = EDITS[(turn + conversation) % len(EDITS)]
    if turn == 0:
        code = f"```python\n{FUNCTION}\n```"
        return f"Here is a Python function:\n{code}\n{edit} Show the whole function."
    return f"{edit} Show the whole function again."


def run_extraction(
    llm: LLM, requests: int, max_tokens: int, folder: Path
) -> tuple[int, float, list[str]]:
    rng = random.Random(0)
    source = folder / "extraction.jsonl"
    with source.open("w") as f:
        for i in range(requests):
            body = {
                "messages": [{"role": "user", "content": extraction_prompt(rng)}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA},
                },
            }
            line = {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body,
            }
            f.write(json.dumps(line) + "\n")
    engine = llm.llm_engine
    out = folder / f"results-{time.monotonic_ns()}.jsonl"
    start = time.perf_counter()
    summary = BatchJob(engine, served_model_name(None, engine.model_path), progress=False).run(
        source, out
    )
    seconds = time.perf_counter() - start
    texts = [
        json.loads(line)["response"]["body"]["choices"][0]["message"]["content"]
        for line in out.read_text().splitlines()
    ]
    return summary.completion_tokens, seconds, sorted(texts)


def run_agent(
    llm: LLM, conversations: int, turns: int, max_tokens: int
) -> tuple[int, float, list[str]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    histories: list[list[dict[str, str]]] = [[] for _ in range(conversations)]
    tokens, texts = 0, []
    start = time.perf_counter()
    for turn in range(turns):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": agent_turn(turn, c)})
        outputs = llm.chat(histories, params, use_tqdm=False)
        for history, output in zip(histories, outputs, strict=True):
            reply = output.outputs[0]
            tokens += len(reply.token_ids)
            texts.append(reply.text)
            history.append({"role": "assistant", "content": reply.text})
    return tokens, time.perf_counter() - start, texts


def store_split(requests: int, max_tokens: int) -> None:
    """Whether data-parallel replicas should share what their stores learn: the extraction
    workload's requests (generated once, speculation off) replayed in order into one store
    (every request seen), two stores by turns (least-loaded routing of uniform requests),
    and two stores by record template (routing that keeps similar requests together). Per
    output position, the store's chain (the lookup the ``suffix`` way would draft) against
    the true continuation: the share of positions with a match whose first draft is right,
    and the mean run of right drafts (up to 8) over every position."""
    from specbatch.spec_decode.proposers.ngram import heaviest_chain
    from specbatch.spec_decode.proposers.suffix import SuffixStore
    from specbatch.spec_decode.tuning import SpeculationTuning

    llm = LLM(speculative_config={"method": "off"}, max_num_seqs=16)
    rng = random.Random(0)
    texts = [extraction_prompt(rng) for _ in range(requests)]
    # the record's wording (extraction_prompt's three): the first to one store, the others
    # to the other
    templates = [0 if "lives in" in t else 1 for t in texts]
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}])[1] for t in texts]
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    streams = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs, strict=True)]
    routings = {
        "one store": lambda i: 0,
        "two, by turns": lambda i: i % 2,
        "two, by template": lambda i: templates[i],
    }
    for name, route in routings.items():
        stores = [SuffixStore.tuned(1 << 18, SpeculationTuning()) for _ in range(2)]
        matched = first_right = right = positions = 0
        for i, (prompt, output) in enumerate(streams):
            store = stores[route(i)]
            for t in range(len(output)):
                hit = store.lookup(prompt + output[:t], 8)
                positions += 1
                if not hit.n:
                    continue
                matched += 1
                chain = heaviest_chain(hit.continuations)
                run = 0
                while run < len(chain) and t + run < len(output) and chain[run] == output[t + run]:
                    run += 1
                first_right += run > 0
                right += run
            store.insert(prompt + output)
        print(
            f"store split, {name}: {matched / positions:.3f} of positions matched, "
            f"{first_right / max(matched, 1):.3f} of those with the first draft right, "
            f"{right / positions:.2f} right drafts per position",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["extraction", "agent"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--specs", nargs="+", default=list(SPECS))
    parser.add_argument("--extraction-requests", type=int, default=500)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--store-split",
        type=int,
        default=0,
        help="only replay this many extraction requests into one store and two (see "
        "store_split), no timing",
    )
    args = parser.parse_args()
    if args.store_split:
        store_split(args.store_split, args.max_tokens)
        return
    print_conditions(
        "repeated work across requests: the store on, off, prompt lookup alone, speculation off",
        model="the default (SmolLM2-135M-Instruct GGUF, exact mode)",
        specs={name: SPECS[name] for name in args.specs},
        workloads=args.workloads,
        batch_sizes=args.batch_sizes,
        extraction_requests=args.extraction_requests,
        turns=args.turns,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        greedy="temperature 0; EOS ends a reply",
    )
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            for batch in args.batch_sizes:
                ratios: dict[str, list[float]] = {name: [] for name in args.specs}
                for repeat in range(args.repeats):
                    order = (
                        args.specs[repeat % len(args.specs) :]
                        + args.specs[: repeat % len(args.specs)]
                    )
                    rates: dict[str, float] = {}
                    outputs: dict[str, list[str]] = {}
                    for name in order:
                        llm = LLM(speculative_config=SPECS[name], max_num_seqs=max(batch, 1))
                        if workload == "extraction":
                            tokens, seconds, texts = run_extraction(
                                llm, args.extraction_requests, args.max_tokens, Path(tmp)
                            )
                        else:
                            tokens, seconds, texts = run_agent(
                                llm, batch, args.turns, args.max_tokens
                            )
                        stats = llm.llm_engine.stats
                        rates[name] = tokens / seconds
                        outputs[name] = texts
                        by_way = {
                            way: f"{stats.num_accepted_tokens_by_way.get(way, 0)}/{drafts}"
                            for way, drafts in sorted(stats.num_draft_tokens_by_way.items())
                        }
                        print(
                            f"{workload} b{batch} r{repeat} {name:>9}: {tokens} tokens in "
                            f"{seconds:.1f} s = {tokens / seconds:.1f} tok/s; accepted/drafted "
                            f"by way {by_way}; store {stats.suffix_store_requests} requests, "
                            f"{stats.suffix_hits}/{stats.suffix_lookups} lookups hit",
                            flush=True,
                        )
                        del llm
                        gc.collect()
                    same = all(outputs[name] == outputs[args.specs[0]] for name in args.specs)
                    if "off" in rates:
                        for name in args.specs:
                            ratios[name].append(rates[name] / rates["off"])
                    print(f"{workload} b{batch} r{repeat}: outputs identical across specs: {same}")
                if ratios.get("off"):
                    line = ", ".join(
                        f"{name} x{statistics.median(values):.2f}"
                        f" ({min(values):.2f}..{max(values):.2f})"
                        for name, values in ratios.items()
                    )
                    print(f"== {workload} batch {batch}, over off (median of repeats): {line}")


if __name__ == "__main__":
    main()
