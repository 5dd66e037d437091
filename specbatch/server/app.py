"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine` (FastAPI).

Every client mistake is a 4xx with an OpenAI error object naming the field; only a fault of the
server itself (a failing step, a broken chat template) is a 5xx, and it ends only the requests it
touched. Prompts are rendered and tokenized off the event loop, so one huge body does not stall
the others.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specbatch.engine.async_engine import (
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    ServedEngine,
)
from specbatch.errors import ChatTemplateError, ConfigError, InvalidRequestError
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams
from specbatch.server.errors import APIError, error_body, install_handlers
from specbatch.server.formatting import (
    cached_tokens,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    sse,
    usage,
)
from specbatch.server.guard import OPEN_PATHS, RequestGuard
from specbatch.server.metrics import ServerMetrics
from specbatch.server.protocol import ChatCompletionRequest, CompletionRequest, in_client_terms
from specbatch.server.tools import CallReader, template_knows_tools


@dataclass(frozen=True)
class ServerSettings:
    """How the server behaves (see ``specbatch serve --help``).

    ``max_queued``: waiting requests beyond which new ones get 429 (and the most sequences,
    prompts times ``n``, one request may ask for: more gets 400). ``max_body_bytes``: larger
    bodies get 413. ``open_metrics``: ``/metrics`` answers without the API key (it is protected,
    like everything but ``/health``, when a key is set). ``allow_priority``: clients may set a
    request's scheduling ``priority`` (otherwise only 0 is accepted).
    """

    served_model_name: str
    api_key: str | None = None
    max_queued: int = 256
    shutdown_timeout: float = 10.0
    disconnect_poll_s: float = 0.25
    max_body_bytes: int = 16 << 20
    open_metrics: bool = False
    allow_priority: bool = False

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key must not be empty (omit it to serve without a key)")
        if self.max_queued < 1:
            raise ConfigError(f"max_queued must be at least 1, got {self.max_queued}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ConfigError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")


