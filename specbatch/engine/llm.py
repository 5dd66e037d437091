"""``LLM``: the offline batch API (vLLM-compatible where vLLM has the concept)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from specbatch.config import EngineConfig
from specbatch.engine.llm_engine import LLMEngine
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import OutputKind, SamplingParams
from specbatch.tokenizer import Tokenizer

# A prompt: text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts.
PromptType = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


class LLM:
    """Generate completions for many prompts at once with continuous batching.

    >>> llm = LLM()  # the default SmolLM2-135M-Instruct
    >>> outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8))

    Keyword arguments are the fields of :class:`~specbatch.config.EngineConfig` (``dtype``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``seed``,
    ``speculative_config``, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """End a tensor-parallel engine's worker processes now (garbage collection does it
        too); a one-process engine holds nothing to end."""
        self.llm_engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        ``prompts`` is one prompt or a list: strings, token-id lists, or dicts with ``prompt`` or
        ``prompt_token_ids``. ``sampling_params`` is one for all, or one per prompt.
        """
        batch = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(batch))
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"priority has {len(priority)} entries for {len(batch)} prompts")
        return self._run(batch, params, priority or [0] * len(batch), use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations: list[Sequence[Message]]
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text, ids = tokenizer.encode_chat(
                [dict(m) for m in conversation],
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        params = _params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, [0] * len(prompts), use_tqdm)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priority: Sequence[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [f"llm-{next(self._request_ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, prio in zip(ids, prompts, params, priority, strict=True):
                text, token_ids = _split_prompt(prompt)
                engine.add_request(
                    request_id,
                    text,
                    p.clone(output_kind=OutputKind.FINAL_ONLY),
                    prompt_token_ids=token_ids,
                    priority=prio,
                )
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        return [results[request_id] for request_id in ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]  # a single token-id list
    return cast(list[PromptType], items)


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"]), None
        raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
    return None, list(prompt)


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params
