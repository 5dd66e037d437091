"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine` (FastAPI)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specbatch.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams
from specbatch.server.errors import APIError, install_handlers, param_of
from specbatch.server.formatting import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    sse,
    usage,
)
from specbatch.server.metrics import ServerMetrics
from specbatch.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class ServerSettings:
    """How the server behaves (see ``specbatch serve --help``)."""

    served_model_name: str
    api_key: str | None = None
    max_queued: int = 256
    shutdown_timeout: float = 10.0
    disconnect_poll_s: float = 0.25


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI application serving ``engine``."""
    metrics = ServerMetrics(engine, settings.served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(settings.shutdown_timeout)

    app = FastAPI(title="specbatch", lifespan=lifespan)
    install_handlers(app)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings

    async def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {settings.api_key}":
            metrics.rejected.labels(settings.served_model_name, "401").inc()
            raise APIError(
                401,
                "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                code="invalid_api_key",
            )

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return JSONResponse({"status": "error"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
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

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model, settings)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n (or be omitted)", "best_of")
        params = _params(lambda: body.sampling_params(body.max_tokens, body.logprobs, 16))
        prompts = body.prompts()
        streams = await _add_all(engine, settings, metrics, "cmpl", prompts, params, body.priority)
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

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model, settings)
        tokenizer = engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                body.conversation(),
                add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {}),
            )
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        params = _params(
            lambda: body.sampling_params(body.max_completion_tokens or body.max_tokens, top, None)
        )
        streams = await _add_all(
            engine, settings, metrics, "chatcmpl", [ids], params, body.priority
        )
        created, name = int(time.time()), settings.served_model_name
        rid = streams[0].request_id.rsplit("-", 1)[0]
        if body.stream:
            started: set[int] = set()
            return _sse_response(
                streams,
                lambda _, out: [
                    chat_chunk(rid, created, name, c, started, top, tokenizer) for c in out.outputs
                ],
                body.include_usage_in_stream(),
                rid,
                created,
                name,
                "chat.completion.chunk",
            )
        finals = await _finals(streams, request, settings)
        return JSONResponse(chat_response(rid, created, name, finals[0], top, tokenizer))

    return app


def _check_model(model: str | None, settings: ServerSettings) -> None:
    if model is not None and model != settings.served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"`{settings.served_model_name}`",
            "model",
            "model_not_found",
        )


def _params(build: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return build()
    except ValueError as exc:
        raise APIError(400, str(exc), param_of(str(exc))) from None


async def _add_all(
    engine: AsyncEngine,
    settings: ServerSettings,
    metrics: ServerMetrics,
    prefix: str,
    prompts: list[Any],
    params: SamplingParams,
    priority: int,
) -> list[RequestStream]:
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
        for i, prompt in enumerate(prompts):
            streams.append(
                await engine.add_request(prompt, params, f"{base}-{i}", priority=priority)
            )
    except ValueError as exc:
        for stream in streams:
            stream.close()
        metrics.rejected.labels(settings.served_model_name, "400").inc()
        raise APIError(
            400, str(exc), "prompt" if "prompt" in str(exc) else param_of(str(exc))
        ) from None
    except EngineDeadError as exc:
        for stream in streams:
            stream.close()
        raise APIError(503, str(exc)) from None
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
        raise APIError(503, str(exc)) from None
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
        prompt_tokens = completion_tokens = 0
        try:
            async for index, output in _merge(streams):
                for chunk in chunks(index, output):
                    yield sse(chunk)
                completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                if output.finished:
                    prompt_tokens += len(output.prompt_token_ids)
            if include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": object_name,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(prompt_tokens, completion_tokens),
                    }
                )
        except EngineDeadError as exc:
            yield sse({"error": {"message": str(exc), "type": "server_error"}})
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
