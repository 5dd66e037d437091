"""The draft head on the target's features (tiny target, tiny trained head): training lowers
the loss, outputs equal speculation off (chains, siblings, hybrid, chunked prefill,
preemption, seeded), the head's cache and features equal a head that saw the text at once,
prefix-cache hits, and the errors a bad head or config gets."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.distill.head import (
    HeadTrainConfig,
    build_head,
    depth_agreement,
    head_loss,
    teacher_examples,
    train_head,
)
from specbatch.errors import ConfigError, ModelLoadError
from specbatch.kernels.attention.dense_causal import DenseCausalMetadata, DraftPassMetadata
from specbatch.models import load_model
from specbatch.models.rotary import apply_rotary
from specbatch.sequence import Sequence
from specbatch.spec_decode.proposers.base import DraftRequest
from specbatch.spec_decode.proposers.drafting import NetworkProposer
from specbatch.spec_decode.proposers.head import HeadNetwork, is_head_dir, load_head, save_head
from tests.helpers import (
    GREEDY,
    engine_kwargs,
    force_draft_chains,
    greedy_tokens,
    network_proposer,
    prompts_with_variants,
    run_engine,
)

OUTSIDE = 16  # the tiny target's last ids are outside the head's vocabulary


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_with_variants(8, seed=3)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    return greedy_tokens(llm, prompts)


def _corpus(tiny_model_dir: Path) -> list[list[int]]:
    """The target's greedy answers to prompts other than the tests' (what a head learns)."""
    train_prompts = prompts_with_variants(24, seed=11)
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    answers = greedy_tokens(llm, train_prompts)
    return [p + a for p, a in zip(train_prompts, answers, strict=True)]


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny head trained on the tiny target's answers: its directory and the losses."""
    target = load_model(str(tiny_model_dir), attention_backend="dense_causal")
    token_map = list(range(target.config.vocab_size - OUTSIDE))
    examples = teacher_examples(target, _corpus(tiny_model_dir), token_map, top_k=8)
    head = build_head(target, token_map, seed=0)
    directory = tmp_path_factory.mktemp("tiny-head")
    config = HeadTrainConfig(
        work=directory, out=directory, steps=80, tokens_per_batch=1024, lr=3e-3, unroll=2
    )
    with torch.no_grad():
        before = float(head_loss(head, examples[:8], 2, config.feature_weight))
    losses = train_head(head, examples, config, directory / "checkpoint")
    with torch.no_grad():
        after = float(head_loss(head, examples[:8], 2, config.feature_weight))
    agreement = depth_agreement(head, examples, [0] * len(examples), 2)
    save_head(head, directory / "head", dtype=torch.float32)
    return {
        "dir": directory / "head",
        "before": before,
        "after": after,
        "losses": losses,
        "agreement": agreement,
    }


def test_training_lowers_the_loss_and_the_head_agrees_with_the_target(
    trained: dict[str, Any],
) -> None:
    assert trained["after"] < 0.7 * trained["before"], trained
    first, second = trained["agreement"]
    assert first > 0.3, trained["agreement"]  # argmax agreement on its training text
    assert second > 0.1, trained["agreement"]


def test_training_passes_attend_as_the_engines_chained_drafts(
    tiny_model_dir: Path, trained: dict[str, Any], prompts: list[list[int]]
) -> None:
    """Pass j of training at position p is the j-th draft of a chain that starts after p - j + 1:
    a slow reference that drafts from the cache of target-featured rows one row at a time,
    each row reading the previous row's output (plain causal attention, no pass metadata)."""
    target = load_model(str(tiny_model_dir), attention_backend="dense_causal")
    head = load_head(trained["dir"], target, dtype=torch.float32)
    ids = torch.tensor(prompts[0][:21])
    n, passes = len(ids), 4
    with torch.no_grad():
        truth = target(ids, torch.arange(n), DenseCausalMetadata(1, n))
        feature = torch.cat([torch.zeros(1, truth.shape[1]), truth[:-1]])
        metadata = DraftPassMetadata(1, n)
        trained_way = []
        for _ in range(passes):
            out = head(ids, torch.arange(n), feature, metadata)
            trained_way.append(out)
            feature = torch.cat([torch.zeros(1, out.shape[1]), out[:-1]])
        for start in range(n):  # rows <= start read the target's features
            rows = torch.cat([torch.zeros(1, truth.shape[1]), truth[:start]])
            for _ in range(1, min(passes, n - start)):
                m = len(rows)
                chain = head(ids[:m], torch.arange(m), rows, DenseCausalMetadata(1, m))
                rows = torch.cat([rows, chain[-1:]])  # the next row reads this draft's output
            m = len(rows)
            chain = head(ids[:m], torch.arange(m), rows, DenseCausalMetadata(1, m))
            for depth in range(min(passes, n - start)):
                torch.testing.assert_close(
                    trained_way[depth][start + depth], chain[start + depth], atol=1e-5, rtol=1e-5
                )


