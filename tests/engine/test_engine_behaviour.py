"""LLMEngine and LLM on a tiny random model: batching, preemption, prefix caching, stops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specbatch import LLM, LLMEngine, SamplingParams
from specbatch.config import EngineConfig
from specbatch.kernels.attention import AttentionInputs

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_llm(model_dir: Path, **kwargs: object) -> LLM:
    defaults: dict[str, object] = {"num_kv_blocks": 128, "max_model_len": 256, "block_size": 8}
    defaults.update(kwargs)
    return LLM(str(model_dir), **defaults)  # type: ignore[arg-type]


def random_prompts(
    count: int, vocab: int, seed: int = 0, low: int = 3, high: int = 60
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(low, high))).tolist() for _ in range(count)]


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 64},
        # bfloat16 rounds every output, so a row must see the same arithmetic in any batch and
        # however its prompt was cut (prefix-cache hits on the second pass): the linears'
        # single-row path, the attention's precision and the prefill path once broke that
        {"max_num_batched_tokens": 64, "dtype": "bfloat16"},
    ],
    ids=["float32", "bfloat16"],
)
def test_batch_equals_alone(tiny_model_dir: Path, settings: dict[str, object]) -> None:
    llm = make_llm(tiny_model_dir, **settings)
    prompts = random_prompts(24, 300)
    together = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert together == alone


def test_generation_matches_a_plain_greedy_loop(tiny_model_dir: Path) -> None:
    """The engine's tokens equal argmax decoding by recomputing the whole sequence each time."""
    llm = make_llm(tiny_model_dir)
    model = llm.llm_engine.model
    prompt = random_prompts(1, 300, seed=5)[0]
    got = token_ids(
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )
    )[0]
    from tests.helpers import PagedHarness

    ids = list(prompt)
    expected = []
    for _ in range(12):
        harness = PagedHarness(model, num_blocks=64, block_size=8)
        logits = harness.forward([(0, ids)])[0]
        expected.append(int(logits[-1].argmax()))
        ids.append(expected[-1])
    assert got == expected


def test_preemption_gives_identical_outputs_and_returns_every_block(tiny_model_dir: Path) -> None:
    prompts = random_prompts(12, 300, seed=1, low=20, high=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = token_ids(make_llm(tiny_model_dir).generate(prompts, params, use_tqdm=False))
    small = make_llm(tiny_model_dir, num_kv_blocks=24, max_model_len=96, block_size=8)
    outputs = small.generate(prompts, params, use_tqdm=False)
    engine = small.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert token_ids(outputs) == reference
    assert engine.cache.num_free_blocks == engine.num_kv_blocks
    engine.cache.pool.check_consistency()


def test_seeded_sampling_survives_preemption(tiny_model_dir: Path) -> None:
    prompts = random_prompts(10, 300, seed=2, low=20, high=40)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True) for i in range(10)
    ]
    reference = token_ids(make_llm(tiny_model_dir).generate(prompts, params, use_tqdm=False))
    small = make_llm(tiny_model_dir, num_kv_blocks=20, max_model_len=80, block_size=8)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert token_ids(outputs) == reference


def test_prefix_caching_skips_shared_blocks(tiny_model_dir: Path) -> None:
    shared = random_prompts(1, 300, seed=3, low=40, high=41)[0]
    prompts = [shared + [10, 11, 12], shared + [20, 21]]
    off = make_llm(tiny_model_dir, enable_prefix_caching=False)
    on = make_llm(tiny_model_dir, enable_prefix_caching=True)
    expected = token_ids(off.generate(prompts, GREEDY, use_tqdm=False))
    first = on.generate(prompts[:1], GREEDY, use_tqdm=False)
    computed_before = on.llm_engine.stats.num_prompt_tokens
    second = on.generate(prompts[1:], GREEDY, use_tqdm=False)
    computed = on.llm_engine.stats.num_prompt_tokens - computed_before
    assert token_ids(first + second) == expected
    assert second[0].metrics.num_cached_tokens == 40  # 5 full blocks of 8
    assert computed == len(prompts[1]) - 40
    assert first[0].metrics.num_cached_tokens == 0


def test_seeded_requests_ignore_batch_composition(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    prompt = random_prompts(1, 300, seed=4)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = token_ids(llm.generate([prompt], params, use_tqdm=False))[0]
    others = random_prompts(6, 300, seed=5)
    mixed = llm.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(temperature=1.0, max_tokens=20)] * 3
        + [params]
        + [SamplingParams(temperature=0.8, max_tokens=25)] * 3,
        use_tqdm=False,
    )
    assert mixed[3].outputs[0].token_ids == alone
    again = token_ids(make_llm(tiny_model_dir).generate([prompt], params, use_tqdm=False))[0]
    assert again == alone


