"""One-call GPU check: CUDA tests, attention kernel, engine decode, speculative decoding.

On the device machine (no network; the machine's own torch and Triton):

    pip install --no-build-isolation --no-deps -e . && python benchmarks/gpu_check.py

Prints one table at the end (and writes it, with JSON, under ``$OUT`` when set):

(a) the Triton paged-attention kernel: max error against a float32 reference and its time
    against torch's FlashAttention (``scaled_dot_product_attention``, flash backend) on equal
    contiguous prefill shapes; decode bandwidth (KV bytes read / time) at batch 64 x 4K context;
(b) engine decode steps on a Llama-3.2-1B-shaped model with random bf16 weights at batch 1, 16,
    64 (CUDA graphs): ms per step and tok/s, against the linear-layer floor measured in the same
    run (the same weights as a chain of matmuls in a CUDA graph) and HF transformers ``generate``;
(c) speculative decoding on that target with a test-only proposer that knows the greedy output
    and is right with probability alpha: speedup over speculation off by alpha, k and batch, and
    the measured cost ratio c of a small random draft model.

``--small`` runs tiny shapes (on CPU under TRITON_INTERPRET=1 it checks that the script works).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

LINES: list[str] = []
TESTS_TIMEOUT_S = 240  # the whole check must fit in 6 minutes of device time


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def timeit(fn: Any, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def model_shape(small: bool) -> dict[str, Any]:
    if small:
        return {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 512,
            "max_position_embeddings": 2048,
        }
    return {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


def write_random_model(
    directory: Path, shape: dict[str, Any], dtype: torch.dtype, seed: int
) -> None:
    """A HF directory with random weights (and a tiny tokenizer: prompts are token ids)."""
    from safetensors.torch import save_file

    from specbatch.distill.student import hf_config_dict
    from specbatch.kernels.attention.dense_causal import DenseCausalBackend
    from specbatch.models.config import ModelConfig
    from specbatch.models.llama import LlamaForCausalLM
    from tests.helpers import write_tiny_tokenizer

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }
    config = ModelConfig.from_hf_dict(raw)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config, DenseCausalBackend(1, 1, 2, 1.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1.0 + 0.02 * torch.randn_like(param)
                if "norm" in name
                else 0.02 * torch.randn_like(param)
            )
    directory.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(config)
    for key in ("specbatch_token_map", "specbatch_target_vocab_size"):
        cfg.pop(key)
    cfg["rope_scaling"] = raw.get("rope_scaling")
    (directory / "config.json").write_text(json.dumps(cfg))
    state = {k: v.to(dtype).contiguous() for k, v in model.hf_state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    write_tiny_tokenizer(directory)


def section_attention(device: torch.device, small: bool) -> dict[str, Any]:
    """(a) kernel error and speed; decode bandwidth."""
    import torch.nn.functional as F

    from specbatch.kernels.attention import AttentionInputs
    from specbatch.kernels.attention.triton_backend import TritonAttentionBackend

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim, block = (32, 8, 128, 16) if not small else (4, 2, 64, 16)
    batch, length = (4, 2048) if not small else (2, 64)
    blocks_per_seq = length // block
    num_blocks = batch * blocks_per_seq
    rng = np.random.default_rng(0)
    table = rng.permutation(num_blocks).reshape(batch, blocks_per_seq)
    positions = np.tile(np.arange(length), batch)
    slots = (
        table[np.repeat(np.arange(batch), length), positions // block] * block + positions % block
    )
    inputs = AttentionInputs(np.full(batch, length), np.full(batch, length), table, slots, block)
    q = torch.randn(batch * length, heads, dim, device=device, dtype=dtype)
    k = torch.randn(batch * length, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    cache = (
        torch.zeros(num_blocks, block, kv_heads, dim, device=device, dtype=dtype),
        torch.zeros(num_blocks, block, kv_heads, dim, device=device, dtype=dtype),
    )
    backend = TritonAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    metadata = backend.build_metadata(inputs, device)
    out = backend.forward(q, k, v, cache, metadata)
    q4 = q.view(batch, length, heads, dim).transpose(1, 2)
    k4 = (
        k.view(batch, length, kv_heads, dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    )
    v4 = (
        v.view(batch, length, kv_heads, dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    )
    reference = F.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), is_causal=True)
    error = float(
        (out.float().view(batch, length, heads, dim).transpose(1, 2) - reference).abs().max()
    )
    ours = timeit(lambda: backend.forward(q, k, v, cache, metadata), device)
    flash_fn = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)  # noqa: E731
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = timeit(flash_fn, device)
    else:
        flash = timeit(flash_fn, device)
    result = {
        "prefill_shape": f"{batch}x{length}, {heads}/{kv_heads} heads, d={dim}",
        "max_abs_error": error,
        "triton_ms": 1000 * ours,
        "torch_flash_ms": 1000 * flash,
        "ratio_vs_flash": flash / ours,
    }
    result["prefill_tiles"] = sweep_tiles(
        backend, "prefill", inputs, device, lambda m: backend.forward(q, k, v, cache, m)
    )
    result.update(decode_bandwidth(device, small, dtype))
    return result


def sweep_tiles(
    backend: Any, kind: str, inputs: Any, device: torch.device, run: Any
) -> list[dict[str, Any]]:
    """Time ``run(metadata)`` with every candidate tile shape of ``kind`` (first: the default)."""
    from specbatch.kernels.attention.triton_backend import TILE_CANDIDATES

    rows: list[dict[str, Any]] = []
    attribute = f"{kind}_tiles"
    default = getattr(backend, attribute)
    for tiles in TILE_CANDIDATES[kind]:
        setattr(backend, attribute, tiles)
        metadata = backend.build_metadata(inputs, device)
        try:
            seconds = timeit(lambda metadata=metadata: run(metadata), device)
        except Exception as error:  # a candidate that fails is reported, not fatal
            rows.append({"tiles": str(tiles), "error": repr(error)[:300]})
            continue
        rows.append({"tiles": str(tiles), "ms": 1000 * seconds})
    setattr(backend, attribute, default)
    return rows


def decode_bandwidth(device: torch.device, small: bool, dtype: torch.dtype) -> dict[str, Any]:
    from specbatch.kernels.attention import AttentionInputs
    from specbatch.kernels.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, dim, block = (32, 8, 128, 16) if not small else (4, 2, 64, 16)
    batch, context = (64, 4096) if not small else (4, 128)
    per_seq = context // block
    num_blocks = batch * per_seq
    table = np.random.default_rng(1).permutation(num_blocks).reshape(batch, per_seq)
    slots = table[:, -1] * block + (context - 1) % block
    inputs = AttentionInputs(
        np.ones(batch, dtype=np.int64), np.full(batch, context), table, slots, block
    )
    cache = (
        torch.randn(num_blocks, block, kv_heads, dim, device=device, dtype=dtype),
        torch.randn(num_blocks, block, kv_heads, dim, device=device, dtype=dtype),
    )
    q = torch.randn(batch, heads, dim, device=device, dtype=dtype)
    backend = TritonAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    metadata = backend.build_metadata(inputs, device)
    out = torch.empty_like(q)
    seconds = timeit(lambda: backend.attend(q, cache[0], cache[1], out, metadata), device)
    kv_bytes = 2 * batch * context * kv_heads * dim * cache[0].element_size()
    tiles = sweep_tiles(
        backend, "decode", inputs, device, lambda m: backend.attend(q, cache[0], cache[1], out, m)
    )
    for row in tiles:
        if "ms" in row:
            row["tb_s"] = kv_bytes / (row["ms"] / 1000) / 1e12
    return {
        "decode_shape": f"batch {batch} x context {context}",
        "decode_ms": 1000 * seconds,
        "decode_tb_s": kv_bytes / seconds / 1e12,
        "decode_splits": metadata.num_splits,
        "decode_tiles": tiles,
    }


def section_engine(
    device: torch.device, small: bool, work: Path, results: dict[str, Any], checkpoint: Any
) -> dict[str, Any]:
    """(b) decode steps vs the linear floor and HF generate; (c) speculation by alpha, k, batch.

    Fills ``results`` part by part and calls ``checkpoint()`` after each (partial saves)."""
    from specbatch import LLMEngine, SamplingParams
    from specbatch.config import EngineConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = model_shape(small)
    target = work / "target"
    write_random_model(target, shape, dtype, seed=0)
    batches = [1, 16, 64] if not small else [1, 4]
    context, new_tokens = (512, 64) if not small else (32, 8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, shape["vocab_size"], context).tolist() for _ in range(max(batches))]
    common = {
        "model": str(target),
        "device": str(device),
        "dtype": str(dtype).split(".")[1],
        "max_model_len": context + new_tokens + 32,
        "max_num_seqs": max(batches),
        "max_num_batched_tokens": 8192,
        "enable_prefix_caching": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results["decode"] = []

    off = LLMEngine(EngineConfig(**common, speculative_config={"method": "off"}))
    truth: dict[str, list[int]] = {}
    for b in batches:
        run = decode_run(off, prompts[:b], params, tag=str(b))
        truth.update(run["outputs"])
        floor = linear_floor(off.model, b, device)
        results["decode"].append(
            {
                "batch": b,
                "ms_per_step": 1000 * run["step_s"],
                "tok_s": run["tok_s"],
                "linear_floor_ms": 1000 * floor,
                "vs_floor": run["step_s"] / floor,
                "replayed_steps": f"{run['graph_replays']}/{run['steps']}",
            }
        )
    checkpoint()
    guarded("hf", results, lambda: hf_generate(target, prompts, batches, new_tokens, device, dtype))
    del off
    checkpoint()
    guarded("spec", results, lambda: oracle_speculation(common, truth, results, shape, prompts))
    checkpoint()
    guarded("draft_c", results, lambda: draft_cost(target, work, shape, device, dtype, small))
    guarded("sampled_draft", results, lambda: sampled_draft(common, work, prompts, batches))
    checkpoint()
    guarded("long_context", results, lambda: long_context(common, small))
    return results


def long_context(common: dict[str, Any], small: bool) -> dict[str, Any]:
    """Batch 1 at a long context: the split-KV graph must replay and equal eager decoding."""
    from specbatch import LLMEngine, SamplingParams
    from specbatch.config import EngineConfig

    context = 2100 if not small else 64
    config = dict(common, max_model_len=context + 64, max_num_seqs=1)
    prompt = np.random.default_rng(2).integers(3, 500, context).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        engine = LLMEngine(
            EngineConfig(**config, enforce_eager=eager, speculative_config={"method": "off"})
        )
        if small and engine.runner.graphs is not None:  # CPU check of the script: tiny context
            engine.runner.graphs.backend.long_context = 32
        run = decode_run(engine, [prompt], params, tag="long")
        graphs = engine.runner.graphs
        runs[eager] = {
            "tokens": next(iter(run["outputs"].values())),
            "ms_per_step": 1000 * run["step_s"],
            "split_replays": graphs.split_replays if graphs is not None else 0,
            "long_splits": str(graphs.long_splits) if graphs is not None else "",
        }
        del engine
    return {
        "context": context,
        "graph_ms_per_step": runs[False]["ms_per_step"],
        "eager_ms_per_step": runs[True]["ms_per_step"],
        "split_replays": runs[False]["split_replays"],
        "long_splits": runs[False]["long_splits"],
        "equal_to_eager": runs[False]["tokens"] == runs[True]["tokens"],
    }


def oracle_speculation(
    common: dict[str, Any],
    truth: dict[str, list[int]],
    results: dict[str, Any],
    shape: dict[str, Any],
    prompts: list[list[int]],
) -> list[dict[str, Any]]:
    """(c) speedup over off with drafts right with probability alpha, by alpha, k and batch."""
    from specbatch import LLMEngine, SamplingParams
    from specbatch.config import EngineConfig
    from tests.helpers import OracleProposer

    new_tokens = len(next(iter(truth.values())))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rows = []
    for k in (2, 4):
        proposer = OracleProposer(truth, 1.0, shape["vocab_size"], seed=1)
        spec = {"method": "external", "num_speculative_tokens": k}
        engine = LLMEngine(EngineConfig(**common, speculative_config=spec), proposer=proposer)
        for alpha in (0.5, 0.8, 0.95):
            proposer.acceptance = alpha
            for base in results["decode"]:
                b = base["batch"]
                run = decode_run(engine, prompts[:b], params, tag=str(b))
                rows.append(
                    {
                        "k": k,
                        "alpha": alpha,
                        "batch": b,
                        "ms_per_step": 1000 * run["step_s"],
                        "tokens_per_step": run["tokens_per_step"],
                        "speedup": run["tok_s"] / base["tok_s"],
                        "measured_alpha": run["acceptance"],
                        "replayed_steps": f"{run['graph_replays']}/{run['steps']}",
                    }
                )
        del engine
    return rows


def sampled_draft(
    common: dict[str, Any], work: Path, prompts: list[list[int]], batches: list[int]
) -> list[dict[str, Any]]:
    """A real draft model (the random one of draft_cost) with sampled requests (T = 0.8):
    exercises the draft's q rows and the rejection sampler on the GPU."""
    from specbatch import LLMEngine, SamplingParams
    from specbatch.config import EngineConfig

    spec = {"method": "draft_model", "model": str(work / "draft"), "num_speculative_tokens": 3}
    engine = LLMEngine(EngineConfig(**common, speculative_config=spec))
    rows = []
    for b in batches[:2]:
        params = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True)
        run = decode_run(engine, prompts[:b], params, tag=f"sampled-{b}")
        rows.append(
            {
                "batch": b,
                "tok_s": run["tok_s"],
                "ms_per_step": 1000 * run["step_s"],
                "acceptance": run["acceptance"],
                "replayed_steps": f"{run['graph_replays']}/{run['steps']}",
            }
        )
    return rows


