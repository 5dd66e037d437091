"""Speculative decoding configuration (vLLM's ``speculative_config`` shape)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from specbatch.errors import ConfigError
from specbatch.spec_decode.tuning import SpeculationTuning, parse_dataclass

METHODS = ("auto", "off", "draft_model", "eagle", "ngram", "suffix", "hybrid", "external")
# the methods that may keep a store of other requests' tokens (``suffix_store_tokens``)
STORE_METHODS = ("auto", "suffix", "hybrid")
DRAFT_METHODS = ("draft_model", "eagle", "hybrid")
# k when the config does not say: for fixed k, what the benchmarks in docs/notes.md were
# measured with (with the confidence stop a draft model's k is only a ceiling); under the
# goodput controller k is only a ceiling on what it may give, and a long prompt-lookup match
# pays beyond 4 (code editing at batch 1: 2.56x with 8 vs 2.26x with 4, same run; notes of
# 2026-12-01).
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_ADAPTIVE_NUM_SPECULATIVE_TOKENS = 8
# Measured on the shipped draft (docs/distillation.md): 0.3-0.7 all beat 0 (always k) clearly.
DEFAULT_DRAFT_CONFIDENCE = 0.5
# The store's default size in tokens: a few hundred requests' prompts and outputs (its memory
# is bounded by tests/spec_decode/test_suffix_store.py).
DEFAULT_SUFFIX_STORE_TOKENS = 1 << 18
TREE_KINDS = ("siblings", "dynamic")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft tokens for every decoding sequence.

    ``method``: ``"draft_model"`` (a smaller model of the same vocabulary, ``model``) or
    ``"ngram"`` (prompt lookup: the longest suffix n-gram, ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens, found earlier in the sequence proposes what followed it).
    ``num_speculative_tokens`` is k, the drafts verified per step (fewer near ``max_tokens`` or
    the context end). ``"hybrid"`` drafts by prompt lookup where the sequence repeats earlier
    text (a suffix of at least ``prompt_lookup_min`` tokens found earlier; 2 by default, 1 for
    ``"ngram"``) and elsewhere with the draft ``model`` or a shorter match, per sequence
    whichever has paid better. ``"suffix"`` is prompt lookup plus a store of the last
    ``suffix_store_tokens`` tokens of finished requests (their prompts and outputs;
    SuffixDecoding): where the sequence's suffix occurred in other requests, what followed the
    occurrences of its longest match, scored by frequency, is a way of its own beside the
    sequence's own lookups. ``"hybrid"`` and ``"auto"`` keep the store too
    (``suffix_store_tokens=0``: none); ``"ngram"`` is prompt lookup alone. ``"external"``
    means the application passes its own
    :class:`~specbatch.spec_decode.proposers.base.Proposer` to ``LLMEngine(config, proposer=...)``.

    ``"auto"`` (the default, also what ``None`` means) is ``"hybrid"`` with the shipped draft
    for a target it was made for (SmolLM2-135M-Instruct, recognised by shape and vocabulary) or
    with ``model`` when one is given, and ``"suffix"`` (``"ngram"`` without a store) for any
    other target. ``"off"`` is the
    plain path: no proposer, no draft slots.

    ``draft_confidence_threshold`` (draft models only) makes k a ceiling: a sequence stops
    drafting after the draft that brings the draft's own probability that all its drafts so
    far are right (the product of its probabilities of the tokens it drafted) below the
    threshold (that draft is still verified: its forward is paid, a verify row is cheap); 0.5 by
    default, 0 always drafts k tokens. Without ``num_speculative_tokens`` k is 8 under the
    controller (``adaptive_k``, a ceiling) and 4 with ``adaptive_k=False``.
    ``adaptive_k`` (on by default) makes k a ceiling for every method: each step the goodput
    controller (``spec_decode/control/controller.py``) gives each sequence the number of drafts, and
    for ``"hybrid"`` the way (prompt lookup or the draft model), that maximises the expected
    tokens per second of the whole step, from measured step times and each sequence's
    acceptance so far; with many sequences or poor acceptance that is none, the plain step.
    ``adaptive_k=False`` verifies k drafts for every sequence every step.
    ``lookup_tree`` (``"ngram"`` and ``"hybrid"``): where the matched suffix occurred several
    times earlier with different continuations, prompt lookup proposes them as a tree (up to
    the same number of drafts, the likeliest nodes first) checked in one verify under a tree
    attention mask, instead of the latest occurrence's continuation alone. ``draft_tree``
    (draft models, under the controller; by default on there, except when the target replays
    CUDA graphs, which a step with a tree cannot): beside its chain the draft model proposes
    further tokens as siblings where the controller's price of a verify row says they pay
    (they cost no draft forward). ``draft_tree_kind``: ``"siblings"`` (those leaves, the
    default for a draft model) or ``"dynamic"`` (EAGLE-2's dynamic tree, grown a draft forward
    per level: the default for a draft head).
    ``draft_dtype`` (draft models): the draft model's weights and activations. ``"q8_0"``
    quantizes its weights to Q8_0 blocks at load (float32 activations, the GGUF kernel; CPU
    only). ``"auto"`` (the default) is ``"q8_0"`` under a target whose layers multiply GGUF
    blocks (``quantization="gguf"``), bfloat16 on a CPU with native bfloat16 arithmetic
    (AVX512-BF16 or AMX) under a float32 target with packed weights, else the target's
    dtype: a draft forward streams its
    weights for a handful of rows, so half the bytes make it cheaper (and let a 2-layer draft's
    weights stay in a 32 MiB L3 across a chain's forwards); outputs do not depend on the
    draft's precision. A draft head always runs in the target's dtype.
    ``draft_tree_depth`` with ``draft_tree=True`` and ``adaptive_k=False`` fixes the tree's
    budget instead: ``num_speculative_tokens`` nodes per sequence (verify rows), at most
    ``draft_tree_depth`` deep, the likeliest nodes kept (SGLang's ``num_draft_tokens`` and
    ``num_steps``).
    ``tuning``: the controller's and proposers' constants
    (:class:`~specbatch.spec_decode.tuning.SpeculationTuning`, or a dict of some of its
    fields), for experiments.
    None of these change what is generated: greedy and seeded outputs are token for token the
    same, unseeded sampling keeps the target's distribution (its draws differ).
    """

    method: str = "auto"
    num_speculative_tokens: int | None = None  # the method's default
    model: str | None = None
    prompt_lookup_min: int | None = None  # 1 for ngram, 2 for hybrid
    prompt_lookup_max: int = 4
    draft_confidence_threshold: float | None = None  # 0.5 for draft models, else 0
    adaptive_k: bool = True
    lookup_tree: bool = False
    suffix_store_tokens: int | None = None  # None: DEFAULT_SUFFIX_STORE_TOKENS where kept
    draft_tree: bool | None = None  # None: on under the controller, off under CUDA graphs
    draft_tree_depth: int | None = None  # a fixed tree (adaptive_k=False): its depth
    draft_tree_kind: str | None = None  # None: dynamic for a draft head, else siblings
    draft_dtype: str = "auto"  # the draft model's; "auto": see the docstring
    tuning: SpeculationTuning = field(default_factory=SpeculationTuning)

    MAX_TOKENS = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "tuning", SpeculationTuning.parse(self.tuning))
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative_config method must be one of {METHODS}, got {self.method!r}"
            )
        if self.method == "off":
            extra = [
                f.name
                for f in fields(self)
                if f.name != "method" and getattr(self, f.name) != _default(f)
            ]
            if extra:
                raise ConfigError(
                    f"speculative_config method 'off' takes no other keys, got {extra}"
                )
            return
        # frozen: defaults are set through object
        if self.num_speculative_tokens is None:
            default_k = (
                DEFAULT_ADAPTIVE_NUM_SPECULATIVE_TOKENS
                if self.adaptive_k is True
                else DEFAULT_NUM_SPECULATIVE_TOKENS
            )
            object.__setattr__(self, "num_speculative_tokens", default_k)
        self._check_store()
        if self.method == "auto":
            self._check_k()
            self._check_lookup_tree()
            self._check_draft_dtype()
            return  # the rest depends on the method auto resolves to (``resolved``)
        if self.draft_confidence_threshold is None:
            default_threshold = DEFAULT_DRAFT_CONFIDENCE if self.method in DRAFT_METHODS else 0.0
            object.__setattr__(self, "draft_confidence_threshold", default_threshold)
        self._check_k()
        threshold = self.draft_confidence_threshold
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not 0.0 <= threshold < 1.0
        ):
            raise ConfigError(
                f"draft_confidence_threshold must be a number in [0, 1), got {threshold!r}"
            )
        if threshold and self.method not in DRAFT_METHODS:
            raise ConfigError(
                f"draft_confidence_threshold is for methods {DRAFT_METHODS}, not {self.method!r}"
            )
        if self.prompt_lookup_min is None:
            object.__setattr__(self, "prompt_lookup_min", 2 if self.method == "hybrid" else 1)
        if self.method in ("ngram", "suffix", "hybrid"):
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
                raise ConfigError(
                    "prompt_lookup_min and prompt_lookup_max must be integers with "
                    f"1 <= prompt_lookup_min <= prompt_lookup_max, got {low!r}, {high!r}"
                )
        self._check_lookup_tree()
        self._check_draft_dtype()
        if self.model is not None and self.method not in DRAFT_METHODS:
            raise ConfigError(
                f"speculative_config 'model' is for methods {DRAFT_METHODS}, not {self.method!r}"
            )

    def _check_lookup_tree(self) -> None:
        for key, methods in (
            ("lookup_tree", ("auto", "ngram", "suffix", "hybrid")),
            ("draft_tree", ("auto", *DRAFT_METHODS)),
        ):
            value = getattr(self, key)
            if not isinstance(value, bool) and not (key == "draft_tree" and value is None):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
            if value and self.method not in methods:
                raise ConfigError(f"{key} is for methods {methods}, not {self.method!r}")
        kind = self.draft_tree_kind
        if kind is not None:
            if kind not in TREE_KINDS:
                raise ConfigError(f"draft_tree_kind must be one of {TREE_KINDS}, got {kind!r}")
            if self.method not in ("auto", *DRAFT_METHODS):
                raise ConfigError(
                    f"draft_tree_kind is for methods {('auto', *DRAFT_METHODS)}, "
                    f"not {self.method!r}"
                )
        depth = self.draft_tree_depth
        if depth is not None:
            if self.adaptive_k is not False or self.draft_tree is not True:
                raise ConfigError(
                    "draft_tree_depth fixes a tree's budget: it needs draft_tree=true and "
                    "adaptive_k=false (the controller sizes trees itself)"
                )
            k = self.num_speculative_tokens or 0  # checked by _check_k first
            if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= k:
                raise ConfigError(
                    "draft_tree_depth must be an integer in [1, num_speculative_tokens "
                    f"({k})], got {depth!r}"
                )
        elif self.draft_tree and self.adaptive_k is False:
            raise ConfigError(
                "draft_tree needs the goodput controller (adaptive_k=true), or a fixed tree: "
                "adaptive_k=false with draft_tree_depth"
            )

    def _check_store(self) -> None:
        tokens = self.suffix_store_tokens
        if tokens is None:
            default = DEFAULT_SUFFIX_STORE_TOKENS if self.method in STORE_METHODS else 0
            object.__setattr__(self, "suffix_store_tokens", default)
            return
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ConfigError(f"suffix_store_tokens must be an integer >= 0, got {tokens!r}")
        if tokens and self.method not in STORE_METHODS:
            raise ConfigError(
                f"suffix_store_tokens is for methods {STORE_METHODS}, not {self.method!r}"
            )
        if self.method == "suffix" and tokens < 64:
            raise ConfigError(
                f"method 'suffix' needs a store of at least 64 tokens, got {tokens} "
                "(method 'ngram' is prompt lookup without one)"
            )

    @property
    def store_tokens(self) -> int:
        """``suffix_store_tokens``, resolved (0: no store)."""
        assert self.suffix_store_tokens is not None
        return self.suffix_store_tokens

    def _check_draft_dtype(self) -> None:
        value = self.draft_dtype
        if value not in DRAFT_DTYPES:
            raise ConfigError(f"draft_dtype must be one of {DRAFT_DTYPES}, got {value!r}")
        if value != "auto" and self.method not in ("auto", *DRAFT_METHODS):
            raise ConfigError(
                f"draft_dtype is for methods {('auto', *DRAFT_METHODS)}, not {self.method!r}"
            )

    def _check_k(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.MAX_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {self.MAX_TOKENS}], got {k!r}"
            )
        if not isinstance(self.adaptive_k, bool):
            raise ConfigError(f"adaptive_k must be true or false, got {self.adaptive_k!r}")

    def resolved(self, shipped_draft_fits: bool) -> SpeculativeConfig:
        """``"auto"`` made concrete for a target (``shipped_draft_fits``: the shipped draft
        was made for it and is preferred): hybrid with a draft, else ngram."""
        if self.method != "auto":
            return self
        method = "hybrid" if self.model is not None or shipped_draft_fits else "suffix"
        if method == "suffix" and not self.store_tokens:
            method = "ngram"
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if method != "hybrid":  # no draft model to branch
            values["draft_tree"] = values["draft_tree_depth"] = values["draft_tree_kind"] = None
            values["draft_dtype"] = "auto"
        return SpeculativeConfig(**{**values, "method": method})

    def chains_only(self, why: str) -> SpeculativeConfig:
        """This config drafting chains, never trees (a tree's nodes sit at positions the
        attention of ``why`` cannot place); a ``ConfigError`` where trees were asked for."""
        if self.lookup_tree or self.draft_tree:
            raise ConfigError(f"speculation trees (lookup_tree, draft_tree) cannot run on {why}")
        if not self.enabled or self.method in ("ngram", "suffix", "external"):
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return SpeculativeConfig(**{**values, "draft_tree": False})

    def draft_siblings(self, cuda_graphs: bool) -> bool:
        """Whether the draft model adds siblings: ``draft_tree`` when set, else under the
        controller unless the target replays CUDA graphs (a step with a tree runs eagerly)."""
        if self.draft_tree is not None:
            return self.draft_tree
        return self.adaptive_k and self.method in DRAFT_METHODS and not cuda_graphs

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig:
        """Accept a config, a vLLM-style dict, or None (``"auto"``)."""
        return parse_dataclass(cls, value, "speculative_config")

    @property
    def k(self) -> int:
        """Drafts verified per step at most (``num_speculative_tokens``, resolved)."""
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens

    @property
    def confidence_threshold(self) -> float:
        """``draft_confidence_threshold``, resolved."""
        assert self.draft_confidence_threshold is not None
        return self.draft_confidence_threshold


def _default(f: Field[Any]) -> Any:
    if f.default is MISSING and f.default_factory is not MISSING:
        return f.default_factory()
    return f.default
