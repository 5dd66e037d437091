"""Batched sampling: the target distribution as a pure function, and how a row draws from it.

``target_probs(logits, rows)`` is *the* distribution a row samples from: penalties (from the
row's history), temperature, min-p, top-k, top-p, in that order (vLLM's). Greedy rows get a
one-hot on the argmax of their penalised logits, so the rejection sampler treats greedy and random
rows with one rule. The plain sampler and the rejection sampler both call it.

Randomness, per row:

* unseeded rows draw one uniform from the engine's generator and invert the row's CDF;
* seeded rows use Gumbel-max with noise keyed by ``(seed, position of the generated token)``
  (:func:`gumbel_noise`), so a seeded request's output depends on nothing but its seed and its own
  tokens: not its batch-mates, not preemption, not how many draft tokens were verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specbatch.sampling_params import SamplingParams

_NOISE_SALT = 0x5EED_5A17


@dataclass
class SamplingRow:
    """One logits row to turn into a token: its request's params and the history before it."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # tokens generated before this row's token (drafts included)
    position: int  # index in the sequence of the token this row produces
    banned_token_ids: Sequence[int] = ()  # e.g. EOS while min_tokens is not reached
    allowed: np.ndarray | None = None  # [vocab] bool: a constraint's mask (None: any token)


@dataclass
class SamplingTensors:
    """The per-row settings of a batch of rows as tensors (built once per step)."""

    greedy: torch.Tensor  # [R] bool
    temperature: torch.Tensor  # [R], 1.0 on greedy rows
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None  # [R] long, vocab size where disabled
    top_p: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_counts: torch.Tensor | None  # [R, V] occurrences in the output so far
    prompt_mask: torch.Tensor | None  # [R, V] token occurs in the prompt
    banned: torch.Tensor | None  # [R, V] tokens that may not be produced
    bias: torch.Tensor | None  # [R, V] logit_bias
    allowed: torch.Tensor | None  # [R, V] the constraints' masks (True: allowed)
    all_greedy: bool
    any_greedy: bool  # host-side, so no step waits on the device to know it

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        params = [r.params for r in rows]

        def column(
            values: list[float], neutral: float, dtype: torch.dtype = torch.float32
        ) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        penalised = any(p.has_penalties for p in params)
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            min_p=column([p.min_p for p in params], 0.0),
            top_k=column(
                [min(p.top_k, vocab_size) or vocab_size for p in params], vocab_size, torch.long
            ),
            top_p=column([p.top_p for p in params], 1.0),
            presence=column([p.presence_penalty for p in params], 0.0),
            frequency=column([p.frequency_penalty for p in params], 0.0),
            repetition=column([p.repetition_penalty for p in params], 1.0),
            output_counts=_counts(rows, vocab_size, device) if penalised else None,
            prompt_mask=_prompt_mask(rows, vocab_size, device) if penalised else None,
            banned=_banned(rows, vocab_size, device),
            bias=_logit_bias(rows, vocab_size, device),
            allowed=_allowed(rows, vocab_size, device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
        )


def _flat_ids(
    rows: Sequence[SamplingRow], ids_of: Callable[[SamplingRow], Sequence[int]], vocab_size: int
) -> np.ndarray:
    """Indices ``row * vocab_size + token`` of every row's ``ids_of(row)`` (tokens in the
    vocabulary only), built on the host so a whole batch uploads in one copy."""
    lists = [np.asarray(ids_of(row), dtype=np.int64) for row in rows]
    if not lists:
        return np.zeros(0, dtype=np.int64)
    ids = np.concatenate(lists)
    row_index = np.repeat(np.arange(len(lists), dtype=np.int64), [len(x) for x in lists])
    keep = (ids >= 0) & (ids < vocab_size)
    return row_index[keep] * vocab_size + ids[keep]


def _counts(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows) * vocab_size, dtype=torch.float32, device=device)
    flat = _flat_ids(rows, lambda r: r.output_ids if r.params.has_penalties else (), vocab_size)
    if len(flat):
        index = torch.from_numpy(flat).to(device)
        counts.index_add_(0, index, torch.ones(len(flat), device=device))
    return counts.view(len(rows), vocab_size)