def decode_run(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> dict[str, Any]:
    """Decode-phase speed once every sequence is decoding (the prefill step is excluded)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    decoding: set[str] = set()
    outputs: dict[str, list[int]] = {}
    while len(decoding) < len(prompts):  # prefills (chunked at large batches) are not timed
        for out in engine.step():
            decoding.add(out.request_id)
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    generated = engine.stats.num_generation_tokens
    drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
    graphs = engine.runner.graphs
    replays = graphs.replays if graphs is not None else 0
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = engine.stats.num_generation_tokens - generated
    drafted = engine.stats.num_draft_tokens - drafted
    return {
        "outputs": outputs,
        "step_s": elapsed / max(steps, 1),
        "tok_s": tokens / elapsed,
        "tokens_per_step": tokens / max(steps, 1),
        "acceptance": (engine.stats.num_accepted_tokens - accepted) / drafted if drafted else None,
        "graph_replays": (graphs.replays - replays if graphs is not None else 0),
        "steps": steps,
    }


def linear_floor(model: Any, batch: int, device: torch.device) -> float:
    """One step's linear layers as a plain chain of matmuls (CUDA graph on the GPU)."""
    weights = [
        m.weight
        for m in model.modules()
        if hasattr(m, "weight")
        and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2
        and m is not model.model.embed_tokens
    ]
    x = torch.randn(batch, model.config.hidden_size, device=device, dtype=model.dtype)

    def chain() -> None:
        for w in weights:
            if w.shape[1] == x.shape[1]:
                torch.matmul(x, w.t())
            else:
                torch.matmul(torch.zeros(batch, w.shape[1], device=device, dtype=x.dtype), w.t())

    if device.type != "cuda":
        return timeit(chain, device, repeats=5)
    graph = torch.cuda.CUDAGraph()
    chain()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        chain()
    return timeit(graph.replay, device)


def hf_generate(
    target: Path,
    prompts: list[list[int]],
    batches: list[int],
    new_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
) -> list[dict[str, float]]:
    try:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=dtype)
    except Exception:
        say(f"HF transformers baseline unavailable:\n{traceback.format_exc()[-1500:]}")
        return []
    model = model.to(device).eval()
    rows = []
    for b in batches:
        ids = torch.tensor(prompts[:b], device=device)

        def run(ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )

        seconds = timeit(run, device, repeats=2, warmup=1)
        rows.append({"batch": b, "tok_s": b * new_tokens / seconds})
    return rows


