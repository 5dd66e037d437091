"""How many drafts each sequence gets this step: the most expected tokens per second.

A draft token is worth its probability of being accepted, and costs the time it adds to the
step: one more row in the target's forward (cheap at batch 1, not at batch 64 on a CPU, where
the forward is compute-bound) and its share of the proposer's time. So the right number of
drafts depends on the batch and on each sequence's acceptance, and a fixed k is wrong
somewhere: too many drafts for a big batch of sequences whose drafts are rarely accepted, too
few for a small one that copies its prompt.

Each step the budget ranks every possible draft of every sequence by its expected gain (the
probability that it is emitted: that it and every draft before it are accepted) and keeps the
prefix of that ranking that maximises ``(sequences + sum of gains) / (step time + proposer
time)`` (the goodput of SmartSpec, Liu et al. 2024). The step time as a function of the tokens
in the forward is measured as the engine runs (smoothed per size; a line fitted through the
nearest measured sizes), the proposer's time per drafted token likewise. A sequence's first
draft is accepted with a probability estimated from its own verifies (old steps decay); each
later draft, given the one before it was accepted, with a probability estimated over all
sequences per position. Acceptance is bursty (a prompt-lookup match that is right for one token
is usually right for the next), which a single per-token rate would miss.
Until two step sizes have been measured the budget alternates between all drafts and none, so
that it has both to compare. A sequence that got no drafts for ``PROBE_AFTER`` steps gets one,
so that its acceptance estimate keeps up with its text (without it, a big batch that never
drafts would never learn that some of its sequences copy their prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SMOOTHING = 0.2  # weight of a new measurement in a running average
DECAY = 0.9  # how much of its acceptance history a sequence keeps per verify
SHARED_DECAY = 0.99  # the same for the per-position rates shared by all sequences
PRIOR = 1.0  # pseudo-successes and pseudo-failures of a new sequence (acceptance 0.5)
BUCKET_RATIO = 1.125  # step sizes above 16 tokens share a measurement within 12.5%
PROBE_AFTER = 16  # steps without a draft after which a sequence gets one
FIT_POINTS = 4  # measured step sizes a time estimate is fitted through


class StepTimes:
    """Seconds of a step as a function of the tokens in its forward, measured as it runs."""

    def __init__(self) -> None:
        self._points: dict[int, tuple[float, float]] = {}  # bucket -> (tokens, seconds)

    @staticmethod
    def _bucket(tokens: int) -> int:
        if tokens <= 16:
            return tokens
        return 16 + round(math.log(tokens / 16) / math.log(BUCKET_RATIO))

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        key = self._bucket(tokens)
        old = self._points.get(key)
        if old is None:
            self._points[key] = (float(tokens), seconds)
        else:
            n, t = old
            self._points[key] = (n + SMOOTHING * (tokens - n), t + SMOOTHING * (seconds - t))

    @property
    def ready(self) -> bool:
        return len(self._points) >= 2

    def over(self, tokens: np.ndarray, around: float) -> np.ndarray:
        """Estimated seconds for steps of ``tokens`` tokens: a least-squares line through the
        ``FIT_POINTS`` measured sizes nearest ``around`` (in ratio), never decreasing with
        size; a single measured size scales."""
        points = list(self._points.values())
        if len(points) == 1:
            n, t = points[0]
            return t * tokens / n
        points.sort(key=lambda p: abs(math.log(p[0] / max(around, 1e-9))))
        near = np.array(points[:FIT_POINTS])
        sizes, seconds = near[:, 0], near[:, 1]
        centre = sizes.mean()
        spread = ((sizes - centre) ** 2).sum()
        slope = ((sizes - centre) * (seconds - seconds.mean())).sum() / spread if spread else 0.0
        return np.maximum(seconds.mean() + max(slope, 0.0) * (tokens - centre), 1e-9)


@dataclass
class _Acceptance:
    successes: float = PRIOR
    failures: float = PRIOR

    @property
    def rate(self) -> float:
        return self.successes / (self.successes + self.failures)

    def observe(self, accepted: bool, decay: float = DECAY) -> None:
        self.successes = decay * self.successes + accepted
        self.failures = decay * self.failures + (not accepted)


class SpeculationBudget:
    """Chooses each sequence's drafts per step; learns from the engine's measurements."""

    def __init__(self) -> None:
        self.step_times = StepTimes()
        self.proposer_seconds_per_draft: float | None = None
        self._acceptance: dict[int, _Acceptance] = {}
        self._follow_on: list[_Acceptance] = []  # per draft position, over all sequences
        self._idle: dict[int, int] = {}  # steps since a sequence last got a draft
        self._explore_all = True

    def acceptance(self, seq_id: int) -> float:
        """Estimated probability that this sequence's next first draft is accepted."""
        state = self._acceptance.get(seq_id)
        return PRIOR / (2 * PRIOR) if state is None else state.rate

    def follow_on(self, position: int) -> float:
        """Estimated probability that draft ``position`` (1 is the second) is accepted when
        the one before it was, over all sequences."""
        if position >= len(self._follow_on):
            return 0.5
        return self._follow_on[position].rate

    def gains(self, seq_id: int, lookahead: int) -> list[float]:
        """Probability that each of the sequence's next ``lookahead`` drafts is emitted."""
        gains, gain = [], self.acceptance(seq_id)
        for position in range(lookahead):
            if position:
                gain *= self.follow_on(position)
            gains.append(gain)
        return gains

    def allot(self, seq_ids: list[int], lookaheads: list[int], base_tokens: int) -> list[int]:
        """Drafts per sequence (each at most its lookahead) for a step whose forward has
        ``base_tokens`` tokens before drafts and whose sampling sequences are ``seq_ids``."""
        if not self.step_times.ready:
            self._explore_all = not self._explore_all
            return list(lookaheads) if self._explore_all else [0] * len(lookaheads)
        gains = []  # (expected tokens, sequence index) of every possible draft
        for i, (seq_id, lookahead) in enumerate(zip(seq_ids, lookaheads, strict=True)):
            gains += [(gain, i) for gain in self.gains(seq_id, lookahead)]
        gains.sort(key=lambda g: -g[0])
        # expected tokens and seconds of a step with the best 0, 1, 2, ... drafts
        tokens = len(seq_ids) + np.concatenate([[0.0], np.cumsum([g for g, _ in gains])])
        counts = np.arange(len(gains) + 1, dtype=np.float64)
        best_count = int(np.argmax(tokens / self.cost(base_tokens, counts)))
        drafts = [0] * len(seq_ids)
        for _, i in gains[:best_count]:
            drafts[i] += 1
        for i, (seq_id, lookahead) in enumerate(zip(seq_ids, lookaheads, strict=True)):
            idle = 0 if drafts[i] else self._idle.get(seq_id, 0) + 1
            if idle >= PROBE_AFTER and lookahead:
                drafts[i], idle = 1, 0
            self._idle[seq_id] = idle
        return drafts

    def cost(self, base_tokens: int, num_drafts: np.ndarray | int) -> np.ndarray:
        """Estimated seconds of steps with ``num_drafts`` draft tokens on top of ``base_tokens``
        (one fitted line for all of them)."""
        counts = np.asarray(num_drafts, dtype=np.float64)
        per_draft = self.proposer_seconds_per_draft or 0.0
        around = base_tokens + float(counts.max()) / 2
        return self.step_times.over(base_tokens + counts, around) + per_draft * counts

    def observe_step(
        self, forward_tokens: int, seconds: float, num_drafts: int, proposer_seconds: float
    ) -> None:
        """A finished step: its forward's size, its time without the proposer, and the
        proposer's time for its drafts."""
        self.step_times.observe(forward_tokens, seconds)
        if num_drafts:
            per_draft = proposer_seconds / num_drafts
            old = self.proposer_seconds_per_draft
            self.proposer_seconds_per_draft = (
                per_draft if old is None else old + SMOOTHING * (per_draft - old)
            )

    def observe_verify(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        state = self._acceptance.setdefault(seq_id, _Acceptance())
        state.observe(num_accepted > 0)
        while len(self._follow_on) < num_drafts:
            self._follow_on.append(_Acceptance())
        for position in range(1, min(num_accepted + 1, num_drafts)):
            self._follow_on[position].observe(position < num_accepted, SHARED_DECAY)

    def forget(self, seq_id: int) -> None:
        self._acceptance.pop(seq_id, None)
        self._idle.pop(seq_id, None)