def _mask(flat: np.ndarray, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(rows * vocab_size, dtype=torch.bool, device=device)
    if len(flat):
        mask[torch.from_numpy(flat).to(device)] = True
    return mask.view(rows, vocab_size)


def _prompt_mask(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor:
    flat = _flat_ids(
        rows, lambda r: r.prompt_ids if r.params.repetition_penalty != 1.0 else (), vocab_size
    )
    return _mask(flat, len(rows), vocab_size, device)


def _banned(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    if not any(r.banned_token_ids for r in rows):
        return None
    flat = _flat_ids(rows, lambda r: r.banned_token_ids, vocab_size)
    return _mask(flat, len(rows), vocab_size, device)


def _allowed(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """The rows' constraint masks stacked (an unconstrained row allows every token)."""
    if all(r.allowed is None for r in rows):
        return None
    mask = np.ones((len(rows), vocab_size), dtype=bool)
    for i, row in enumerate(rows):
        if row.allowed is not None:
            mask[i] = row.allowed[:vocab_size]
    return torch.from_numpy(mask).to(device)


def _logit_bias(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    if not any(r.params.logit_bias for r in rows):
        return None
    flat = _flat_ids(rows, lambda r: list((r.params.logit_bias or {}).keys()), vocab_size)
    values = [
        value
        for row in rows
        for token, value in (row.params.logit_bias or {}).items()
        if 0 <= token < vocab_size
    ]
    bias = torch.zeros(len(rows) * vocab_size, dtype=torch.float32, device=device)
    if len(flat):
        bias[torch.from_numpy(flat).to(device)] = torch.tensor(values, device=device)
    return bias.view(len(rows), vocab_size)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The constraints' masks, logit bias, banned tokens, then repetition, frequency and
    presence penalties. A row that bans every token its constraint allows (the constraint is
    complete, only the end of sequence is allowed, and ``min_tokens`` bans it) keeps its
    constraint's tokens: the constraint wins.

    Returns a new tensor; ``logits`` is untouched.
    """
    banned = t.banned
    if t.allowed is not None:
        logits = logits.masked_fill(~t.allowed, float("-inf"))
        if banned is not None:
            nothing_left = (t.allowed & ~banned).sum(-1, keepdim=True) == 0
            banned = banned & ~nothing_left
    if t.bias is not None:
        logits = logits + t.bias
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    if t.output_counts is None:
        return logits
    assert t.prompt_mask is not None
    logits = logits.clone()
    if t.repetition is not None:
        seen = t.prompt_mask | (t.output_counts > 0)
        penalty = t.repetition[:, None].expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if t.frequency is not None:
        logits -= t.frequency[:, None] * t.output_counts
    if t.presence is not None:
        logits -= t.presence[:, None] * (t.output_counts > 0).float()
    return logits


def target_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from, ``[R, V]`` float32 (one-hot on greedy rows)."""
    logits = apply_penalties(logits.float(), t)
    if t.all_greedy:
        return _one_hot_argmax(logits)
    logits = logits / t.temperature[:, None]
    if t.min_p is not None:
        probs = logits.softmax(-1)
        threshold = t.min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if t.top_k is not None or t.top_p is not None:
        logits = _top_k_top_p(logits, t.top_k, t.top_p)
    probs = logits.softmax(-1)
    if t.any_greedy:
        probs = torch.where(t.greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits, dtype=torch.float32)
    return probs.scatter_(1, row_argmax(logits)[:, None], 1.0)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a 2-D tensor: the first largest of each row (a NaN counting as the
    largest, as torch and numpy both count it). A float CPU tensor goes through numpy: torch
    2.13's CPU argmax takes ~57 us over a 49,152-token row and numpy's ~6 (at batch 1 a
    decode step samples one row, a verify of four drafts five; this AVX2 host)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 2:
        return torch.from_numpy(x.detach().numpy().argmax(-1))
    return x.argmax(-1)


CANDIDATE_TIERS = (256, 4096)
"""Top-k/top-p look at each row's 256 largest logits first (``topk``, linear in the
vocabulary), then its 4096 largest, and sort the whole row only when its top-k or nucleus may
reach past those. Fixed tiers, so that a row's arithmetic never depends on the rows beside it."""


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """``logits`` with every token outside each row's top-k and nucleus (the smallest set of
    most likely tokens whose mass reaches top_p; the first is always kept) at -inf.

    Sorting a 49k vocabulary for 64 rows costs more than the model's forward at batch 64 (120-135
    ms in ``benchmarks/sampler.py`` against ~90 ms for a float32 decode forward in
    ``benchmarks/verify_cost.py``); the candidates hold the answer for almost every row, and the
    rest are sorted whole (``_top_k_top_p_sorted``, the obvious version)."""
    rows, vocab = logits.shape
    none = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    limited = top_k < vocab if top_k is not None else none
    nucleus = top_p < 1.0 if top_p is not None else none
    out = logits.clone()
    pending = (limited | nucleus).nonzero()[:, 0]
    for candidates in CANDIDATE_TIERS:
        if not len(pending) or vocab <= 2 * candidates:
            break
        values, done = _within_candidates(
            logits[pending],
            candidates,
            None if top_k is None else top_k[pending],
            None if top_p is None else top_p[pending],
        )
        out[pending[done]] = values[done]
        pending = pending[~done]
    if len(pending):
        out[pending] = _top_k_top_p_sorted(
            logits[pending],
            None if top_k is None else top_k[pending],
            None if top_p is None else top_p[pending],
        )
    return out


def _within_candidates(
    logits: torch.Tensor, candidates: int, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_top_k_top_p`` of rows whose top-k and nucleus fall within their ``candidates``
    largest logits, and which rows those are (the others' results are to be ignored)."""
    rows, vocab = logits.shape
    values, order = logits.topk(candidates, dim=-1)
    done = torch.ones(rows, dtype=torch.bool, device=logits.device)
    limited = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        limited = top_k < vocab
        kth = values.gather(1, (top_k.clamp(1, candidates) - 1)[:, None])
        # a top-k past the candidates, or a tie with the last one that may go on past it
        done &= ~limited | ((top_k <= candidates) & (kth[:, 0] != values[:, -1]))
        values = values.masked_fill(limited[:, None] & (values < kth), float("-inf"))
    if top_p is not None:
        nucleus = top_p < 1.0
        # the top-k's own distribution where a top-k applies, the whole row's otherwise
        total = torch.where(limited, values.logsumexp(-1), logits.logsumexp(-1))
        probs = (values - total[:, None]).exp()
        mass_before = probs.cumsum(-1) - probs
        done &= ~nucleus | limited | (mass_before[:, -1] + probs[:, -1] >= top_p)
        cut = nucleus[:, None] & (mass_before >= top_p[:, None])
        values = values.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, values), done


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """``_top_k_top_p`` by sorting every row whole."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).clamp(0, logits.shape[1] - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def gumbel_noise(seed: int, position: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[V]`` (float64) that depends only on ``(seed, position)``."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(hash((_NOISE_SALT, seed, position)) & 0x7FFF_FFFF_FFFF_FFFF)
    uniform = torch.rand(vocab_size, dtype=torch.float64, generator=generator)
    return (-torch.log(-torch.log(uniform))).to(device)


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator
) -> torch.Tensor:
    """One token per logits row, drawn from the row's target distribution."""
    if not rows:
        return torch.empty(0, dtype=torch.long)
    t = SamplingTensors.build(rows, logits.shape[1], logits.device)
    if t.all_greedy:
        return greedy_tokens(logits, t)
    return sample_rows(target_probs(logits, t), rows, t, generator)


def greedy_tokens(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The argmax of every row's penalised logits (what a greedy row emits)."""
    return row_argmax(apply_penalties(logits.float(), t))


def sample_rows(
    probs: torch.Tensor,
    rows: Sequence[SamplingRow],
    t: SamplingTensors,
    generator: torch.Generator,
) -> torch.Tensor:
    """One token per row from ``probs`` (the output of :func:`target_probs`): the argmax of
    greedy rows, an inverse-CDF draw from ``generator`` for unseeded rows (in row order), the
    Gumbel-max sample of seeded rows."""
    tokens = row_argmax(probs)
    if t.all_greedy:
        return tokens
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None and not r.params.greedy]
    if unseeded:
        index = torch.tensor(unseeded, device=probs.device)
        uniforms = torch.rand(
            len(unseeded), dtype=torch.float64, generator=generator, device=generator.device
        )
        tokens[index] = inverse_cdf(probs[index], uniforms.to(probs.device))
    return with_seeded_samples(tokens, probs, rows)


def with_seeded_samples(
    tokens: torch.Tensor, probs: torch.Tensor, rows: Sequence[SamplingRow]
) -> torch.Tensor:
    """``tokens`` with every seeded random row replaced by its Gumbel-max sample of ``probs``
    under the noise of ``(seed, position)``: the one seeded draw of the engine, shared by the
    sampler, the rejection sampler and the draft model (so a draft proposes what the target
    would sample when both distributions agree)."""
    for i, row in enumerate(rows):
        if row.params.seed is not None and not row.params.greedy:
            noise = gumbel_noise(row.params.seed, row.position, probs.shape[1], probs.device)
            tokens[i] = gumbel_argmax(probs[i], noise)
    return tokens


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample each row of (unnormalised) ``probs`` ``[R, V]`` with one uniform in [0, 1) each."""
    cdf = probs.double().cumsum(-1)
    targets = uniforms.double() * cdf[:, -1]
    picked = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)


def gumbel_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``argmax(log p + g)``: a sample of ``probs`` that is a fixed function of the noise."""
    return (probs.double().log() + noise).argmax(-1)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the unprocessed model distribution (what ``logprobs`` reports)."""
    return torch.log_softmax(logits.float(), dim=-1)