def eagle_engine(model: Path, head: Path, **spec: Any) -> LLMEngine:
    config = {"method": "eagle", "model": str(head), **spec}
    return LLMEngine(EngineConfig(model=str(model), speculative_config=config, **engine_kwargs()))


@pytest.mark.parametrize("batch", [1, 16])
def test_fixed_k_chains_give_the_output_of_speculation_off(
    tiny_model_dir: Path,
    trained: dict[str, Any],
    prompts: list[list[int]],
    reference: list[list[int]],
    batch: int,
) -> None:
    engine = eagle_engine(
        tiny_model_dir,
        trained["dir"],
        adaptive_k=False,
        num_speculative_tokens=4,
        draft_confidence_threshold=0.0,
    )
    assert run_engine(engine, prompts, GREEDY, batch) == reference
    stats = engine.stats
    # the head's first drafts are accepted, and deeper ones too (read from its own features)
    assert stats.num_accepted_tokens_per_pos[0] > 0.1 * stats.num_drafts, stats
    assert stats.num_accepted_tokens_per_pos[1] > 0, stats
    # per depth: every verify had a first draft, acceptance counted where it happened
    assert stats.num_drafts_per_pos[0] == stats.num_drafts
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert len(stats.num_drafts_per_pos) == 4
    for counts in (stats.num_drafts_per_pos, stats.num_accepted_tokens_per_pos):
        assert all(a >= b for a, b in itertools.pairwise(counts))
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize(("batch", "kind"), [(1, None), (8, None), (8, "siblings")])
def test_head_trees_give_the_output_of_speculation_off(
    tiny_model_dir: Path,
    trained: dict[str, Any],
    prompts: list[list[int]],
    reference: list[list[int]],
    batch: int,
    kind: str | None,
) -> None:
    """The head's dynamic trees (its default kind), or siblings of its chain."""
    engine = eagle_engine(
        tiny_model_dir,
        trained["dir"],
        draft_tree=True,
        draft_confidence_threshold=0.0,
        draft_tree_kind=kind,
    )
    assert network_proposer(engine).dynamic_trees == (kind is None)
    force_draft_chains(engine, 3)
    assert run_engine(engine, prompts, GREEDY, batch) == reference
    assert engine.stats.num_tree_drafts > 0, engine.stats


@pytest.mark.parametrize("method", ["eagle", "hybrid"])
def test_fixed_trees_give_the_output_of_speculation_off(
    tiny_model_dir: Path,
    trained: dict[str, Any],
    prompts: list[list[int]],
    reference: list[list[int]],
    method: str,
) -> None:
    """A fixed budget without the controller: 6 nodes per sequence, at most 3 deep."""
    spec = {
        "method": method,
        "model": str(trained["dir"]),
        "num_speculative_tokens": 6,
        "adaptive_k": False,
        "draft_tree": True,
        "draft_tree_depth": 3,
        "draft_confidence_threshold": 0.0,
    }
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), speculative_config=spec, **engine_kwargs())
    )
    assert not engine.speculator.adaptive  # every slot (the hybrid's controller picks the way)
    assert run_engine(engine, prompts, GREEDY, 4) == reference
    stats = engine.stats
    assert stats.num_tree_drafts > 0, stats
    assert stats.num_tree_moves > 0, stats  # siblings taken
    assert len(stats.num_drafts_per_pos) == 3  # never deeper than the budget's depth
    assert stats.num_draft_tokens > stats.num_drafts_per_pos[0] * 3  # more nodes than a chain's
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_the_hybrid_with_a_head_gives_the_output_of_speculation_off(
    tiny_model_dir: Path,
    trained: dict[str, Any],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    spec = {"method": "hybrid", "model": str(trained["dir"]), "adaptive_k": False}
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **engine_kwargs())
    assert greedy_tokens(llm, prompts, batch=4) == reference
    assert isinstance(network_proposer(llm.llm_engine).net, HeadNetwork)


