"""``specbatch serve``: the OpenAI-compatible server on uvicorn (uvloop when installed)."""

from __future__ import annotations

import argparse
import importlib.util

from specbatch.config import EngineConfig
from specbatch.engine.async_engine import AsyncEngine
from specbatch.engine.llm_engine import LLMEngine
from specbatch.models.default_model import DEFAULT_MODEL


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """Start the engine of ``config`` and serve it until interrupted."""
    import uvicorn

    from specbatch.server.app import ServerSettings, build_app

    engine = LLMEngine(config)
    name = args.served_model_name or (
        DEFAULT_MODEL if args.model is None else engine.model_path.name
    )
    app = build_app(
        AsyncEngine(engine=engine),
        ServerSettings(
            served_model_name=name,
            api_key=args.api_key,
            max_queued=args.max_queued,
            shutdown_timeout=args.shutdown_timeout,
        ),
    )
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop=loop,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
    )
    return 0