def test_n_completions_are_distinct_and_reproducible(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    single = llm.generate([[5, 6, 7, 8]], params.clone(n=1), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids


def test_logprobs_are_the_raw_model_log_softmax(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    prompt = [5, 9, 13, 17, 21]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=3, logprobs=4, prompt_logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    from tests.helpers import PagedHarness

    completion = out.outputs[0]
    ids = prompt + completion.token_ids
    logits = PagedHarness(llm.llm_engine.model).forward([(0, ids)])[0]
    reference = torch.log_softmax(logits, -1)
    for i, position in enumerate(completion.logprobs or []):
        row = reference[len(prompt) - 1 + i]
        top = row.topk(4).indices.tolist()
        assert set(top) <= set(position)
        token = completion.token_ids[i]
        assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert position[top[0]].rank == 1
    assert out.prompt_logprobs is not None
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert entry is not None
        assert entry[prompt[j]].logprob == pytest.approx(
            float(reference[j - 1, prompt[j]]), abs=1e-4
        )


def test_detokenize_false_keeps_tokens_and_logprobs_without_text(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    prompts = [[5, 9, 13, 17, 21], [30, 31]]
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=12, logprobs=3, prompt_logprobs=3, ignore_eos=True
    )
    with_text = llm.generate(prompts, params, use_tqdm=False)
    bare = llm.generate(prompts, params.clone(detokenize=False), use_tqdm=False)
    for full, quick in zip(with_text, bare, strict=True):
        assert full.outputs[0].text  # the tiny tokenizer decodes these ids to something
        assert quick.outputs[0].text == ""
        assert quick.outputs[0].token_ids == full.outputs[0].token_ids
        for a, b in zip(
            full.outputs[0].logprobs or [], quick.outputs[0].logprobs or [], strict=True
        ):
            assert {t: (lp.logprob, lp.rank) for t, lp in a.items()} == {
                t: (lp.logprob, lp.rank) for t, lp in b.items()
            }
            assert all(lp.decoded_token is None for lp in b.values())
        assert quick.prompt_logprobs is not None
        assert len(quick.prompt_logprobs) == len(full.prompt_token_ids)


def test_finish_reasons(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    prompt = [5, 6, 7]
    free = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert free.finish_reason == "length"
    assert len(free.token_ids) == 30
    stop_id = free.token_ids[4]
    first_stop = free.token_ids.index(stop_id)
    by_id = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.finish_reason == "stop"
    assert by_id.stop_reason == stop_id
    assert by_id.token_ids == free.token_ids[: first_stop + 1]


def test_eos_ends_generation_unless_ignored(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    eos = next(iter(llm.get_tokenizer().eos_token_ids))
    eos_first = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    first = llm.generate([[5, 6]], eos_first, use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "stop"
    assert first.token_ids == [eos]
    assert first.text == ""
    ignored = llm.generate([[5, 6]], eos_first.clone(ignore_eos=True), use_tqdm=False)[0]
    assert ignored.outputs[0].finish_reason == "length"
    assert ignored.outputs[0].token_ids == [eos] * 10
    delayed = llm.generate([[5, 6]], eos_first.clone(min_tokens=3), use_tqdm=False)[0]
    assert len(delayed.outputs[0].token_ids) == 4
    assert eos not in delayed.outputs[0].token_ids[:3]
    assert delayed.outputs[0].token_ids[3] == eos


def test_stop_strings_across_token_boundaries(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    prompt = [5, 6, 7]
    free = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    pieces = [tokenizer.decode(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]
    text = free.text
    # a stop string made of the end of one token's text and the start of the next one's
    boundary = next(
        i
        for i in range(3, len(pieces))
        if len(pieces[i]) - len(pieces[i - 1]) >= 1 and len(pieces[i - 1]) >= 2
    )
    cut = len(pieces[boundary - 1])
    stop = text[cut - 2 : cut + 1]
    start = text.find(stop)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == text[:start]
    kept = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=30,
            stop=stop,
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: start + len(stop)]


def test_abort_mid_generation_frees_blocks(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, block_size=8)
    )
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort("a")
    assert not engine.abort("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["b"]
    assert engine.cache.num_free_blocks == 64
    engine.cache.pool.check_consistency()


def test_streaming_deltas_concatenate_to_the_final_text(tiny_model_dir: Path) -> None:
    from specbatch.sampling_params import OutputKind

    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, block_size=8)
    )
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    engine.add_request("d", [5, 6, 7], params.clone(output_kind=OutputKind.DELTA, stop=["zz"]))
    engine.add_request("c", [5, 6, 7], params.clone(stop=["zz"]))
    text, tokens, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "d":
                text += out.outputs[0].text
                tokens += out.outputs[0].token_ids
            elif out.finished:
                final = out.outputs[0]
    assert final is not None
    assert text == final.text
    assert tokens == final.token_ids


def test_bad_requests_are_refused_cleanly(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=64, block_size=8)
    )
    with pytest.raises(ValueError, match="prompt has 64 tokens, but the context holds 64"):
        engine.add_request("x", list(range(3, 67)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [])
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 300\)"):
        engine.add_request("x", [5, 300])
    engine.add_request("x", [5])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [6])
    assert engine.num_unfinished_requests() == 1


def test_attention_inputs_reject_inconsistent_layouts() -> None:
    with pytest.raises(ValueError, match="one entry per query token"):
        AttentionInputs(np.array([2]), np.array([2]), np.zeros((1, 1)), np.array([0]), 16)


def test_model_vocabulary_beyond_the_tokenizer(tmp_path: Path) -> None:
    """Padded embeddings: ids past the tokenizer decode to nothing instead of failing."""
    from tests.helpers import write_tiny_model

    model_dir = write_tiny_model(tmp_path, vocab_size=320)  # tokenizer has 300 ids
    llm = make_llm(model_dir)
    beyond = SamplingParams(temperature=0, max_tokens=4, logit_bias={310: 100.0}, logprobs=2)
    out = llm.generate([[5, 6, 7]], beyond, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [310] * 4
    assert out.text == ""
    assert out.logprobs is not None
    assert out.logprobs[0][310].decoded_token == ""


def test_prompt_logprobs_are_complete_despite_a_cached_prefix(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, enable_prefix_caching=True)
    prompt = list(range(3, 40))
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # fills the cache
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(prompt)
    assert all(entry is not None for entry in out.prompt_logprobs[1:])
    assert out.metrics.num_cached_tokens == 0
