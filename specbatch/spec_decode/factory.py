"""Building the proposer a :class:`SpeculativeConfig` asks for, refusing incompatible drafts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specbatch.errors import ConfigError, ModelLoadError
from specbatch.kernels.onednn import cpu_packing_supported
from specbatch.models import load_model, resolve_model_path
from specbatch.models.llama import LlamaForCausalLM
from specbatch.models.loader import parse_dtype
from specbatch.spec_decode.config import DRAFT_METHODS, SpeculativeConfig
from specbatch.spec_decode.control.controller import GoodputController
from specbatch.spec_decode.plan import ways_of
from specbatch.spec_decode.proposers.base import Proposer
from specbatch.spec_decode.proposers.draft_model import DraftModelNetwork
from specbatch.spec_decode.proposers.drafting import DraftNetwork, NetworkProposer
from specbatch.spec_decode.proposers.head import EagleHead, HeadNetwork, is_head_dir, load_head
from specbatch.spec_decode.proposers.hybrid import HybridProposer
from specbatch.spec_decode.proposers.ngram import NgramProposer
from specbatch.spec_decode.proposers.shipped import (
    check_shipped_q8_0,
    default_draft_path,
    default_head_path,
    drafts_for,
)
from specbatch.spec_decode.proposers.suffix import SuffixStore
from specbatch.spec_decode.speculator import Speculator
from specbatch.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:  # triton is optional: only CUDA engines build graphs
    from specbatch.runner.cuda_graphs import CudaGraphRunner

_PROBE = "Hello, world! 12345 naïve café 你好 🙂\n    def f(x):\n        return x * 2"


@dataclass(frozen=True)
class DraftSource:
    """Which draft a config drafts with and in what form, decided before anything loads:
    its directory, whether it is a draft head, its dtype (a draft model's; a head runs in the
    target's), whether its weights become Q8_0 blocks, and whether it is the shipped one."""

    path: Path
    head: bool
    dtype: torch.dtype
    quantize: bool
    shipped: bool


def resolve_draft(
    spec: SpeculativeConfig,
    target: LlamaForCausalLM,
    target_tokenizer: Tokenizer,
    dtype: torch.dtype,
    device: torch.device,
    packed: bool = True,
) -> DraftSource | None:
    """The draft of an ``eagle``, ``draft_model`` or ``hybrid`` config (None for other
    methods), or a ``ConfigError`` naming why it cannot be: a draft head (``eagle``; the
    hybrid's too when ``model`` is a head directory) or a draft model. Without a ``model`` the
    shipped one, which exists for the default target only (recognised by its shape and
    vocabulary, not its path): the head for ``eagle``, the draft model for the others."""
    if spec.method not in DRAFT_METHODS:
        return None
    shipped = spec.model is None
    if shipped:
        if not drafts_for(target.config, target_tokenizer):
            what = "a draft head" if spec.method == "eagle" else "a draft"
            raise ConfigError(
                f"speculative_config method {spec.method!r} needs 'model' (a draft path): "
                f"{what} ships only for SmolLM2-135M-Instruct, and this target's shape or "
                "vocabulary differs from it"
            )
        path = default_head_path() if spec.method == "eagle" else default_draft_path()
    else:
        path = resolve_model_path(spec.model)
    if is_head_dir(path):
        if spec.method == "draft_model":
            raise ConfigError(
                f"{path} is a draft head, not a draft model: use speculative_config method "
                "'eagle' (or 'hybrid')"
            )
        if target.tp is not None:
            raise ConfigError(
                "a draft head reads the target's token embedding, which tensor parallelism "
                "splits across ranks: use tensor_parallel_size=1 with a head, or a draft model"
            )
        if spec.draft_dtype != "auto":
            raise ConfigError(
                f"{path} is a draft head, which runs in the target's dtype: draft_dtype is for "
                "draft models"
            )
        return DraftSource(path, True, dtype, False, shipped)
    if spec.method == "eagle":
        raise ConfigError(
            f"speculative_config method 'eagle' needs a draft head directory ('specbatch "
            f"train-head' makes one); {path} is not one"
        )
    quantize = quantized_draft(spec.draft_dtype, target)
    if quantize and device.type != "cpu":
        raise ConfigError(f"draft_dtype 'q8_0' runs on the CPU only, not on {device}")
    draft_type = torch.float32 if quantize else draft_dtype(spec.draft_dtype, dtype, device, packed)
    return DraftSource(path, False, draft_type, quantize, shipped)


def load_draft_model(
    spec: SpeculativeConfig,
    target: LlamaForCausalLM,
    target_tokenizer: Tokenizer,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str | None = None,
    packed: bool = True,
) -> LlamaForCausalLM | EagleHead | None:
    """The draft :func:`resolve_draft` decides on, loaded (a draft model on the target's
    attention backend, checked against the target's vocabulary and tokenizer)."""
    source = resolve_draft(spec, target, target_tokenizer, dtype, device, packed)
    if source is None:
        return None
    if source.head:
        return load_head(source.path, target, source.dtype, device)
    draft = load_model(source.path, source.dtype, device, attention_backend)
    check_draft_compatible(source.path, draft, target, target_tokenizer)
    if source.quantize:
        draft.quantize_for_cpu()
        if source.shipped:
            check_shipped_q8_0(draft)
    return draft


def quantized_draft(requested: str, target: LlamaForCausalLM) -> bool:
    """Whether a draft model's weights become Q8_0 blocks: asked for (``"q8_0"``), or
    ``"auto"`` under a target whose layers multiply GGUF blocks, whose step is a few
    milliseconds: a float32 draft forward would cost half of one."""
    if requested == "q8_0":
        return True
    return requested == "auto" and target.device.type == "cpu" and target.multiplies_blocks()


def draft_dtype(
    requested: str, target_dtype: torch.dtype, device: torch.device, packed: bool
) -> torch.dtype:
    """A draft model's dtype: ``requested`` unless ``"auto"``, which is bfloat16 for a float32
    target on a CPU with native bfloat16 arithmetic whose weights are packed for oneDNN, else
    the target's. A draft forward multiplies a few rows by every weight, so it costs about the
    bytes it streams; bfloat16 halves them (measured: ``docs/notes.md``, session 38). Without
    native bfloat16 instructions oneDNN converts and the saving is not sure, so the target's
    dtype stays."""
    if requested == "q8_0":  # blocks multiplied with float32 activations
        return torch.float32
    if requested != "auto":
        return parse_dtype(requested)
    if (
        device.type == "cpu"
        and target_dtype == torch.float32
        and packed
        and native_cpu_bfloat16()
        and cpu_packing_supported(torch.bfloat16)
    ):
        return torch.bfloat16
    return target_dtype


def native_cpu_bfloat16() -> bool:
    """True on a CPU with bfloat16 dot products (AVX512-BF16) or AMX tiles."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def check_draft_compatible(
    path: Path, draft: LlamaForCausalLM, target: LlamaForCausalLM, target_tokenizer: Tokenizer
) -> None:
    """Refuse a draft whose vocabulary or tokenizer differs from the target's."""
    if draft.config.output_vocab_size != target.config.vocab_size:
        raise ConfigError(
            f"draft model {path} has a vocabulary of {draft.config.output_vocab_size} tokens, "
            f"the target {target.config.vocab_size}: a draft must share the target's tokenizer"
        )
    try:
        draft_tokenizer = load_tokenizer(path)
    except ModelLoadError:
        return  # a bare checkpoint: the vocabulary size is all there is to compare
    if (
        draft_tokenizer.encode(_PROBE, add_special_tokens=False)
        != target_tokenizer.encode(_PROBE, add_special_tokens=False)
        or draft_tokenizer.eos_token_ids != target_tokenizer.eos_token_ids
    ):
        raise ConfigError(
            f"draft model {path} tokenizes text differently from the target (same vocabulary "
            "size, different tokenizer): its drafts would be meaningless"
        )


def build_speculator(
    spec: SpeculativeConfig | None,
    draft: LlamaForCausalLM | EagleHead | None,
    num_blocks: int,
    block_size: int,
    generator: torch.Generator,
    external: Proposer | None = None,
    draft_graphs: Callable[[], CudaGraphRunner | None] | None = None,
    cuda_graphs: bool = False,
) -> Speculator:
    """The engine's speculator: the proposer of ``spec`` (none when it is None: the plain
    sampler) and, with ``adaptive_k``, the goodput controller. Under CUDA graphs every decode
    step with drafts is padded to k drafts, so the controller's per-row costs are measured on
    padded steps: it still chooses between drafting and not, per sequence (unmeasured on a GPU
    so far; ``adaptive_k=False`` or ``enforce_eager=True`` are the alternatives)."""
    if spec is None:
        if external is not None:
            raise ConfigError("a proposer needs speculative_config={'method': 'external', ...}")
        return Speculator(None, None, generator)
    proposer = build_proposer(
        spec, draft, num_blocks, block_size, generator, external, draft_graphs, cuda_graphs
    )
    ways = ways_of(proposer)
    controller = None
    if spec.adaptive_k or len(ways) > 1:  # with a fixed k it only chooses the way
        controller = GoodputController(ways, spec.tuning)
    return Speculator(proposer, controller, generator, spec.adaptive_k, spec.draft_tree_depth)


def build_proposer(
    spec: SpeculativeConfig,
    draft: LlamaForCausalLM | EagleHead | None,
    num_blocks: int,
    block_size: int,
    generator: torch.Generator,
    external: Proposer | None = None,
    draft_graphs: Callable[[], CudaGraphRunner | None] | None = None,
    cuda_graphs: bool = False,
) -> Proposer:
    if (spec.method == "external") != (external is not None):
        raise ConfigError(
            "pass a proposer to LLMEngine exactly when speculative_config method is 'external'"
        )
    if external is not None:
        return external
    assert spec.prompt_lookup_min is not None  # set by SpeculativeConfig.__post_init__
    # the hybrid weighs short matches against the draft model: its lookup goes down to 1 token
    shortest = 1 if spec.method == "hybrid" else spec.prompt_lookup_min
    store = SuffixStore.tuned(spec.store_tokens, spec.tuning) if spec.store_tokens else None
    lookup = NgramProposer(
        spec.prompt_lookup_min,
        spec.prompt_lookup_max,
        shortest,
        trees=spec.lookup_tree,
        width=spec.tuning.tree_width,
        store=store,
    )
    if spec.method in ("ngram", "suffix"):
        return lookup
    assert draft is not None
    network: DraftNetwork
    if isinstance(draft, EagleHead):
        network = HeadNetwork(draft)
    else:
        network = DraftModelNetwork(draft, capture_graphs=draft_graphs)
    # trees beside the chain: EAGLE-2's dynamic trees by default for a head, siblings else
    kind = spec.draft_tree_kind or ("dynamic" if isinstance(draft, EagleHead) else "siblings")
    drafter = NetworkProposer(
        network,
        num_blocks,
        block_size,
        generator,
        confidence_threshold=spec.confidence_threshold,
        siblings=spec.draft_siblings(cuda_graphs),
        dynamic_trees=kind == "dynamic",
        tree_width=spec.tuning.tree_width,
    )
    if spec.method == "hybrid":
        return HybridProposer(lookup, drafter)
    return drafter
