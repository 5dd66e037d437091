"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine` (FastAPI).

Every client mistake is a 4xx with an OpenAI error object naming the field; only a fault of the
server itself (a failing step, a broken chat template) is a 5xx, and it ends only the requests it
touched. Prompts are rendered and tokenized off the event loop, so one huge body does not stall
the others.
"""

from __future__ import annotations

import asyncio
import itertools
import json
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
from specbatch.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    in_client_terms,
)
from specbatch.server.responses import (
    DEFAULT_STORE,
    OutputBuilder,
    ResponsesRequest,
    ResponseStore,
    as_input,
    response_body,
    response_usage,
)
from specbatch.server.tools import CallReader, template_knows_tools


@dataclass(frozen=True)
class ServerSettings:
    """How the server behaves (see ``specbatch serve --help``).

    ``max_queued``: waiting requests beyond which new ones get 429 (and the most sequences,
    prompts times ``n``, one request may ask for: more gets 400). ``max_body_bytes``: larger
    bodies get 413. ``open_metrics``: ``/metrics`` answers without the API key (it is protected,
    like everything but ``/health``, when a key is set). ``allow_priority``: clients may set a
    request's scheduling ``priority`` (otherwise only 0 is accepted). ``max_stored_responses``:
    ``/v1/responses`` kept for ``previous_response_id`` (0: none).
    """

    served_model_name: str
    api_key: str | None = None
    max_queued: int = 256
    shutdown_timeout: float = 10.0
    disconnect_poll_s: float = 0.25
    max_body_bytes: int = 16 << 20
    open_metrics: bool = False
    allow_priority: bool = False
    max_stored_responses: int = DEFAULT_STORE

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key must not be empty (omit it to serve without a key)")
        if self.max_queued < 1:
            raise ConfigError(f"max_queued must be at least 1, got {self.max_queued}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_stored_responses < 0:
            raise ConfigError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
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
                body.renamed_fields(),
            )
        finals = await _finals(streams, request, settings, body.renamed_fields())
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
        params, ids = await _chat_prompt(engine, body, knows_tools, renames)
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
                renames,
            )
        finals = await _finals(streams, request, settings, renames)
        return JSONResponse(
            chat_response(rid, created, name, finals[0], top, tokenizer, call_format)
        )

    store = ResponseStore(settings.max_stored_responses)
    app.state.responses = store

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        _check_common(body, settings)
        tokenizer = engine.tokenizer
        knows_tools = template_knows_tools(tokenizer.chat_template)
        with _request_errors({"messages": "input"}):
            history = store.history(body.previous_response_id)
            chat = body.chat(history)
            renames = body.field_names(chat)
        with _request_errors(renames):
            call_format = chat.call_format()
        params, ids = await _chat_prompt(engine, chat, knows_tools, renames)
        streams = await _add_all(
            engine, settings, metrics, "resp", [ids], params, body.priority, renames
        )
        rid = streams[0].request_id.rsplit("-", 1)[0].replace("resp-", "resp_", 1)
        created, name = int(time.time()), settings.served_model_name
        conversation = [*history, *body.items()]

        def finished(builder: OutputBuilder, final: RequestOutput, tokens: int) -> dict[str, Any]:
            incomplete = final.outputs[0].finish_reason == "length"
            status = "incomplete" if incomplete else "completed"
            spent = response_usage(len(final.prompt_token_ids), tokens, cached_tokens([final]))
            out = response_body(rid, created, name, body, builder.items, status, spent)
            if body.store:
                store.put(out, [*conversation, *as_input(builder.items)])
            return out

        if body.stream:
            return _responses_stream(
                streams[0], body, rid, created, name, call_format, renames, finished
            )
        final = (await _finals(streams, request, settings, renames))[0]
        builder = OutputBuilder(call_format)
        builder.feed(final.outputs[0].text)
        builder.finish(final.outputs[0].finish_reason == "length")
        return JSONResponse(finished(builder, final, len(final.outputs[0].token_ids)))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> dict[str, Any]:
        found = store.get(response_id)
        if found is None:
            raise APIError(
                404, f"no stored response has id {response_id[:80]!r}", code="response_not_found"
            )
        return found

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise APIError(
                404, f"no stored response has id {response_id[:80]!r}", code="response_not_found"
            )
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(body.model, settings)
        intake, tokenizer = engine.intake, engine.tokenizer
        special = body.with_special_tokens()
        with _request_errors({}):
            chat = body.chat()
            if chat is None:
                assert body.prompt is not None
                ids = await asyncio.to_thread(intake.tokenize, body.prompt, "prompt", special)
            else:
                knows_tools = template_knows_tools(tokenizer.chat_template)
                add_generation_prompt, options = chat.template_options(knows_tools)
                conversation = chat.conversation(knows_tools)

                def render() -> list[int]:
                    text_length = sum(len(str(m.get("content") or "")) for m in conversation)
                    intake.check_length(text_length, "messages")
                    text = tokenizer.apply_chat_template(
                        conversation, add_generation_prompt, **options
                    )
                    return intake.tokenize(text, "messages", special)

                ids = await asyncio.to_thread(render)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": intake.max_model_len}
        out["tokens"] = ids
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.decode([token]) for token in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _check_model(body.model, settings)
        with _request_errors({}):
            text = await asyncio.to_thread(engine.intake.detokenize, body.tokens)
        return {"prompt": text}

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


def _check_model(model: str | None, settings: ServerSettings) -> None:
    """A request naming a model must name the one served (404 otherwise, as OpenAI's)."""
    if model is not None and model != settings.served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"`{settings.served_model_name}`",
            "model",
            "model_not_found",
        )