def test_chunked_prefill_and_preemption(
    tiny_model_dir: Path,
    trained: dict[str, Any],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    spec = {"method": "eagle", "model": str(trained["dir"]), "adaptive_k": False}
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            num_kv_blocks=30,
            block_size=4,
            max_model_len=80,
            max_num_batched_tokens=24,
            max_num_seqs=8,
            speculative_config={**spec, "num_speculative_tokens": 5},
        )
    )
    assert run_engine(engine, prompts, GREEDY, 16) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.num_accepted_tokens > 0
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_seeded_sampling_equals_speculation_off(
    tiny_model_dir: Path, trained: dict[str, Any], prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=32, seed=5, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    plain = greedy_tokens(llm, prompts, params)
    del llm
    engine = eagle_engine(tiny_model_dir, trained["dir"], draft_tree=True)
    force_draft_chains(engine, 3)
    assert run_engine(engine, prompts, params, 8) == plain
    assert engine.stats.num_accepted_tokens > 0


def test_the_heads_cache_and_features_equal_a_head_that_saw_the_text_at_once(
    tiny_model_dir: Path, trained: dict[str, Any], prompts: list[list[int]]
) -> None:
    """After speculative steps (siblings taken, drafts rejected): the features the head holds
    are a plain prefill's of the text, and at every position the head claims its K/V are what
    its layer computes from the text and those features (a slow, obvious recompute)."""
    engine = eagle_engine(
        tiny_model_dir, trained["dir"], draft_tree=True, draft_confidence_threshold=0.0
    )
    force_draft_chains(engine, 3)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), prompt_token_ids=prompts[i], params=params)
    for _ in range(10):
        engine.step()
    drafter = network_proposer(engine)
    network = drafter.net
    assert isinstance(network, HeadNetwork)
    assert engine.stats.num_accepted_tokens > 0
    assert engine.stats.num_tree_moves > 0  # a sibling's features moved with its K/V
    dense = load_model(str(tiny_model_dir), attention_backend="dense_causal")
    head = network.head
    key_cache, value_cache = head.kv_caches()[0]
    attn = head.layer.self_attn
    q_size, kv_size = attn.q_size, attn.kv_size
    checked = 0
    for seq in engine.scheduler.running:
        text = seq.token_ids[: seq.num_computed_tokens]
        n = len(text)
        with torch.no_grad():
            truth = dense(torch.tensor(text), torch.arange(n), DenseCausalMetadata(1, n))
        features = network.features_at(seq, 0, n)
        torch.testing.assert_close(features, truth, atol=1e-4, rtol=1e-4)
        held = drafter._computed[seq.seq_id]
        assert len(seq.prompt_token_ids) < held <= n
        with torch.no_grad():
            ids = torch.tensor(text[:held])
            shifted = torch.cat([torch.zeros(1, truth.shape[1]), truth[: held - 1]])
            x = head.fc(
                torch.cat([head.embed_norm(head.embed(ids)), head.feature_norm(shifted)], -1)
            )
            qkv = attn.qkv_proj(head.layer.input_layernorm(x))
            cos, sin = head.rotary.cos_sin(torch.arange(held), x.dtype)
            k = apply_rotary(
                qkv[:, q_size : q_size + kv_size].reshape(held, -1, attn.head_dim), cos, sin
            )
            v = qkv[:, q_size + kv_size :].reshape(held, -1, attn.head_dim)
        slots = [(seq.block_table[p // 8], p % 8) for p in range(held)]
        cached_k = torch.stack([key_cache[b, o] for b, o in slots])
        cached_v = torch.stack([value_cache[b, o] for b, o in slots])
        torch.testing.assert_close(cached_k, k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cached_v, v, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked == 4


def test_a_prefix_cache_hit_reads_the_cached_positions_features(
    tiny_model_dir: Path, trained: dict[str, Any], prompts: list[list[int]]
) -> None:
    """A second request sharing a cached prompt: the target skips the cached positions, the
    head catches up on them from the features kept at their slots, drafts, and the output is
    the plain one."""
    spec = {
        "method": "eagle",
        "model": str(trained["dir"]),
        "adaptive_k": False,
        "draft_confidence_threshold": 0.0,
    }
    kwargs = engine_kwargs(enable_prefix_caching=True)
    llm = LLM(str(tiny_model_dir), speculative_config=spec, **kwargs)
    off = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **kwargs)
    prompt = prompts[1] * 3
    assert greedy_tokens(llm, [prompt]) == greedy_tokens(off, [prompt])
    stats = llm.llm_engine.stats
    before = stats.num_accepted_tokens
    second = llm.generate([{"prompt_token_ids": prompt + [5]}], GREEDY, use_tqdm=False)[0]
    assert second.metrics.num_cached_tokens >= 8  # whole blocks of the prompt came from the cache
    assert second.outputs[0].token_ids == greedy_tokens(off, [prompt + [5]])[0]
    engine = llm.llm_engine
    assert stats.num_accepted_tokens > before  # the head drafted well for the second request
    assert engine.cache.num_free_blocks == engine.num_kv_blocks


def test_a_draft_dtype_for_a_head_is_refused(tiny_model_dir: Path, trained: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="draft_dtype is for draft models"):
        eagle_engine(tiny_model_dir, trained["dir"], draft_dtype="bfloat16")


def test_head_directory_round_trip_and_errors(
    tiny_model_dir: Path, tiny_draft_dir: Path, trained: dict[str, Any], tmp_path: Path
) -> None:
    target = load_model(str(tiny_model_dir))
    head = load_head(trained["dir"], target)
    assert is_head_dir(trained["dir"])
    assert not is_head_dir(tiny_draft_dir)
    assert head.config.token_map == tuple(range(target.config.vocab_size - OUTSIDE))
    # a head's probability of a token outside its vocabulary is 0 (logits -inf)
    logits = head.logits_in_output_vocab(torch.zeros(2, len(head.config.token_map)))
    assert torch.isinf(logits[:, -OUTSIDE:]).all()
    assert torch.isfinite(logits[:, :-OUTSIDE]).all()
    # a head made for another shape
    other = tmp_path / "other"
    other.mkdir()
    raw = json.loads((trained["dir"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "hidden_size": 32}))
    (other / "model.safetensors").write_bytes((trained["dir"] / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="another target"):
        load_head(other, target)
    # weights missing
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(raw))
    weights = load_file(str(trained["dir"] / "model.safetensors"))
    weights.pop("fc.weight")
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"fc\.weight"):
        load_head(broken, target)
    # a config field gone
    (broken / "config.json").write_text(
        json.dumps({k: v for k, v in raw.items() if k != "head_dim"})
    )
    with pytest.raises(ModelLoadError, match="head_dim"):
        load_head(broken, target)
    kwargs = engine_kwargs()
    with pytest.raises(ConfigError, match="not one"):
        LLM(
            str(tiny_model_dir),
            speculative_config={"method": "eagle", "model": str(tiny_draft_dir)},
            **kwargs,
        )
    with pytest.raises(ConfigError, match="draft head, not a draft model"):
        LLM(
            str(tiny_model_dir),
            speculative_config={"method": "draft_model", "model": str(trained["dir"])},
            **kwargs,
        )
    with pytest.raises(ConfigError, match="SmolLM2"):
        LLM(str(tiny_model_dir), speculative_config={"method": "eagle"}, **kwargs)


def test_the_proposer_catches_up_from_stored_features_and_stays_in_its_vocabulary(
    tiny_model_dir: Path, trained: dict[str, Any]
) -> None:
    target = load_model(str(tiny_model_dir))
    head = load_head(trained["dir"], target)
    network = HeadNetwork(head)
    proposer = NetworkProposer(network, 16, 8, torch.Generator().manual_seed(0))
    seq = Sequence(0, "r", 0, [5, 6, 7, 8, 9], GREEDY, arrival_time=0.0)
    seq.block_table = [3, 1]
    seq.num_computed_tokens = 4
    features = torch.randn(4, head.config.hidden_size)
    proposer.observe_features([(seq, 0, 4)], features)
    torch.testing.assert_close(network._target_features(seq, 0, 5)[1:], features)
    torch.testing.assert_close(
        network._target_features(seq, 0, 5)[0], torch.zeros(features.shape[1])
    )
    drafted = proposer.propose([DraftRequest(seq, 3)]).tokens
    assert len(drafted[0]) == 3
    assert all(t < target.config.vocab_size - OUTSIDE for t in drafted[0])
    assert proposer._computed[seq.seq_id] == 7  # the prompt, then two single-token drafts
    seq.token_ids += [drafted[0][0], 11]  # the target accepted the first draft
    seq.num_computed_tokens = 6
    proposer.on_verified(seq)
    assert proposer._computed[seq.seq_id] == 5  # the draft's row read the head's feature


def test_train_head_end_to_end_makes_a_head_the_engine_uses(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``specbatch train-head``'s stages on the tiny target (answers with their labels,
    vocabulary, features, training, report), resumable: a second run reuses every stage."""
    from specbatch.distill.head import run

    config = HeadTrainConfig(
        work=tmp_path / "work",
        out=tmp_path / "head",
        target=str(tiny_model_dir),
        num_prompts=6,
        extra_prompts=0,
        answer_tokens=12,
        vocab_size=64,
        steps=3,
        tokens_per_batch=512,
        generation_batch=6,
    )
    run(config)
    report = json.loads((config.work / "head.json").read_text())
    assert len(report["agreement_by_depth"]) == config.unroll
    assert report["c"] > 0
    assert is_head_dir(config.out)
    stamp = (config.work / "features" / "00000.safetensors").stat().st_mtime
    run(config)  # resumes: the features are not computed again
    assert (config.work / "features" / "00000.safetensors").stat().st_mtime == stamp
    llm = LLM(
        str(tiny_model_dir),
        speculative_config={"method": "eagle", "model": str(config.out)},
        **engine_kwargs(),
    )
    off = LLM(str(tiny_model_dir), speculative_config={"method": "off"}, **engine_kwargs())
    prompts = prompts_with_variants(2, seed=9)
    assert greedy_tokens(llm, prompts) == greedy_tokens(off, prompts)
