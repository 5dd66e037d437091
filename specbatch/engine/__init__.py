"""The engine: sequences, the model runner, ``LLMEngine``, ``LLM`` and ``AsyncEngine``."""

from specbatch.engine.llm import LLM
from specbatch.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["LLM", "EngineStats", "LLMEngine"]