async def _chat_prompt(
    engine: ServedEngine,
    chat: ChatCompletionRequest,
    knows_tools: bool,
    renames: dict[str, str],
) -> tuple[SamplingParams, list[int]]:
    """A chat request's sampling params and prompt ids (rendered off the event loop); its
    faults are 400s naming the field as the client spelled it (``renames``)."""
    with _request_errors(renames):
        add_generation_prompt, options = chat.template_options(knows_tools)
        params = chat.chat_params()
        ids = await engine.encode_chat(
            chat.conversation(knows_tools), add_generation_prompt, options
        )
    return params, ids


def _check_common(
    body: CompletionRequest | ChatCompletionRequest | ResponsesRequest, settings: ServerSettings
) -> None:
    _check_model(body.model, settings)
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


def _failure(exc: RequestFailedError, renames: dict[str, str]) -> APIError:
    """A request that failed while generating: a 400 naming the field (as the client spelled
    it) where its own constraint failed, else the server's 500."""
    if exc.param is None:
        return APIError(500, str(exc), code="engine_step_failed")
    message, param = in_client_terms(InvalidRequestError(str(exc), exc.param), renames)
    return APIError(400, message, param, "constraint_failed")


async def _finals(
    streams: list[RequestStream],
    request: Request,
    settings: ServerSettings,
    renames: dict[str, str],
) -> list[RequestOutput]:
    """The final outputs; a client that disconnects meanwhile aborts its requests (a
    request's own failed field is named as the client spelled it: ``renames``)."""

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
        raise _failure(exc, renames) from None
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
    renames: dict[str, str],
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
            failure = _failure(exc, renames)
            yield sse(error_body(failure.status, failure.message, failure.param, failure.code))
        finally:
            for stream in streams:
                stream.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _responses_stream(
    stream: RequestStream,
    body: ResponsesRequest,
    rid: str,
    created: int,
    model: str,
    call_format: str | None,
    renames: dict[str, str],
    finished: Callable[[OutputBuilder, RequestOutput, int], dict[str, Any]],
) -> StreamingResponse:
    """A response's typed events (``response.created`` ... ``response.completed``, or an
    ``error`` event and ``response.failed``), each with its ``sequence_number``."""

    async def events() -> AsyncIterator[str]:
        sequence = iter(itertools.count())

        def event(payload: dict[str, Any]) -> str:
            payload["sequence_number"] = next(sequence)
            text = json.dumps(payload, ensure_ascii="message" in payload)
            return f"event: {payload['type']}\ndata: {text}\n\n"

        start = response_body(rid, created, model, body, [], "in_progress", None)
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        builder, tokens = OutputBuilder(call_format), 0
        try:
            async for output in stream:
                completion = output.outputs[0]
                tokens += len(completion.token_ids)
                for payload in builder.feed(completion.text):
                    yield event(payload)
                if output.finished:
                    incomplete = completion.finish_reason == "length"
                    for payload in builder.finish(incomplete):
                        yield event(payload)
                    whole = finished(builder, output, tokens)
                    kind = "response.incomplete" if incomplete else "response.completed"
                    yield event({"type": kind, "response": whole})
        except (EngineDeadError, RequestFailedError) as exc:
            if isinstance(exc, EngineDeadError):
                failure = APIError(503, str(exc), code="unavailable")
            else:
                failure = _failure(exc, renames)
            yield event(
                {
                    "type": "error",
                    "code": failure.code,
                    "message": failure.message,
                    "param": failure.param,
                }
            )
            failed = response_body(rid, created, model, body, builder.items, "failed", None)
            failed["error"] = {"code": failure.code or "server_error", "message": failure.message}
            yield event({"type": "response.failed", "response": failed})
        finally:
            stream.close()

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
