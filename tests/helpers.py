"""Test utilities: tiny random checkpoints, a harness running a model on a paged cache, and
the engine runs, prompts and proposers that tests of speculation share."""

from __future__ import annotations

import contextlib
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.cache.kv_tensors import allocate_kv_caches
from specbatch.kernels.attention import AttentionInputs
from specbatch.kernels.fused_layers import FusedLayers
from specbatch.models.llama import LlamaForCausalLM
from specbatch.spec_decode.control.choices import (
    DRAFT,
    Candidate,
    Choice,
    ControllerPlan,
    PlanReport,
    Prices,
)
from specbatch.spec_decode.proposers.base import DraftRequest, Proposal, Proposer
from specbatch.spec_decode.proposers.drafting import NetworkProposer


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A HF ``config.json`` of a tiny Llama (2 layers, GQA 4:2, head_dim 16, vocab 96)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def hf_model_from_config(config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """A transformers model with random weights (std 0.1 so logits are not all tiny)."""
    import transformers

    cls = getattr(transformers, config["architectures"][0])
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = cls(hf_config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model


def write_hf_checkpoint(directory: Path, config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """Save a random tiny model as a HF directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    model = hf_model_from_config(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"))
    return model


class PagedHarness:
    """Runs a model over a paged cache with a shuffled, non-contiguous block table per sequence."""

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 16, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        caches = allocate_kv_caches(model.config, num_blocks, block_size, model.dtype, model.device)
        model.bind_kv_caches(caches)
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def forward(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed each ``(seq, new_token_ids)`` chunk in one ragged forward; logits per chunk."""
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lengths.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(int(self.free.pop()))
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += tokens
            positions += list(range(start, end))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.lengths[seq] = end
        width = max(len(t) for t in tables)
        block_tables = np.array([t + [0] * (width - len(t)) for t in tables])
        inputs = AttentionInputs(
            np.array(query_lens), np.array(seq_lens), block_tables, np.array(slots), self.block_size
        )
        metadata = self.model.backend.build_metadata(inputs, self.model.device)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), metadata)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the "
    "target verifies them in one pass. def add(a, b):\n    return a + b\n"
    "Paged attention reads keys and values through a block table. 0123456789 "
    "Continuous batching keeps every sequence busy; prefix caching shares full blocks. "
)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tiny_tokenizer(directory: Path, vocab_size: int = 300) -> int:
    """Train a small byte-level BPE (ids 0-2: <unk>, <s>, </s>) into ``directory``; returns its
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TINY_CORPUS] * 4, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "chat_template": TINY_CHAT_TEMPLATE,
            }
        )
    )
    return tokenizer.get_vocab_size()


def write_tiny_model(
    directory: Path, seed: int = 0, vocab_size: int | None = None, **overrides: Any
) -> Path:
    """A tiny random Llama with a real (small) tokenizer: an engine-ready model directory.

    ``vocab_size`` below the tokenizer's makes the model emit only the first ids (for tests
    that need exact distributions over a small vocabulary)."""
    vocab = write_tiny_tokenizer(directory)
    overrides = {"max_position_embeddings": 512, **overrides}
    config = tiny_config(vocab_size=vocab_size or max(vocab, 96), **overrides)
    write_hf_checkpoint(directory, config, seed=seed)
    return directory


# ------------------------------------------------------------------ engines and proposers


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
OFF = {"method": "off"}  # speculation off, named: the default speculates


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"num_kv_blocks": 200, "max_model_len": 256, "block_size": 8}
    kwargs.update(overrides)
    return kwargs


def prompts_with_repeats(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of which some repeat a phrase (n-gram matches) and some are random."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        phrase = rng.integers(3, 300, int(rng.integers(3, 8))).tolist()
        if i % 3 == 0:
            out.append(rng.integers(3, 300, int(rng.integers(5, 30))).tolist())
        else:
            out.append(phrase * int(rng.integers(2, 5)))
    return out


def greedy_tokens(
    llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY, batch: int = 16
) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        out += [
            o.outputs[0].token_ids
            for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        ]
    return out


VOCAB = 300  # the tiny model's


def prompts_with_variants(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase with a different token after each repeat (prompt lookup
    finds several continuations that disagree), then the phrase-repeating and random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        phrase = rng.integers(3, 300, int(rng.integers(2, 4))).tolist()
        variants = rng.integers(3, 300, int(rng.integers(2, 6))).tolist()
        out.append([t for v in variants for t in [*phrase, v]] + phrase)
    return out + prompts_with_repeats(count, seed)


class SiblingOracle(Proposer):
    """A tree around the known greedy continuation: at each depth a wrong sibling and the
    right token in random order, the path continuing under the right one, so that accepted
    nodes mostly sit at indices other than their depth (their K/V must move)."""

    def __init__(self, continuations: Mapping[str, Sequence[int]], vocab: int, seed: int = 0):
        self.continuations = continuations
        self.vocab = vocab
        self.random = random.Random(seed)
        self.moved_trees = 0

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens, parents = [], []
        for r in requests:
            truth = self.continuations[r.seq.request_id][r.seq.num_output_tokens :]
            nodes: list[int] = []
            links: list[int] = []
            parent = -1
            for right in truth:
                wrong = (right + 1 + self.random.randrange(self.vocab - 1)) % self.vocab
                pair = [wrong, right] if self.random.random() < 0.7 else [right, wrong]
                for token in pair:
                    if len(nodes) < r.max_drafts:
                        nodes.append(token)
                        links.append(parent)
                if len(nodes) >= r.max_drafts:
                    break
                parent = len(nodes) - 2 + pair.index(right)
                if self.random.random() < 0.15:  # sometimes the path is wrong from here
                    break
            self.moved_trees += any(link != i - 1 for i, link in enumerate(links))
            tokens.append(nodes)
            parents.append(links)
        return Proposal(tokens, parents=parents)


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, batch: int
) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    pending = list(range(len(prompts)))[::-1]
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_unfinished_requests() < batch:
            i = pending.pop()
            engine.add_request(str(i), prompt_token_ids=prompts[i], params=params)
        for o in engine.step():
            assert o.error is None
            if o.finished:
                out[int(o.request_id)] = o.outputs[0].token_ids
    return [out[i] for i in range(len(prompts))]


def network_proposer(engine: LLMEngine) -> NetworkProposer:
    """The engine's drafting network proposer (alone, or the hybrid's part)."""
    assert engine.proposer is not None
    network = engine.proposer.network
    assert isinstance(network, NetworkProposer)
    return network


def force_draft_chains(engine: LLMEngine, depth: int, row_seconds: float = 1e-4) -> None:
    """The controller's plan replaced: every sequence gets a draft-model chain of ``depth``
    and a verify row costs ``row_seconds`` x 100 tokens (0.01 by default: the draft's likelier
    siblings are added), whatever
    the measured times say (this draft is as large as the target: it rarely pays)."""
    controller = engine.speculator.controller
    assert controller is not None

    def plan(candidates: list[Candidate], *_: Any) -> ControllerPlan:
        choices = [Choice(DRAFT, min(depth, c.slots), (0.5, 0.8, 1.0)[:depth]) for c in candidates]
        prices = Prices(step=row_seconds, tokens_per_second=100.0)
        return ControllerPlan(choices, prices, PlanReport(len(candidates)))

    controller.plan = plan  # type: ignore[method-assign]


# 24 prompts of 9-35 tokens, 20 new tokens each, at most 16 at once in a cache of 40 blocks
# of 8 tokens (320 slots): sequences are preempted; a budget of 24 tokens chunks prompts.
TIGHT = {
    "num_kv_blocks": 40,
    "block_size": 8,
    "max_model_len": 128,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 24,
    "enable_prefix_caching": False,
}


def tight_params(i: int, sampled: bool) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=20)
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def outputs(engine: LLMEngine, prompts: list[list[int]], sampled: bool) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, tight_params(i, sampled))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    return [done[str(i)] for i in range(len(prompts))]


def check_blocks(engine: LLMEngine) -> None:
    pool = engine.cache.pool
    pool.check_consistency()
    holders: Counter[int] = Counter()
    for seq in engine.scheduler.running + engine.scheduler.waiting:
        holders.update(seq.block_table)
    for seq in engine.scheduler.waiting:
        assert seq.block_table == []  # preempted or new: holds nothing
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == holders[block], f"block {block}"


class OracleProposer(Proposer):
    """Drafts ``continuations[request_id]`` (the greedy output) with random corruption."""

    def __init__(
        self,
        continuations: Mapping[str, Sequence[int]],
        acceptance: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        self.continuations = continuations
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.random = random.Random(seed)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        tokens = []
        for r in requests:
            truth = self.continuations.get(r.seq.request_id, ())
            start = r.seq.num_output_tokens
            drafts = list(truth[start : start + r.max_drafts])
            for j, token in enumerate(drafts):
                if self.random.random() >= self.acceptance:
                    drafts[j] = (token + 1 + self.random.randrange(self.vocab_size - 1)) % (
                        self.vocab_size
                    )
            tokens.append(drafts)
        return Proposal(tokens)


def mixed_workload_logits(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Prefills of two lengths in one step, then decodes and a 5-token verify-like step."""
    harness = PagedHarness(model, num_blocks=96, block_size=16)
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(0, 49152, (300,), generator=gen).tolist()
    second = torch.randint(0, 49152, (37,), generator=gen).tolist()
    outputs = [torch.cat(harness.forward([(0, first), (1, second)]))]
    outputs.append(torch.cat(harness.forward([(0, [11]), (1, [12, 13, 14, 15, 16])])))
    outputs.append(torch.cat(harness.forward([(1, [17])])))
    return outputs


@contextlib.contextmanager
def per_op_layers(model: LlamaForCausalLM) -> Iterator[None]:
    """The model's layers run per op (its fused layers made disabled), then fused again (made
    anew: the caches may have been bound meanwhile)."""
    model.fused = FusedLayers(model, enabled=False)
    try:
        yield
    finally:
        model.fused = FusedLayers(model)


def assert_fused_equals_per_op(
    model: LlamaForCausalLM, logits: Callable[[], list[torch.Tensor]]
) -> None:
    """``logits()`` with the model's fused layers, then with them off (restored after): every
    tensor the same bit for bit."""
    assert model.fused.applies()
    fused = logits()
    with per_op_layers(model):
        per_op = logits()
    for a, b in zip(fused, per_op, strict=True):
        assert torch.equal(a, b)