def build_app(engine: ServedEngine, settings: ServerSettings) -> RequestGuard:
    """The ASGI application serving ``engine``: FastAPI behind the key and body-size guard."""
    metrics = ServerMetrics(engine, settings.served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(settings.shutdown_timeout)

    app = FastAPI(title="specbatch", lifespan=lifespan)
    install_handlers(app)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return JSONResponse({"status": "error"}, status_code=503)
        if not engine.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "specbatch",
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_common(body, settings)
        with _request_errors({}):
            prompts, params = body.engine_inputs()
        streams = await _add_all(
            engine, settings, metrics, "cmpl", prompts, params, body.priority, {}
        )
        created, name = int(time.time()), settings.served_model_name
        rid = streams[0].request_id.rsplit("-", 1)[0]
        if body.stream:
            return _sse_response(
                streams,
                lambda i, out: [
                    completion_chunk(
                        rid,
                        created,
                        name,
                        i * params.n + c.index,
                        c,
                        body.logprobs or 0,
                        engine.tokenizer,
                    )
                    for c in out.outputs
                ],
                body.include_usage_in_stream(),
                rid,
                created,
                name,
                "text_completion",
            )
        finals = await _finals(streams, request, settings)
        return JSONResponse(
            completion_response(
                rid, created, name, finals, params.n, body.logprobs or 0, engine.tokenizer
            )
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_common(body, settings)
        tokenizer = engine.tokenizer
        knows_tools = template_knows_tools(tokenizer.chat_template)
        top = body.top_logprobs_per_token()
        with _request_errors({}):
            renames = body.field_names()  # as the client spelled them
            call_format = body.call_format()
        with _request_errors(renames):
            add_generation_prompt, options = body.template_options(knows_tools)
            params = body.chat_params()
            ids = await engine.encode_chat(
                body.conversation(knows_tools), add_generation_prompt, options
            )
        streams = await _add_all(
            engine, settings, metrics, "chatcmpl", [ids], params, body.priority, renames
        )
        created, name = int(time.time()), settings.served_model_name
        rid = streams[0].request_id.rsplit("-", 1)[0]
        if body.stream:
            started: set[int] = set()
            readers: dict[int, CallReader] | None = {} if call_format else None
            return _sse_response(
                streams,
                lambda _, out: [
                    chat_chunk(rid, created, name, c, started, top, tokenizer, readers, call_format)
                    for c in out.outputs
                ],
                body.include_usage_in_stream(),
                rid,
                created,
                name,
                "chat.completion.chunk",
            )
        finals = await _finals(streams, request, settings)
        return JSONResponse(
            chat_response(rid, created, name, finals[0], top, tokenizer, call_format)
        )

    open_paths = OPEN_PATHS | ({"/metrics"} if settings.open_metrics else set())
    return RequestGuard(
        app,
        settings.api_key,
        settings.max_body_bytes,
        open_paths,
        on_reject=lambda status: metrics.rejected.labels(
            settings.served_model_name, str(status)
        ).inc(),
    )


def _check_common(
    body: CompletionRequest | ChatCompletionRequest, settings: ServerSettings
) -> None:
    if body.model is not None and body.model != settings.served_model_name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist; this server serves "
            f"`{settings.served_model_name}`",
            "model",
            "model_not_found",
        )
    if body.priority and not settings.allow_priority:
        raise APIError(
            400, "priority is not enabled on this server (serve --allow-priority)", "priority"
        )


@contextmanager
def _request_errors(renames: dict[str, str]) -> Iterator[None]:
    """Turn the request's own faults into 400s naming the field (``renames``: the engine's name
    of a field -> the name the client used), and a broken chat template into a 500."""
    try:
        yield
    except InvalidRequestError as exc:
        message, param = in_client_terms(exc, renames)
        raise APIError(400, message, param) from None
    except ChatTemplateError as exc:
        raise APIError(500, str(exc), code="chat_template_error") from None
    except ValueError as exc:  # a library check without a field
        raise APIError(400, str(exc)) from None


async def _add_all(
    engine: ServedEngine,
    settings: ServerSettings,
    metrics: ServerMetrics,
    prefix: str,
    prompts: list[Any],
    params: SamplingParams,
    priority: int,
    renames: dict[str, str],
) -> list[RequestStream]:
    sequences = len(prompts) * params.n
    if sequences > settings.max_queued:
        raise APIError(
            400,
            f"the request asks for {sequences} sequences (prompts x n); this server takes at "
            f"most {settings.max_queued} per request",
            "prompt" if len(prompts) > 1 else "n",
        )
    if engine.num_waiting() + len(prompts) > settings.max_queued:
        metrics.rejected.labels(settings.served_model_name, "429").inc()
        raise APIError(
            429,
            f"too many queued requests (limit {settings.max_queued}); retry later",
            code="queue_full",
        )
    base = f"{prefix}-{uuid.uuid4().hex}"
    streams: list[RequestStream] = []
    try:
        with _request_errors(renames):
            for i, prompt in enumerate(prompts):
                streams.append(
                    await engine.add_request(prompt, params, f"{base}-{i}", priority=priority)
                )
    except APIError as exc:
        for stream in streams:
            stream.close()
        metrics.rejected.labels(settings.served_model_name, str(exc.status)).inc()
        raise
    except EngineDeadError as exc:
        for stream in streams:
            stream.close()
        raise APIError(503, str(exc), code="unavailable") from None
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def _finals(
    streams: list[RequestStream], request: Request, settings: ServerSettings
) -> list[RequestOutput]:
    """The final outputs; a client that disconnects meanwhile aborts its requests."""

    async def collect(stream: RequestStream) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        assert final is not None
        return final

    task = asyncio.ensure_future(asyncio.gather(*(collect(s) for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=settings.disconnect_poll_s)
            if done:
                return list(task.result())
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="unavailable") from None
    except RequestFailedError as exc:
        raise APIError(500, str(exc), code="engine_step_failed") from None
    finally:
        task.cancel()
        for stream in streams:
            stream.close()


def _sse_response(
    streams: list[RequestStream],
    chunks: Callable[[int, RequestOutput], list[dict[str, Any]]],
    include_usage: bool,
    rid: str,
    created: int,
    model: str,
    object_name: str,
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        prompt_tokens = completion_tokens = cached = 0
        try:
            async for index, output in _merge(streams):
                for chunk in chunks(index, output):
                    yield sse(chunk)
                completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                if output.finished:
                    prompt_tokens += len(output.prompt_token_ids)
                    cached += cached_tokens([output])
            if include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": object_name,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(prompt_tokens, completion_tokens, cached),
                    }
                )
        except EngineDeadError as exc:
            yield sse(error_body(503, str(exc), None, "unavailable"))
        except RequestFailedError as exc:
            yield sse(error_body(500, str(exc), None, "engine_step_failed"))
        finally:
            for stream in streams:
                stream.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except BaseException as exc:  # surfaced to the consumer below
            await merged.put((index, exc))
            return
        await merged.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
