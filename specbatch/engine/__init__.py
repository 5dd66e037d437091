"""The engine: ``LLMEngine`` (add requests, step, abort), the offline ``LLM`` and the asyncio
``AsyncEngine`` over it; request intake and state, model loading and cache sizing, stats."""

from specbatch.engine.llm import LLM
from specbatch.engine.llm_engine import LLMEngine
from specbatch.engine.stats import EngineStats

__all__ = ["LLM", "EngineStats", "LLMEngine"]
