"""specbatch: continuous batching over a paged KV cache, with lossless speculative decoding.

>>> from specbatch import LLM, SamplingParams
>>> llm = LLM()  # SmolLM2-135M-Instruct, fetched once into the user cache
>>> llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text
"""

from specbatch.config import EngineConfig
from specbatch.engine import LLM, LLMEngine
from specbatch.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specbatch.sampling_params import OutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "OutputKind",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