def draft_cost(
    target: Path,
    work: Path,
    shape: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    small: bool,
) -> dict[str, float]:
    """c: one decode step of a small random draft over one of the target (batch 1)."""
    from specbatch.distill.pipeline import decode_ms
    from specbatch.models import load_model

    draft_shape = dict(
        shape,
        hidden_size=512 if not small else 64,
        num_hidden_layers=2,
        intermediate_size=1536 if not small else 128,
        num_attention_heads=8 if not small else 2,
        num_key_value_heads=4 if not small else 1,
    )
    draft = work / "draft"
    write_random_model(draft, draft_shape, dtype, seed=1)
    target_ms = decode_ms(load_model(target, dtype, device))
    draft_ms = decode_ms(load_model(draft, dtype, device))
    return {"target_ms": target_ms, "draft_ms": draft_ms, "c": draft_ms / target_ms}


def guarded(name: str, results: dict[str, Any], fn: Any) -> None:
    """Run one section; a failure is printed with its traceback and the others still run."""
    started = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:
        say(f"{name}: FAILED\n{traceback.format_exc()}")
    say(f"[{name}: {time.perf_counter() - started:.0f} s]")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    import triton

    say(
        f"versions: python {platform.python_version()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, cuda {torch.version.cuda}, device "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    )
    results: dict[str, Any] = {}
    if not args.skip_tests:
        guarded("tests", results, run_tests)
    guarded("attention", results, lambda: section_attention(device, args.small))
    if out_dir is not None:  # what is done so far comes back even if a later part hangs
        save(out_dir, results)
    with tempfile.TemporaryDirectory() as tmp:
        results["engine"] = {}

        def checkpoint() -> None:
            if out_dir is not None:
                save(out_dir, results)

        section_engine(device, args.small, Path(tmp), results["engine"], checkpoint)
    try:
        report(results)
    finally:
        if out_dir is not None:
            save(out_dir, results)


