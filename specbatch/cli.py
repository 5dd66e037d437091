"""The ``specbatch`` command line: ``generate`` streams a completion, ``serve`` runs the
OpenAI-compatible server, ``distill-draft`` trains a draft model for a target, ``train-head`` a
draft head on its features."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specbatch.errors import ConfigError, SpecbatchError
from specbatch.spec_decode.config import DEFAULT_DRAFT_CONFIDENCE

if TYPE_CHECKING:
    from specbatch.config import EngineConfig


def _add_speculative_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=["auto", "off", "ngram", "suffix", "draft", "eagle", "hybrid"],
        default="auto",
        help="speculative decoding proposer (default: auto; 'eagle' drafts with a head on the "
        "target's own features, --draft-model being a head directory or the shipped head; "
        "'hybrid' is n-gram prompt lookup "
        "where the text repeats and the draft model elsewhere; 'suffix' is n-gram prompt "
        "lookup plus a store of recent requests' prompts and outputs (speculation across "
        "requests, also kept by hybrid and auto unless --suffix-store-tokens 0); 'auto' is "
        "hybrid with --draft-model or for a model the shipped draft fits (SmolLM2-135M-Instruct, "
        "recognised by shape and vocabulary), else suffix; 'draft' and 'hybrid' without "
        "--draft-model use the shipped draft). Unless --fixed-k, a goodput controller gives "
        "each sequence, each step, the drafts that make the step fastest per token (often "
        "none with many concurrent sequences): outputs are the same as with 'off'",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft model (or draft head) path for --speculative draft/eagle/hybrid",
    )
    parser.add_argument(
        "--draft-confidence",
        type=float,
        default=None,
        help="a draft model stops drafting after the draft that brings its probability that all "
        f"its drafts are right below this (default {DEFAULT_DRAFT_CONFIDENCE}; 0 always drafts k "
        "tokens)",
    )
    parser.add_argument(
        "--fixed-k",
        action="store_true",
        help="verify k drafts for every sequence every step (no goodput controller)",
    )
    parser.add_argument(
        "--ngram-min",
        type=int,
        default=None,
        help="shortest repeated suffix that prompt lookup uses (default: 1 for ngram, "
        "2 for hybrid)",
    )
    parser.add_argument(
        "--suffix-store-tokens",
        type=int,
        default=None,
        help="tokens of recent finished requests kept for speculation across requests "
        "(default 262144 for auto, suffix and hybrid; 0: none)",
    )
    parser.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft tokens verified per step at most (default 8 under the goodput controller, "
        "4 with --fixed-k)",
    )


def speculative_config(args: argparse.Namespace) -> dict[str, object]:
    """The engine's speculative_config for the command-line flags."""
    method = args.speculative
    unused = [
        flag
        for flag, given, used_by in (
            ("--fixed-k", args.fixed_k, ("auto", "ngram", "suffix", "draft", "eagle", "hybrid")),
            ("--ngram-min", args.ngram_min is not None, ("auto", "ngram", "suffix", "hybrid")),
            (
                "--suffix-store-tokens",
                args.suffix_store_tokens is not None,
                ("auto", "suffix", "hybrid"),
            ),
            ("--draft-model", args.draft_model is not None, ("auto", "draft", "eagle", "hybrid")),
            (
                "--draft-confidence",
                args.draft_confidence is not None,
                ("auto", "draft", "eagle", "hybrid"),
            ),
            (
                "-k",
                args.num_speculative_tokens is not None,
                ("auto", "ngram", "suffix", "draft", "eagle", "hybrid"),
            ),
        )
        if given and method not in used_by
    ]
    if unused:
        raise ConfigError(f"{', '.join(unused)} has no effect with --speculative {method}")
    if method == "off":
        return {"method": "off"}
    config: dict[str, object] = {"method": "draft_model" if method == "draft" else method}
    if args.num_speculative_tokens is not None:
        config["num_speculative_tokens"] = args.num_speculative_tokens
    if args.fixed_k:
        config["adaptive_k"] = False
    if args.suffix_store_tokens is not None:
        config["suffix_store_tokens"] = args.suffix_store_tokens
    if args.ngram_min is not None:  # else the method's default (1-4 for ngram, 2-4 for hybrid)
        config.update(prompt_lookup_min=args.ngram_min, prompt_lookup_max=max(4, args.ngram_min))
    if method in ("auto", "draft", "eagle", "hybrid"):
        if args.draft_model is not None or method != "auto":
            config["model"] = args.draft_model
        if args.draft_confidence is not None:
            config["draft_confidence_threshold"] = args.draft_confidence
    return config


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig of the shared engine flags (and the speculative ones)."""
    from specbatch.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        kv_cache_gib=args.kv_cache_gib,
        num_kv_blocks=args.num_kv_blocks,
        quantization=None if args.quantization == "none" else args.quantization,
        speculative_config=speculative_config(args),
        tensor_parallel_size=args.tensor_parallel_size,
        structured_outputs_backend=args.structured_outputs_backend,
        **overrides,
    )


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument(
        "--quantization",
        choices=["auto", "gguf", "none"],
        default="auto",
        help="gguf: multiply with a GGUF model's Q4_1/Q8_0 blocks as stored (CPU, float32 "
        "activations); none: dequantise the weights to --dtype; auto: gguf where it is the "
        "fastest exact mode (the CPU, --dtype auto, a file the kernel reads), else none",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many processes (gloo on the CPU, one GPU each on CUDA)",
    )
    parser.add_argument(
        "--structured-outputs-backend",
        choices=["llguidance", "xgrammar"],
        default="llguidance",
        help="what compiles and matches structured outputs (xgrammar when installed)",
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache size in GiB (default: what --max-num-seqs sequences of --max-model-len "
        "tokens can use, within the free memory; at most 4 GiB on the CPU, where memory is "
        "committed as the cache fills)",
    )
    cache.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV cache size in blocks of 16 tokens"
    )


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="stream a completion for one prompt")
    p.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    _add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--quiet", action="store_true", help="do not print the statistics line")
    _add_speculative_args(p)
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from specbatch.engine.llm_engine import LLMEngine
    from specbatch.sampling_params import OutputKind, SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        output_kind=OutputKind.DELTA,
    )
    started = time.monotonic()
    engine = LLMEngine(engine_config(args, max_num_seqs=1))
    loaded = time.monotonic()
    if args.chat:
        text, token_ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        engine.add_request("cli", text, params, prompt_token_ids=token_ids)
    else:
        engine.add_request("cli", prompt, params)
    generated, reason, metrics = 0, None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            sys.stdout.write(completion.text)
            sys.stdout.flush()
            generated += len(completion.token_ids)
            reason, metrics = completion.finish_reason, output.metrics
    sys.stdout.write("\n")
    elapsed = time.monotonic() - loaded
    if not args.quiet:
        spec = ""
        if metrics is not None and metrics.num_drafts:
            spec_config = engine.speculative_config
            assert spec_config is not None
            spec = (
                f"; {spec_config.method} k<={spec_config.k}: mean accepted "
                f"length {metrics.mean_accepted_length:.2f}, acceptance "
                f"{metrics.acceptance_rate:.0%}"
            )
        print(
            f"[{generated} tokens in {elapsed:.2f} s, {generated / max(elapsed, 1e-9):.1f} tok/s"
            f"{spec}; finish: {reason}; weights: {engine.weight_mode}; model loaded in "
            f"{loaded - started:.1f} s]",
            file=sys.stderr,
        )
    return 0


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="waiting requests beyond which new ones get HTTP 429",
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=None,
        help="/v1/responses kept for previous_response_id, the oldest dropped first (0: off; "
        "default 256)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas, each its own process with its share of the cores (or its own "
        "GPU), behind this one server; each request goes to the least-loaded replica, the one "
        "holding its prompt's prefix among equals; a replica that dies is restarted",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on shutdown",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 << 20,
        help="larger request bodies get HTTP 413 (default 16 MiB)",
    )
    p.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve /metrics without the API key (everything but /health needs it otherwise)",
    )
    p.add_argument(
        "--allow-priority",
        action="store_true",
        help="let clients set a request's scheduling priority (refused otherwise)",
    )
    p.add_argument("--log-level", default="info")
    _add_speculative_args(p)
    p.set_defaults(handler=_serve)


SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


def _serve(args: argparse.Namespace) -> int:
    import importlib.util

    from specbatch.errors import ConfigError

    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"specbatch serve needs {', '.join(missing)}: pip install 'specbatch[server]'"
        )
    from specbatch.server.serve import serve

    return serve(args, engine_config(args, max_num_seqs=args.max_num_seqs))


def _add_run_batch(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests (JSONL) into a file of results; resumable",
    )
    p.add_argument("-i", "--input", required=True, help="requests, one JSON object per line")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="results, appended as they finish; rerun to resume after a kill",
    )
    p.add_argument(
        "--shard",
        default="0/1",
        help="i/n: take only the lines whose 0-based number is i modulo n (split one input "
        "over n processes or machines, each with its own output)",
    )
    _add_engine_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name a body's model must match (default: as specbatch serve lists it)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--ray",
        action="store_true",
        help="run the job over a Ray cluster (RAY_ADDRESS or --ray-address; a local one if "
        "neither): a pool of --replicas engines, each on its share of the CPUs; needs "
        "pip install 'specbatch[ray]'",
    )
    p.add_argument("--replicas", type=int, default=2, help="engines in the Ray pool (--ray)")
    p.add_argument("--ray-address", default=None, help="a running Ray cluster's address")
    _add_speculative_args(p)
    p.set_defaults(handler=_run_batch)


def _run_batch(args: argparse.Namespace) -> int:
    from specbatch.batch import BatchJob, Shard
    from specbatch.engine.llm_engine import LLMEngine
    from specbatch.models.default_model import served_model_name

    shard = Shard.parse(args.shard)
    if args.ray:
        return _run_batch_on_ray(args, shard)
    if args.ray_address is not None or args.replicas != 2:
        raise ConfigError("--replicas and --ray-address need --ray")
    engine = LLMEngine(engine_config(args, max_num_seqs=args.max_num_seqs))
    name = args.served_model_name or served_model_name(args.model, engine.model_path)
    job = BatchJob(engine, name, shard, progress=not args.no_progress)
    summary = job.run(args.input, args.output)
    print(
        f"run-batch: {summary.lines} requests in shard {shard.index}/{shard.count}: "
        f"{summary.succeeded} succeeded, {summary.failed} failed, {summary.skipped} already "
        f"done; {summary.completion_tokens} tokens in {summary.seconds:.1f} s "
        f"({summary.completion_tokens / max(summary.seconds, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _run_batch_on_ray(args: argparse.Namespace, shard: Any) -> int:
    from specbatch.batch.ray_job import RayBatchSettings, run_on_ray
    from specbatch.models import resolve_model_path
    from specbatch.models.default_model import served_model_name

    if shard.count != 1:
        raise ConfigError("--shard and --ray: the Ray pool splits the job itself")
    config = engine_config(args, max_num_seqs=args.max_num_seqs)
    name = args.served_model_name or served_model_name(args.model, resolve_model_path(config.model))
    settings = RayBatchSettings(replicas=args.replicas, address=args.ray_address)
    summary = run_on_ray(
        config, args.input, args.output, name, settings, progress=not args.no_progress
    )
    print(
        f"run-batch --ray: {summary.lines} requests over {args.replicas} replicas: "
        f"{summary.succeeded} succeeded, {summary.failed} failed, {summary.skipped} already "
        f"done; {summary.completion_tokens} tokens in {summary.seconds:.1f} s "
        f"({summary.completion_tokens / max(summary.seconds, 1e-9):.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _add_distill(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("distill-draft", help="train a draft model for a target")
    p.add_argument("--target", default=None, help="target model (default: SmolLM2-135M)")
    p.add_argument("--work", required=True, help="work directory (resumable stages)")
    p.add_argument("--out", required=True, help="where to write the chosen draft")
    p.add_argument(
        "--sizes",
        default="4x256",
        help="comma-separated student shapes: LAYERSxHIDDEN for a fresh model (e.g. 2x256), or L "
        "and target layer indices joined by + for one made of the target's own layers (e.g. "
        "L0+29); default 4x256",
    )
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument(
        "--extra-prompts",
        type=int,
        default=0,
        help="answers to the extra prompt families (extraction, passages, role play, ...)",
    )
    p.add_argument(
        "--max-len", type=int, default=1152, help="longest answer row trained on (tokens)"
    )
    p.add_argument("--answer-tokens", type=int, default=192)
    p.add_argument("--text-chars", type=int, default=1_500_000)
    p.add_argument(
        "--text-share",
        type=float,
        default=0.3,
        help="largest share of training tokens taken from plain text (default 0.3)",
    )
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--generation-batch", type=int, default=32, help="sequences the target answers at once"
    )
    p.set_defaults(handler=_distill)


def _distill(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specbatch.distill import DistillConfig, parse_shape, run

    run(
        DistillConfig(
            work=Path(args.work),
            out=Path(args.out),
            target=args.target,
            shapes=[parse_shape(s) for s in args.sizes.split(",")],
            num_prompts=args.num_prompts,
            extra_prompts=args.extra_prompts,
            max_len=args.max_len,
            answer_tokens=args.answer_tokens,
            text_chars=args.text_chars,
            text_share=args.text_share,
            vocab_size=args.vocab_size,
            steps=args.steps,
            tokens_per_batch=args.tokens_per_batch,
            lr=args.lr,
            seed=args.seed,
            generation_batch=args.generation_batch,
        )
    )
    return 0


def _add_train_head(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train-head", help="train a draft head (EAGLE-style) on a target's own features"
    )
    p.add_argument("--target", default=None, help="target model (default: SmolLM2-135M)")
    p.add_argument("--work", required=True, help="work directory (resumable stages)")
    p.add_argument("--out", required=True, help="where to write the head")
    p.add_argument("--num-prompts", type=int, default=1200)
    p.add_argument(
        "--extra-prompts",
        type=int,
        default=1200,
        help="answers to the extra prompt families (extraction, passages, role play, ...)",
    )
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument(
        "--max-len", type=int, default=1152, help="longest answer row trained on (tokens)"
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="for a non-default target")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--unroll",
        type=int,
        default=2,
        help="training passes per batch, each on the head's own features of the one before",
    )
    p.add_argument("--feature-weight", type=float, default=0.1)
    p.add_argument(
        "--init", default=None, help="a head directory to go on training (a second stage)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--generation-batch", type=int, default=48, help="sequences the target answers at once"
    )
    p.set_defaults(handler=_train_head)


def _train_head(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specbatch.distill.head import HeadTrainConfig, run

    if args.unroll < 1 or args.steps < 1:
        raise SystemExit("--unroll and --steps must be at least 1")
    run(
        HeadTrainConfig(
            work=Path(args.work),
            out=Path(args.out),
            target=args.target,
            num_prompts=args.num_prompts,
            extra_prompts=args.extra_prompts,
            answer_tokens=args.answer_tokens,
            max_len=args.max_len,
            vocab_size=args.vocab_size,
            steps=args.steps,
            tokens_per_batch=args.tokens_per_batch,
            lr=args.lr,
            unroll=args.unroll,
            feature_weight=args.feature_weight,
            seed=args.seed,
            generation_batch=args.generation_batch,
            init=Path(args.init) if args.init else None,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specbatch",
        description="LLM inference with continuous batching and speculative decoding.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_run_batch(subparsers)
    _add_distill(subparsers)
    _add_train_head(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specbatch`` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (SpecbatchError, ValueError) as exc:
        print(f"specbatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
