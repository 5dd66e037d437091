"""Online serving: Poisson arrivals against a specbatch server over loopback.

    python benchmarks/serve.py --dataset ../shared/data/specbench_dev.jsonl \
        --rates 0.5 2 4 --num-requests 40 --speculative off auto

A server is started per speculation setting (``specbatch serve`` in a subprocess, on a free
port), all at once (an idle server waits on an event), and warmed up. Then for each request
rate, ``--repeats`` times, each setting in turn gets ``--num-requests`` streaming chat
requests arriving as a Poisson process (the same arrival times and prompts for every setting,
new arrival times per repeat; bounded by ``--max-seconds``): runs interleaved, so that the
drift of a shared machine hits every setting alike. Reported: TTFT, TPOT (per request, after
the first token), ITL (between streamed chunks) at p50/p99, request throughput and output
tok/s per run, in one table, then each setting's TTFT p50, TPOT p50 and output tok/s over the
first setting's at the same rate and repeat: the median of those ratios and their range
(``auto`` is the default: the goodput controller). ``--endpoints chat responses`` sends each
request both ways (``/v1/chat/completions`` and ``/v1/responses``, the same conversation and
``max_tokens`` / ``max_output_tokens``) to the same server, each its own setting
(``auto:responses``...), so the Responses API is measured against chat in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import load_specbench, print_conditions, write_json

# the ratios printed per setting and rate: (row key, label)
RATIOS = (("ttft_p50", "TTFT p50"), ("tpot_p50", "TPOT p50"), ("out_tok_s", "output tok/s"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(args: argparse.Namespace, speculative: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "specbatch.cli",
        "serve",
        "--port",
        str(port),
        "--speculative",
        speculative,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        "2048",
        "--log-level",
        "warning",
        "--quantization",
        args.quantization,
    ]
    if args.model:
        command += ["--model", args.model]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("server did not start")


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, endpoint: str = "chat"
) -> dict[str, Any]:
    if endpoint == "responses":
        path = "/v1/responses"
        body: dict[str, Any] = {
            "input": prompt,
            "max_output_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    else:
        path = "/v1/chat/completions"
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if endpoint == "responses":
                if chunk["type"] == "response.output_text.delta" and chunk["delta"]:
                    arrivals.append(time.perf_counter())
                elif chunk["type"] in ("response.completed", "response.incomplete"):
                    tokens = chunk["response"]["usage"]["output_tokens"]
                continue
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    ttft = (arrivals[0] - start) if arrivals else end - start
    itl = [b - a for a, b in itertools.pairwise(arrivals)]
    tpot = (end - arrivals[0]) / max(tokens - 1, 1) if arrivals else 0.0
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "tokens": tokens, "latency": end - start}


async def run_rate(
    url: str, prompts: list[str], rate: float, args: argparse.Namespace, endpoint: str = "chat"
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tasks = []
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(args.num_requests):
            if time.perf_counter() - start > args.max_seconds:
                break
            tasks.append(
                asyncio.create_task(
                    one_request(client, url, prompts[i % len(prompts)], args.max_tokens, endpoint)
                )
            )
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start

    def pct(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    itl = [x for r in results for x in r["itl"]]
    return {
        "requests": len(results),
        "seconds": elapsed,
        "req_s": len(results) / elapsed,
        "out_tok_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_p50": pct([r["ttft"] for r in results], 0.5),
        "ttft_p99": pct([r["ttft"] for r in results], 0.99),
        "tpot_p50": pct([r["tpot"] for r in results], 0.5),
        "tpot_p99": pct([r["tpot"] for r in results], 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
        "mean_latency": statistics.mean(r["latency"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--max-seconds", type=float, default=300)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--speculative", nargs="+", default=["off", "auto"])
    parser.add_argument("--endpoints", nargs="+", choices=["chat", "responses"], default=["chat"])
    parser.add_argument(
        "--quantization",
        choices=["auto", "gguf", "none"],
        default="none",
        help="the server's weights: none (float32), gguf (multiplied as stored) or auto",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every (setting, rate), interleaved"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    prompts = [p.text for p in load_specbench(args.dataset)]
    random.Random(args.seed).shuffle(prompts)
    print_conditions(
        "online serving (Poisson arrivals, loopback, streaming chat, greedy)",
        model=args.model or "SmolLM2-135M-Instruct",
        rates=args.rates,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs,
        speculative=args.speculative,
        endpoints=args.endpoints,
        quantization=args.quantization,
        repeats=args.repeats,
        dataset=args.dataset,
    )
    servers = {}
    rows = []
    try:
        for setting in args.speculative:
            servers[setting] = start_server(args, setting)
            warm_up = argparse.Namespace(**{**vars(args), "num_requests": 2, "max_tokens": 8})
            asyncio.run(run_rate(servers[setting][1], prompts[:2], 10.0, warm_up))
        settings = [
            (spec, endpoint, spec if len(args.endpoints) == 1 else f"{spec}:{endpoint}")
            for spec in args.speculative
            for endpoint in args.endpoints
        ]
        for rate in args.rates:
            for repeat in range(args.repeats):  # new arrival times per repeat, alike per setting
                run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + repeat})
                for spec, endpoint, setting in settings:
                    url = servers[spec][1]
                    result = asyncio.run(run_rate(url, prompts, rate, run_args, endpoint))
                    rows.append({"speculative": setting, "rate": rate, "repeat": repeat, **result})
                    print(f"{setting} @ {rate} req/s #{repeat}: {result}", flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    print()
    print(
        f"{'spec':>6} {'rate':>5} {'#':>2} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} "
        f"{'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}"
    )
    for r in rows:
        print(
            f"{r['speculative']:>6} {r['rate']:>5} {r['repeat']:>2} {r['req_s']:>6.2f} "
            f"{r['out_tok_s']:>7.1f} "
            f"{1000 * r['ttft_p50']:>8.0f}ms {1000 * r['ttft_p99']:>6.0f}ms "
            f"{1000 * r['tpot_p50']:>8.1f}ms {1000 * r['tpot_p99']:>6.1f}ms "
            f"{1000 * r['itl_p50']:>7.1f}ms {1000 * r['itl_p99']:>6.1f}ms"
        )
    first = settings[0][2]
    base = {(r["rate"], r["repeat"]): r for r in rows if r["speculative"] == first}
    print()
    for _, _, setting in settings[1:]:
        for rate in args.rates:
            runs = [r for r in rows if r["speculative"] == setting and r["rate"] == rate]
            ratios = {
                label: sorted(r[key] / base[(rate, r["repeat"])][key] for r in runs)
                for key, label in RATIOS
            }
            print(
                f"{setting} / {first} @ {rate} req/s, {len(runs)} runs: "
                + ", ".join(
                    f"{label} x{statistics.median(v):.2f} ({v[0]:.2f}..{v[-1]:.2f})"
                    for label, v in ratios.items()
                )
            )
    write_json(args.json, {"conditions": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
