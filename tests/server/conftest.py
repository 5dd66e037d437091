"""A real server on 127.0.0.1 (uvicorn in a thread) for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specbatch.config import EngineConfig
from specbatch.engine.async_engine import AsyncEngine
from specbatch.engine.llm_engine import LLMEngine
from specbatch.server.app import ServerSettings
from specbatch.server.serve import server_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RunningServer:
    """uvicorn serving an app on a free loopback port, in a background thread."""

    def __init__(self, engine: LLMEngine, **settings: Any) -> None:
        self.engine = engine
        self.async_engine = AsyncEngine(engine=engine)
        settings.setdefault("served_model_name", "tiny")
        self.settings = ServerSettings(**settings)
        self.port = free_port()
        self.server = server_for(
            self.async_engine, self.settings, host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def tiny_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    config: dict[str, Any] = {
        "model": str(model_dir),
        "num_kv_blocks": 256,
        "block_size": 8,
        "max_model_len": 256,
        "max_num_seqs": 32,
    }
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    running = RunningServer(tiny_engine(tiny_model_dir))
    yield running
    running.stop()
