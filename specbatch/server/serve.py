"""``specbatch serve``: the OpenAI-compatible server on uvicorn (uvloop when installed)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import socket
from pathlib import Path
from typing import Any

import uvicorn

from specbatch.config import EngineConfig
from specbatch.engine.async_engine import AsyncEngine, ServedEngine
from specbatch.engine.data_parallel import DataParallelEngine
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import ChatTemplateError
from specbatch.models.default_model import served_model_name
from specbatch.server.app import ServerSettings, build_app
from specbatch.server.responses import DEFAULT_STORE

logger = logging.getLogger("specbatch")


class DrainingServer(uvicorn.Server):
    """uvicorn that drains the engine as soon as it starts shutting down (SIGTERM, SIGINT).

    uvicorn stops accepting connections, then waits for running handlers. Meanwhile the engine
    lets in-flight requests finish for ``drain_seconds`` and ends the rest, so every handler
    answers (a finished response, a 503 error object, or an error event and ``[DONE]`` on a
    stream) before uvicorn's own grace period (``drain_seconds`` + 5 s) would cancel it.
    """

    def __init__(self, config: uvicorn.Config, engine: ServedEngine, drain_seconds: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_seconds = drain_seconds

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.ensure_future(self.engine.drain(self.drain_seconds))
        try:
            await super().shutdown(sockets)
        finally:
            await drain


def server_for(
    engine: ServedEngine, settings: ServerSettings, **uvicorn_options: Any
) -> DrainingServer:
    """A ready-to-run server for ``engine`` (``uvicorn_options``: host, port, log level...)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(
        build_app(engine, settings),
        loop=loop,
        timeout_graceful_shutdown=int(settings.shutdown_timeout) + 5,
        **uvicorn_options,
    )
    return DrainingServer(config, engine, settings.shutdown_timeout)


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """Start the engine of ``config`` and serve it until interrupted."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    served: ServedEngine
    if args.data_parallel_size != 1:  # replicas in their own processes behind this one
        replicas = DataParallelEngine(config, args.data_parallel_size)
        tokenizer, model_path, served = replicas.tokenizer, Path(replicas.info.model_path), replicas
    else:
        engine = LLMEngine(config)
        tokenizer, model_path, served = (
            engine.tokenizer,
            engine.model_path,
            AsyncEngine(engine=engine),
        )
    try:
        tokenizer.compiled_chat_template()
    except ChatTemplateError as exc:
        logger.warning("%s: chat requests will get HTTP 500 (completions work)", exc)
    name = args.served_model_name or served_model_name(args.model, model_path)
    settings = ServerSettings(
        served_model_name=name,
        api_key=args.api_key,
        max_queued=args.max_queued,
        shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes,
        open_metrics=args.open_metrics,
        allow_priority=args.allow_priority,
        max_stored_responses=(
            DEFAULT_STORE if args.max_stored_responses is None else args.max_stored_responses
        ),
    )
    server = server_for(
        served,
        settings,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
    )
    server.run()
    return 0
