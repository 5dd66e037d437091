"""The OpenAI-compatible HTTP server over :class:`~specbatch.engine.AsyncEngine` (FastAPI)."""
