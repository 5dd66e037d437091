"""``AsyncEngine``: the engine behind asyncio, stepping in a worker thread.

The event loop never runs model code nor tokenizes: one worker thread owns the
:class:`LLMEngine` and loops "apply queued commands (add, abort), step, hand outputs back", and
prompts are tokenized in a thread pool before they are queued. Outputs reach each request's
``asyncio.Queue`` through ``call_soon_threadsafe``. A consumer that stops iterating (breaks out,
is cancelled, its HTTP client disconnects) aborts its request, which frees its blocks.

Nothing one request does can stop the loop: bad input is refused when it is added
(``InvalidRequestError``), and a step that raises fails only the requests in it (their streams
raise :class:`RequestFailedError`) while the engine goes on. :meth:`AsyncEngine.drain` refuses
new work, lets in-flight requests finish for a while, then ends the rest with
:class:`EngineDrainingError`, so that a server shutting down answers every client.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from specbatch.config import EngineConfig
from specbatch.engine.intake import RequestIntake
from specbatch.engine.llm_engine import LLMEngine
from specbatch.engine.stats import EngineStats
from specbatch.errors import InvalidRequestError, SpecbatchError
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import OutputKind, SamplingParams, StructuredOutputsParams
from specbatch.structured.grammar import COMPILE_SECONDS

logger = logging.getLogger("specbatch")


class EngineDeadError(SpecbatchError, RuntimeError):
    """The engine's loop stopped (shut down, or a fatal error); no request can be served."""


class EngineDrainingError(EngineDeadError):
    """The engine is shutting down: it takes no new request, and ended this one."""


class RequestFailedError(SpecbatchError, RuntimeError):
    """A step this request was in raised, or the request's own ``param`` failed while it
    generated (its constraint: the request's fault, not the server's); the engine logged why
    and serves the others."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    priority: int
    done: Future[None]
    # [True] while counted in AsyncEngine._adding: the engine thread uncounts it as it adds
    # it (from then on the scheduler's waiting queue counts it), else add_request does
    counted: list[bool]


@dataclass
class _Abort:
    request_id: str
    error: BaseException | None = None  # delivered to the stream instead of a final output


class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


async def prompt_ids(
    intake: RequestIntake, prompt: str | Sequence[int] | None, token_ids: Sequence[int] | None
) -> tuple[str | None, Sequence[int] | None]:
    """The prompt as (text, token ids): a list given as ``prompt`` is token ids, and text is
    tokenized in a worker thread (off the event loop)."""
    if prompt is not None and not isinstance(prompt, str):
        return None, prompt
    if token_ids is None and isinstance(prompt, str):
        token_ids = await asyncio.to_thread(intake.tokenize, prompt)
    return prompt, token_ids


class _StreamOwner(Protocol):
    """What a :class:`RequestStream` tells the engine it came from."""

    def _forget_stream(self, request_id: str) -> None: ...

    def _send(self, command: _Abort) -> None: ...


class RequestStream:
    """The outputs of one accepted request. Iterate it; ``close()`` aborts it if unfinished."""

    def __init__(self, owner: _StreamOwner, request_id: str, stream: _Stream) -> None:
        self.owner = owner
        self.request_id = request_id
        self._stream = stream
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            self.owner._forget_stream(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self.owner._forget_stream(self.request_id)
            if item.error is not None:
                raise RequestFailedError(item.error, item.error_param)
        return item

    def close(self) -> None:
        """Abort the request if it has not finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.owner._forget_stream(self.request_id)
            self.owner._send(_Abort(self.request_id))