def run_tests() -> str:
    """The CUDA-marked and kernel tests (the ahead-of-time compile checks are the CPU's job)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda or not slow",
        "tests/kernels",
        "tests/engine/test_cuda_engine.py",
        "--ignore=tests/kernels/test_triton_compile.py",
        "-p",
        "no:cacheprovider",
    ]
    try:
        tests = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else ""
        say(f"tests: stopped after {TESTS_TIMEOUT_S} s\n{output[-3000:]}")
        return "timeout"
    lines = tests.stdout.strip().splitlines()
    summary = lines[-1] if lines else tests.stderr[-2000:]
    say(f"tests: {summary}")
    for line in [line for line in lines if line.startswith(("FAILED", "ERROR"))][:30]:
        say(f"  {line}")
    if tests.returncode not in (0, 5):
        say(tests.stdout[-6000:])
    return summary


def save(out_dir: Path, results: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.txt").write_text("\n".join(LINES) + "\n")
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))


def report(results: dict[str, Any]) -> None:
    say()
    attention = results.get("attention")
    if attention is not None:
        say("(a) attention")
        say(
            f"  prefill {attention['prefill_shape']}: max |err| "
            f"{attention['max_abs_error']:.2e}, triton {attention['triton_ms']:.3f} ms, torch "
            f"flash {attention['torch_flash_ms']:.3f} ms, ratio "
            f"{attention['ratio_vs_flash']:.2f}x (>= 0.8 wanted)"
        )
        for row in attention["prefill_tiles"]:
            say(f"    prefill tiles {row['tiles']}: {row.get('ms', row.get('error'))}")
        say(
            f"  decode {attention['decode_shape']}: {attention['decode_ms']:.3f} ms, "
            f"{attention['decode_tb_s']:.2f} TB/s of KV (splits {attention['decode_splits']}; "
            "copy ceiling 4.18 TB/s, >= 70% wanted)"
        )
        for row in attention["decode_tiles"]:
            shown = f"{row['tb_s']:.2f} TB/s" if "tb_s" in row else row.get("error")
            say(f"    decode tiles {row['tiles']}: {shown}")
    engine = results.get("engine")
    if engine is None:
        return
    say("(b) engine decode step (CUDA graphs; replayed steps / timed steps)")
    hf = {row["batch"]: row["tok_s"] for row in engine.get("hf", [])}
    for row in engine["decode"]:
        b = row["batch"]
        say(
            f"  batch {b:>3}: {row['ms_per_step']:.3f} ms/step, {row['tok_s']:.0f} tok/s "
            f"(replayed {row['replayed_steps']}); linear floor {row['linear_floor_ms']:.3f} ms "
            f"-> {row['vs_floor']:.2f}x floor (<= 1.25 wanted at batch 1); HF generate "
            f"{hf.get(b, float('nan')):.1f} tok/s -> {row['tok_s'] / hf.get(b, float('nan')):.1f}x"
        )
    say("(c) speculative decoding (oracle proposer) speedup over off")
    for row in engine.get("spec", []):
        measured = row["measured_alpha"]
        say(
            f"  k={row['k']} alpha={row['alpha']:.2f} (measured "
            f"{measured if measured is None else round(measured, 3)}) batch {row['batch']:>3}: "
            f"{row['speedup']:.2f}x ({row['tokens_per_step']:.2f} tokens/step, "
            f"{row['ms_per_step']:.3f} ms/step, replayed {row['replayed_steps']})"
        )
    if "draft_c" in engine:
        c = engine["draft_c"]
        say(
            f"  small random draft (eager forwards, batch 1): {c['draft_ms']:.3f} ms vs target "
            f"{c['target_ms']:.3f} ms, c = {c['c']:.3f}"
        )
    if "long_context" in engine:
        row = engine["long_context"]
        say(
            f"  batch 1 at {row['context']} tokens: graph {row['graph_ms_per_step']:.3f} ms/step "
            f"(split-KV replays {row['split_replays']}, graphs {row['long_splits']}) vs eager "
            f"{row['eager_ms_per_step']:.3f} ms/step; same tokens: {row['equal_to_eager']}"
        )
    for row in engine.get("sampled_draft", []):
        say(
            f"  draft_model k=3, T=0.8, batch {row['batch']}: {row['tok_s']:.0f} tok/s, "
            f"{row['ms_per_step']:.3f} ms/step, acceptance {row['acceptance']}, replayed "
            f"{row['replayed_steps']}"
        )


if __name__ == "__main__":
    main()
