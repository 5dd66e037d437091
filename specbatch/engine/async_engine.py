"""``AsyncEngine``: the engine behind asyncio, stepping in a worker thread.

The event loop never runs model code: one worker thread owns the :class:`LLMEngine` and loops
"apply queued commands (add, abort), step, hand outputs back". Outputs reach each request's
``asyncio.Queue`` through ``call_soon_threadsafe``. A consumer that stops iterating (breaks out,
is cancelled, its HTTP client disconnects) aborts its request, which frees its blocks. An
exception in the step loop is delivered to every waiting request and the engine refuses new
work (``EngineDeadError``) instead of hanging anyone.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from specbatch.config import EngineConfig
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import SpecbatchError
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import OutputKind, SamplingParams


class EngineDeadError(SpecbatchError, RuntimeError):
    """The step loop failed or the engine was stopped; no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    priority: int
    done: Future[None]


@dataclass
class _Abort:
    request_id: str


class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """The outputs of one accepted request. Iterate it; ``close()`` aborts it if unfinished."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
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
        self._stopped = False
        self._ids = itertools.count()
        self.on_finished: list[Callable[[RequestOutput], None]] = []

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def errored(self) -> bool:
        return self._error is not None

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def num_waiting(self) -> int:
        """Requests not yet running: queued commands plus the scheduler's waiting queue."""
        return self.engine.stats.num_waiting + self._commands.qsize()

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

        Bad input raises ``ValueError`` here. Iterate the stream, or ``close()`` it to abort.
        """
        self._check_alive()
        self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        params = params or SamplingParams()
        if prompt is not None and not isinstance(prompt, str):
            prompt_token_ids, prompt = prompt, None
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        done: Future[None] = Future()
        ids = list(prompt_token_ids) if prompt_token_ids is not None else None
        self._send(_Add(request_id, prompt, ids, params, priority, done))
        try:
            await asyncio.wrap_future(done)  # raises the engine's ValueError for bad input
        except BaseException:
            self._forget_stream(request_id)
            if not done.done() or done.exception() is None:
                self._send(_Abort(request_id))  # cancelled while being added
            raise
        return RequestStream(self, request_id, stream)

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

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to ``timeout`` seconds, abort the rest, stop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.num_in_flight() and loop.time() < deadline and not self.errored:
            await asyncio.sleep(0.05)
        with self._lock:
            pending = list(self._streams)
        for request_id in pending:
            self._send(_Abort(request_id))
        self._stopped = True
        self._commands.put(None)
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # ------------------------------------------------------------------ worker

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

    def _loop(self) -> None:
        try:
            while True:
                if not self._apply_commands():
                    return
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:  # deliver to everyone, never hang a request
            self._error = exc
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.put(EngineDeadError(f"the engine step failed: {exc!r}"))
            self._fail_pending(exc)

    def _apply_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                self._abort_everything()
                return False
            if isinstance(command, _Abort):
                self._abort(command.request_id)
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    prompt_token_ids=command.prompt_token_ids,
                    priority=command.priority,
                )
            except (ValueError, SpecbatchError) as exc:
                with self._lock:
                    self._streams.pop(command.request_id, None)
                command.done.set_exception(exc)
            else:
                command.done.set_result(None)

    def _abort(self, request_id: str) -> None:
        state = self.engine.requests.get(request_id)
        if state is None or not self.engine.abort(request_id):
            return
        output = state.output()
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None and output is not None:
            output.finished = True
            stream.put(output)
        if output is not None:
            for callback in self.on_finished:
                callback(output)

    def _abort_everything(self) -> None:
        for request_id in list(self.engine.requests):
            self._abort(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                for callback in self.on_finished:
                    callback(output)

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and not command.done.done():
                command.done.set_exception(EngineDeadError(f"the engine failed: {exc!r}"))
