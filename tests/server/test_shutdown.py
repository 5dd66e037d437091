"""``specbatch serve`` stopped by SIGTERM answers every client: streams end with an error event
and ``[DONE]``, non-streaming requests get a JSON 503, and the process exits without a
traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import free_port


def test_sigterm_answers_every_open_request(tiny_model_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specbatch.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--max-model-len",
            "256",
            "--num-kv-blocks",
            "64",
            "--shutdown-timeout",
            "0",  # nothing in flight may finish: every open request is ended by the drain
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        results: dict[str, Any] = {"events": []}
        long = {"prompt": "go", "max_tokens": 240, "ignore_eos": True, "temperature": 0}

        def stream() -> None:
            body = {**long, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        results["events"].append(line)

        def plain() -> None:
            results["plain"] = httpx.post(f"{url}/v1/completions", json=long, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for thread in threads:
            thread.start()
        while len(results["events"]) < 3 or running(url) < 2:  # both requests in the engine
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive()
        events = results["events"]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "unavailable")
        assert "shutting down" in error["message"]
        plain_response = results["plain"]
        assert plain_response.status_code == 503
        assert "shutting down" in plain_response.json()["error"]["message"]
        # uvicorn re-raises the signal once it has shut down: the conventional exit for SIGTERM
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Traceback" not in process.communicate()[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def running(url: str) -> int:
    """Sequences the server's engine is running, from ``/metrics``."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("specbatch_num_requests_running"):
            return int(float(line.split()[-1]))
    raise AssertionError("/metrics has no specbatch_num_requests_running")