class AsyncEngine:
    """Stream :class:`RequestOutput` objects for concurrent requests from asyncio code.

    >>> engine = AsyncEngine(EngineConfig())
    >>> async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
    ...     print(out.outputs[0].text)

    The worker thread starts on first use; :meth:`shutdown` stops it (aborting what is left).
    """

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine(config or EngineConfig())
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._draining = False
        self._stopped = False
        self._ids = itertools.count()
        self._adding = 0  # requests between add_request's start and the engine's answer
        self.on_finished: list[Callable[[RequestOutput], None]] = []

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def intake(self) -> RequestIntake:
        """The model's prompt checks and tokenizer (``/tokenize``, ``/detokenize``)."""
        return self.engine.intake

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def errored(self) -> bool:
        return self._error is not None

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken (not draining, stopped or dead)."""
        return not (self._draining or self._stopped or self._error is not None)

    def num_waiting(self) -> int:
        """Requests not yet running: those being added plus the scheduler's waiting queue."""
        with self._lock:
            return self.engine.stats.num_waiting + self._adding

    def stats_by_replica(self) -> list[tuple[str | None, EngineStats, int]]:
        """The engine's stats and waiting count (one row: no replica label)."""
        return [(None, self.engine.stats, self.num_waiting())]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specbatch-engine", daemon=True)
            self._thread.start()

    async def add_request(
        self,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request and return its :class:`RequestStream` once the engine accepted it.

        Bad input raises ``InvalidRequestError`` (a ``ValueError``) here. Text prompts are
        tokenized in a worker thread. Iterate the stream, or ``close()`` it to abort.
        """
        self._check_alive()
        self.start()
        counted = [True]
        with self._lock:
            self._adding += 1  # counted as waiting from now on (no await before this line)
        try:
            return await self._add(request_id, prompt, params, prompt_token_ids, priority, counted)
        finally:
            self._uncount(counted)

    def _uncount(self, counted: list[bool]) -> None:
        with self._lock:
            if counted[0]:
                counted[0] = False
                self._adding -= 1

    async def _add(
        self,
        request_id: str | None,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None,
        prompt_token_ids: Sequence[int] | None,
        priority: int,
        counted: list[bool],
    ) -> RequestStream:
        request_id = request_id or f"req-{next(self._ids)}"
        params = params or SamplingParams()
        prompt, prompt_token_ids = await prompt_ids(self.engine.intake, prompt, prompt_token_ids)
        if params.structured_outputs is not None:
            await self._compile(params.structured_outputs)
        stream = _Stream(asyncio.get_running_loop())
        done: Future[None] = Future()
        ids = list(prompt_token_ids) if prompt_token_ids is not None else None
        with self._lock:
            # Checked again under the lock that stopping takes: a request that was tokenizing
            # while a drain began is refused (answered), never queued behind the stop.
            self._check_alive()
            if request_id in self._streams:
                raise InvalidRequestError(
                    f"request_id {request_id!r} is already in use", "request_id"
                )
            self._streams[request_id] = stream
            self._commands.put(_Add(request_id, prompt, ids, params, priority, done, counted))
        self._wake.set()
        try:
            await asyncio.wrap_future(done)  # raises the engine's error for bad input
        except BaseException:
            self._forget_stream(request_id)
            refused = done.done() and not done.cancelled() and done.exception() is not None
            if not refused:
                self._send(_Abort(request_id))  # cancelled while being added
            raise
        return RequestStream(self, request_id, stream)

    async def _compile(self, constraint: StructuredOutputsParams) -> None:
        """Compile a constraint in a worker thread, within ``COMPILE_SECONDS``: the engine's
        thread then finds it cached, so neither it nor the event loop waits on a compile."""
        compiling = asyncio.to_thread(self.engine.intake.constraints.compile, constraint)
        try:
            await asyncio.wait_for(compiling, COMPILE_SECONDS)
        except TimeoutError:
            raise InvalidRequestError(
                f"structured_outputs did not compile within {COMPILE_SECONDS:g} s",
                f"structured_outputs.{constraint.kind}",
            ) from None

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        options: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of a conversation, rendered and tokenized in a worker thread (a huge
        conversation is refused from its length first). Raises ``InvalidRequestError`` for
        messages the template or the context cannot take, ``ChatTemplateError`` for a broken
        template."""

        def encode() -> list[int]:
            text_length = sum(len(str(m.get("content") or "")) for m in messages)
            self.engine.intake.check_length(text_length, "messages")
            _, ids = self.engine.tokenizer.encode_chat(
                messages, add_generation_prompt, **(options or {})
            )
            return ids

        return await asyncio.to_thread(encode)

    async def generate(
        self,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are produced (``params.output_kind`` decides
        whether each is cumulative or a delta), the last one with ``finished=True``. Leaving
        the loop early aborts the request."""
        stream = await self.add_request(
            prompt, params, request_id, prompt_token_ids=prompt_token_ids, priority=priority
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def generate_final(
        self,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> RequestOutput:
        """The request's final output only."""
        params = (params or SamplingParams()).clone(output_kind=OutputKind.FINAL_ONLY)
        final = None
        async for output in self.generate(prompt, params, request_id, **kwargs):
            final = output
        assert final is not None
        return final

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a final output whose finish reason is abort."""
        self._send(_Abort(request_id))

    async def drain(self, timeout: float) -> None:
        """Take no new request; let in-flight ones finish for up to ``timeout`` seconds; end
        the rest, whose streams raise :class:`EngineDrainingError`. Requests still being
        tokenized are refused with it when they try to enter. Idempotent."""
        with self._lock:
            self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._busy() and loop.time() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        with self._lock:
            pending = list(self._streams)
        for request_id in pending:
            self._send(_Abort(request_id, EngineDrainingError("the server is shutting down")))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Drain for up to ``timeout`` seconds, then stop the worker thread."""
        await self.drain(timeout)
        with self._lock:  # after this no _Add can be queued (see _add)
            self._stopped = True
            self._commands.put(None)
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # ------------------------------------------------------------------ worker

    def _busy(self) -> bool:
        with self._lock:
            return bool(self._streams) or self._adding > 0

    def _forget_stream(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine failed and serves no requests: {self._error!r}")
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        if self._draining:
            raise EngineDrainingError("the server is shutting down")

    def _loop(self) -> None:
        try:
            while self._apply_commands():
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    self.engine.check_ranks()  # a rank lost while idle: down now, not later
            self._fail_pending(EngineDeadError("the engine is shut down"))
        except BaseException as exc:  # interpreter shutdown: deliver, never hang a request
            self._error = exc
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.put(EngineDeadError(f"the engine stopped: {exc!r}"))
            self._fail_pending(exc)

    def _step(self) -> None:
        """One engine step, its outputs delivered. A step that raises fails its own requests
        inside ``step()``; if something still escapes (a bug of that very handling), every
        request is ended with the error rather than left waiting, and the loop goes on (unless
        the engine is dead: then the loop ends and every request gets ``EngineDeadError``)."""
        try:
            self._dispatch(self.engine.step())
        except Exception as exc:
            if self.engine.dead is not None:  # a tensor-parallel rank is gone: the loop ends,
                logger.error("%s", self.engine.dead)  # every stream gets EngineDeadError
                raise
            logger.exception("the engine step failed outside its own error handling")
            for request_id in list(self.engine.requests):
                with contextlib.suppress(Exception):
                    self._abort(request_id, RequestFailedError(f"the engine step failed: {exc!r}"))

    def _apply_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                self._abort_everything()
                return False
            try:
                if isinstance(command, _Abort):
                    self._abort(command.request_id, command.error)
                else:
                    self._apply_add(command)
            except Exception:  # one command's failure is logged, never the loop's end
                logger.exception("an engine command failed")

    def _apply_add(self, command: _Add) -> None:
        self._uncount(command.counted)  # in the engine's queue (or refused) from here on
        if not command.done.set_running_or_notify_cancel():
            self._forget_stream(command.request_id)  # its caller gave up while it was queued
            return
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                prompt_token_ids=command.prompt_token_ids,
                priority=command.priority,
            )
        except Exception as exc:  # refused: the caller gets the reason, the loop goes on
            if not isinstance(exc, ValueError):
                logger.exception("adding request %s failed", command.request_id)
            self._forget_stream(command.request_id)
            command.done.set_exception(exc)
        else:
            command.done.set_result(None)

    def _abort(self, request_id: str, error: BaseException | None = None) -> None:
        state = self.engine.requests.get(request_id)
        if state is None or not self.engine.abort(request_id):
            return
        output = state.output()
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            if error is not None:
                stream.put(error)
            elif output is not None:
                output.finished = True
                stream.put(output)
        if output is not None:
            self._notify_finished(output)

    def _abort_everything(self) -> None:
        for request_id in list(self.engine.requests):
            self._abort(request_id, EngineDeadError("the engine is shut down"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                self._notify_finished(output)

    def _notify_finished(self, output: RequestOutput) -> None:
        for callback in self.on_finished:
            try:
                callback(output)
            except Exception:
                logger.exception("a finished-request callback failed")

    def _fail_pending(self, exc: BaseException) -> None:
        """Refuse every add still queued (after a stop, or a fatal error)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and command.done.set_running_or_notify_cancel():
                self._forget_stream(command.request_id)
                error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
                command.done.set_exception(error)


class ServedEngine(Protocol):
    """What the server needs of an engine: :class:`AsyncEngine`, or
    ``DataParallelEngine`` (replicas behind one front)."""

    on_finished: list[Callable[[RequestOutput], None]]

    @property
    def tokenizer(self) -> Any: ...

    @property
    def intake(self) -> RequestIntake: ...

    @property
    def errored(self) -> bool: ...

    @property
    def accepting(self) -> bool: ...

    def start(self) -> None: ...

    def num_waiting(self) -> int: ...

    def stats_by_replica(self) -> list[tuple[str | None, EngineStats, int]]: ...

    async def add_request(
        self,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        priority: int = 0,
    ) -> RequestStream: ...

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        options: dict[str, Any] | None = None,
    ) -> list[int]: ...

    async def drain(self, timeout: float) -> None: ...

    async def shutdown(self, timeout: float = 5.0) -> None: ...
