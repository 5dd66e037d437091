"""A batch job: OpenAI batch input lines in, OpenAI batch output lines out, resumable.

Input: one request per line, ``{"custom_id": ..., "method": "POST", "url":
"/v1/completions" | "/v1/chat/completions" | "/v1/responses", "body": {...}}``; a body means
what it means over HTTP (the server's request models check it; a response line has no store, so
no ``previous_response_id``). Output: one line per input line, in the order
requests finish, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``: the body is the HTTP response body (an error body for a request the server would
refuse), and ``error`` is set instead of ``response`` for a line that is not a request at all
(not JSON, no ``custom_id``, a repeated ``custom_id``, a wrong method or url); such an error
carries the line's number. Blank lines are not requests and get nothing.

The input is read as the engine takes requests (a file larger than memory works): the engine is
kept about twice ``max_num_seqs`` sequences ahead so continuous batching never starves. Each
result is one ``write`` of a whole line to the output opened for appending, so a kill leaves at
most a partial last line; a rerun cuts that off, skips every line whose result is already there
(by ``custom_id``, or by line number for lines answered with an ``error``), and writes no line
twice. ``Shard(i, n)`` takes the lines whose number is ``i`` modulo ``n`` (0-based, counting
blank lines), so ``n`` processes over one input partition it.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError
from tqdm.auto import tqdm

from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import ChatTemplateError, ConfigError, InvalidRequestError
from specbatch.outputs import RequestOutput
from specbatch.server.formatting import (
    cached_tokens,
    chat_response,
    completion_response,
    error_body,
)
from specbatch.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    describe_validation_errors,
    in_client_terms,
)
from specbatch.server.responses import (
    OutputBuilder,
    ResponsesRequest,
    response_body,
    response_usage,
)
from specbatch.server.tools import template_knows_tools

logger = logging.getLogger("specbatch")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
URLS = (COMPLETIONS, CHAT, RESPONSES)
MAX_CUSTOM_ID_CHARS = 512
_END = object()


@dataclass(frozen=True)
class Shard:
    """Lines ``index``, ``index + count``, ... of the input (0-based line numbers)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise ConfigError(f"shard must be i/n with 0 <= i < n, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, sep, count = text.partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(index), int(count))
        except ValueError:
            raise ConfigError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None

    def owns(self, line_number: int) -> bool:
        """``line_number`` counts from 1, as editors and error messages do."""
        return (line_number - 1) % self.count == self.index


@dataclass
class BatchSummary:
    lines: int = 0  # input lines of this shard that are requests (blank lines aside)
    skipped: int = 0  # already in the output (a resumed job)
    succeeded: int = 0
    failed: int = 0  # answered with an error status or an error object
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


@dataclass
class _Pending:
    """An input line whose requests are in the engine."""

    custom_id: str
    kind: str  # COMPLETIONS, CHAT or RESPONSES
    request_ids: list[str]
    top: int | None  # logprobs per token asked for (chat: None without logprobs)
    n: int
    call_format: str | None = None  # chat with tools: how tool calls are read (tools.TAGS...)
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    # the engine's name of a field -> the line's (a failed constraint is named as written)
    renames: dict[str, str] = field(default_factory=dict)
    responses: ResponsesRequest | None = None  # a RESPONSES line's request


class _LineError(Exception):
    """A line answered without generating: an HTTP-style error response (``status``) or,
    with ``status`` None, an ``error`` object for a line that is not a request."""

    def __init__(
        self,
        message: str,
        status: int | None = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_line(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _LineError(
            f"the line is not UTF-8 ({exc.reason})", None, code="invalid_line"
        ) from None
    try:
        line = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise _LineError(f"the line is not valid JSON ({exc})", None, code="invalid_json") from None
    if not isinstance(line, dict):
        raise _LineError("the line must be a JSON object", None, code="invalid_line")
    return line


def _custom_id(line: dict[str, Any]) -> str:
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineError("custom_id must be a non-empty string", None, code="invalid_custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise _LineError(
            f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters",
            None,
            code="invalid_custom_id",
        )
    try:
        custom_id.encode("utf-8")
    except UnicodeEncodeError:
        raise _LineError(
            "custom_id is not valid unicode (a lone surrogate)", None, code="invalid_custom_id"
        ) from None
    return custom_id


class InputLine(NamedTuple):
    """A non-blank input line: a request (``line`` parsed, ``reject`` None), or not one
    (``reject`` says why; ``custom_id`` when it had a valid one)."""

    number: int  # from 1, blank lines counted
    raw: bytes
    line: dict[str, Any] | None
    custom_id: str | None
    reject: _LineError | None


def read_lines(path: Path) -> Iterator[InputLine]:
    """The input's non-blank lines, each parsed and its ``custom_id`` checked (a repeat of an
    earlier line's is not a request)."""
    seen: set[str] = set()
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            custom_id: str | None = None
            try:
                line = _parse_line(raw)
                custom_id = _custom_id(line)
                if custom_id in seen:
                    raise _LineError(
                        f"custom_id {custom_id!r} repeats an earlier line's",
                        None,
                        code="duplicate_custom_id",
                    )
            except _LineError as reject:
                yield InputLine(number, raw, None, custom_id, reject)
                continue
            seen.add(custom_id)
            yield InputLine(number, raw, line, custom_id, None)


def error_record(custom_id: str | None, number: int, reject: _LineError) -> dict[str, Any]:
    """The result line of an input line that is not a request."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": reject.code, "message": reject.message, "line": number},
    }


def _read_done(path: Path) -> tuple[set[str], set[int], int]:
    """The custom ids and the line numbers an existing output answers, and the number of
    answered lines; a partial last line (a kill mid-write) is cut off first."""
    ids: set[str] = set()
    lines: set[int] = set()
    count = 0
    if not path.exists():
        return ids, lines, count
    good_end = 0
    with path.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # the partial line of a killed run
            try:
                record = json.loads(raw)
            except ValueError:
                raise ConfigError(
                    f"{path} has a line that is not a batch result (byte {good_end}); "
                    "is it the output of another job?"
                ) from None
            good_end += len(raw)
            error = record.get("error") if isinstance(record, dict) else None
            if isinstance(error, dict) and isinstance(error.get("line"), int):
                lines.add(error["line"])
            elif isinstance(record, dict) and isinstance(record.get("custom_id"), str):
                ids.add(record["custom_id"])
            else:
                raise ConfigError(f"{path} has a line that is not a batch result: {raw[:80]!r}")
            count += 1
    if good_end != path.stat().st_size:
        logger.warning("%s: cutting off a partial last line (a killed run)", path)
        os.truncate(path, good_end)
    return ids, lines, count


class BatchJob:
    """Runs one input file (or one shard of it) through ``engine`` into an output file."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        shard: Shard | None = None,
        max_pending: int | None = None,
        progress: bool = True,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.shard = shard or Shard()
        # sequences queued ahead of the running ones: enough that a finishing sequence's slot
        # is filled at the next step
        self.max_pending = max_pending or 2 * engine.config.max_num_seqs
        self.progress = progress
        self._pending: dict[str, _Pending] = {}  # request id -> its line's state
        self._sequences = 0  # in the engine
        self._fd = -1
        self._sink: Callable[[dict[str, Any]], None] | None = None  # else the output file

    # ----------------------------------------------------------------- the job

    def run(self, input_path: Path | str, output_path: Path | str) -> BatchSummary:
        input_path, output_path = Path(input_path), Path(output_path)
        if not input_path.is_file():
            raise ConfigError(f"input file {input_path} does not exist")
        if output_path.resolve() == input_path.resolve():
            raise ConfigError("the output file must not be the input file")
        done_ids, done_lines, _ = _read_done(output_path)
        summary = BatchSummary()
        started = time.monotonic()
        total = self._count_lines(input_path)
        self._fd = os.open(output_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        bar = tqdm(total=total, unit="line", disable=not self.progress, dynamic_ncols=True)
        try:

            def show() -> None:
                bar.n = summary.skipped + summary.succeeded + summary.failed
                elapsed = time.monotonic() - started
                bar.set_postfix(
                    tok_s=f"{summary.completion_tokens / max(elapsed, 1e-9):.0f}", refresh=False
                )
                bar.refresh()

            self._drive(self._requests(input_path, done_ids, done_lines, summary), summary, show)
        finally:
            bar.close()
            os.close(self._fd)
            self._fd = -1
        summary.seconds = time.monotonic() - started
        return summary

    def answer(
        self, lines: list[tuple[int, bytes]], records: list[dict[str, Any]] | None = None
    ) -> tuple[list[dict[str, Any]], BatchSummary]:
        """The result records of these ``(line number, line)`` pairs, in the order they finish
        (a replica of a job whose reading, resuming and writing another process does),
        appended to ``records`` as they come (what was answered before an exception)."""
        records = [] if records is None else records
        summary = BatchSummary()
        started = time.monotonic()
        self._sink = records.append
        try:
            self._drive(self._numbered_requests(lines, summary), summary, lambda: None)
        finally:
            self._sink = None
        summary.seconds = time.monotonic() - started
        return records, summary

    def _drive(
        self, lines: Iterator[None], summary: BatchSummary, show: Callable[[], None]
    ) -> None:
        """Keep the engine ``max_pending`` sequences ahead from ``lines`` until all finish."""
        try:
            exhausted = False
            while True:
                while not exhausted and self._sequences < self.max_pending:
                    if next(lines, _END) is _END:
                        exhausted = True
                for out in self.engine.step():
                    if out.finished:
                        self._finish(out, summary)
                show()
                if exhausted and not self._pending:
                    break
        finally:
            for request_id in list(self._pending):
                self.engine.abort(request_id)
            self._pending.clear()
            self._sequences = 0

    def _count_lines(self, path: Path) -> int:
        """Requests of this shard (non-blank lines it owns), for the progress bar."""
        count = 0
        with path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if self.shard.owns(number) and raw.strip():
                    count += 1
        return count

    def _requests(
        self, path: Path, done_ids: set[str], done_lines: set[int], summary: BatchSummary
    ) -> Iterator[None]:
        """Reads the input, answering bad lines at once and putting the others in the engine;
        yields after each line that added sequences (the caller decides when to read on)."""
        for item in read_lines(path):  # every shard reads every line: repeats are global
            if not self.shard.owns(item.number):
                continue
            summary.lines += 1
            if item.reject is not None:
                if item.number in done_lines:
                    summary.skipped += 1
                else:
                    self._write_error_line(item.custom_id, item.number, item.reject, summary)
                continue
            assert item.line is not None
            assert item.custom_id is not None
            if item.custom_id in done_ids:
                summary.skipped += 1
                continue
            if self._submit_or_answer(item.custom_id, item.number, item.line, summary):
                yield None

    def _numbered_requests(
        self, lines: list[tuple[int, bytes]], summary: BatchSummary
    ) -> Iterator[None]:
        """``_requests`` for lines another process read, checked and deduplicated."""
        for number, raw in lines:
            summary.lines += 1
            try:
                line = _parse_line(raw)
                custom_id = _custom_id(line)
            except _LineError as reject:
                self._write_error_line(None, number, reject, summary)
                continue
            if self._submit_or_answer(custom_id, number, line, summary):
                yield None

    def _submit_or_answer(
        self, custom_id: str, number: int, line: dict[str, Any], summary: BatchSummary
    ) -> bool:
        """Put the line's requests in the engine (True), or answer it with its error."""
        try:
            self._submit(custom_id, line)
        except _LineError as reject:
            if reject.status is None:
                self._write_error_line(custom_id, number, reject, summary)
            else:
                self._write_response(
                    custom_id,
                    f"batch_req_{uuid.uuid4().hex}",
                    reject.status,
                    error_body(reject.status, reject.message, reject.param, reject.code),
                    summary,
                )
            return False
        return True

    # ----------------------------------------------------------------- requests

    def _submit(self, custom_id: str, line: dict[str, Any]) -> None:
        method, url, body = line.get("method"), line.get("url"), line.get("body")
        if method != "POST":
            raise _LineError(f"method must be POST, got {method!r}", None, code="invalid_method")
        if url not in URLS:
            raise _LineError(
                f"url must be one of {', '.join(URLS)}, got {url!r}", None, code="invalid_url"
            )
        if not isinstance(body, dict):
            raise _LineError("body must be a JSON object", None, code="invalid_body")
        try:
            request: CompletionRequest | ChatCompletionRequest | ResponsesRequest
            if url == COMPLETIONS:
                request = CompletionRequest.model_validate(body)
            elif url == CHAT:
                request = ChatCompletionRequest.model_validate(body)
            else:
                request = ResponsesRequest.model_validate(body)
        except ValidationError as exc:
            message, param = describe_validation_errors(exc.errors())
            raise _LineError(message, 400, param) from None
        if request.model is not None and request.model != self.model_name:
            raise _LineError(
                f"The model `{request.model}` does not exist; this job runs `{self.model_name}`",
                404,
                "model",
                "model_not_found",
            )
        if request.stream:
            raise _LineError("stream is not supported in a batch", 400, "stream")
        renames: dict[str, str] = {"messages": "input"} if url == RESPONSES else {}
        call_format = None
        responses = None
        try:
            if isinstance(request, ResponsesRequest):
                if request.previous_response_id is not None:
                    raise InvalidRequestError(
                        "previous_response_id is not supported in a batch (no response store)",
                        "previous_response_id",
                    )
                responses, request = request, request.chat([])
                renames = responses.field_names(request)
            if isinstance(request, CompletionRequest):
                renames = request.renamed_fields()
                prompts, params = request.engine_inputs()
                top = request.logprobs
            else:
                renames = renames if responses is not None else request.field_names()
                call_format = request.call_format()
                knows_tools = template_knows_tools(self.engine.tokenizer.chat_template)
                add_generation_prompt, options = request.template_options(knows_tools)
                params = request.chat_params()
                top = request.top_logprobs_per_token()
                conversation = request.conversation(knows_tools)
                self.engine.intake.check_length(
                    sum(len(m["content"]) for m in conversation), "messages"
                )
                _, ids = self.engine.tokenizer.encode_chat(
                    conversation, add_generation_prompt, **options
                )
                prompts = [ids]
            prefix = {COMPLETIONS: "cmpl", CHAT: "chatcmpl"}.get(url, "resp")
            base = f"{prefix}-{uuid.uuid4().hex}"
            pending = _Pending(
                custom_id,
                url,
                [f"{base}-{i}" for i in range(len(prompts))],
                top,
                params.n,
                call_format,
                renames=renames,
                responses=responses,
            )
            added: list[str] = []
            try:
                for request_id, prompt in zip(pending.request_ids, prompts, strict=True):
                    self.engine.add_request(request_id, prompt, params, priority=request.priority)
                    added.append(request_id)
            except BaseException:
                for request_id in added:
                    self.engine.abort(request_id)
                raise
        except InvalidRequestError as exc:
            message, param = in_client_terms(exc, renames)
            raise _LineError(message, 400, param) from None
        except ChatTemplateError as exc:
            raise _LineError(str(exc), 500, code="chat_template_error") from None
        except ValueError as exc:  # a library check without a field
            raise _LineError(str(exc), 400) from None
        for request_id in pending.request_ids:
            self._pending[request_id] = pending
        self._sequences += len(prompts) * params.n

    def _finish(self, out: RequestOutput, summary: BatchSummary) -> None:
        pending = self._pending.pop(out.request_id, None)
        if pending is None:
            return
        pending.finals[out.request_id] = out
        self._sequences -= pending.n
        if len(pending.finals) < len(pending.request_ids):
            return
        finals = [pending.finals[request_id] for request_id in pending.request_ids]
        rid = pending.request_ids[0].rsplit("-", 1)[0]
        failed = next((o for o in finals if o.error is not None), None)
        if failed is not None and failed.error_param is not None:  # its own constraint
            error = InvalidRequestError(failed.error or "", failed.error_param)
            message, param = in_client_terms(error, pending.renames)
            body = error_body(400, message, param, "constraint_failed")
            self._write_response(pending.custom_id, rid, 400, body, summary)
            return
        if failed is not None:
            message = f"generation failed: {failed.error}"
            body = error_body(500, message, None, "engine_step_failed")
            self._write_response(pending.custom_id, rid, 500, body, summary)
            return
        created, tokenizer = int(time.time()), self.engine.tokenizer
        if pending.responses is not None:
            self._write_responses_body(pending.responses, pending, finals[0], summary)
            return
        if pending.kind == COMPLETIONS:
            response = completion_response(
                rid, created, self.model_name, finals, pending.n, pending.top or 0, tokenizer
            )
        else:
            response = chat_response(
                rid,
                created,
                self.model_name,
                finals[0],
                pending.top,
                tokenizer,
                pending.call_format,
            )
        summary.prompt_tokens += response["usage"]["prompt_tokens"]
        summary.completion_tokens += response["usage"]["completion_tokens"]
        self._write_response(pending.custom_id, rid, 200, response, summary)

    def _write_responses_body(
        self,
        request: ResponsesRequest,
        pending: _Pending,
        final: RequestOutput,
        summary: BatchSummary,
    ) -> None:
        """A response line's body: the response object, as ``/v1/responses`` answers."""
        completion = final.outputs[0]
        builder = OutputBuilder(pending.call_format)
        builder.feed(completion.text)
        incomplete = completion.finish_reason == "length"
        builder.finish(incomplete)
        rid = pending.request_ids[0].rsplit("-", 1)[0].replace("resp-", "resp_", 1)
        spent = response_usage(
            len(final.prompt_token_ids), len(completion.token_ids), cached_tokens([final])
        )
        status = "incomplete" if incomplete else "completed"
        body = response_body(
            rid, int(time.time()), self.model_name, request, builder.items, status, spent
        )
        summary.prompt_tokens += spent["input_tokens"]
        summary.completion_tokens += spent["output_tokens"]
        self._write_response(pending.custom_id, rid, 200, body, summary)

    # ----------------------------------------------------------------- output

    def _write_response(
        self,
        custom_id: str,
        request_id: str,
        status: int,
        body: dict[str, Any],
        summary: BatchSummary,
    ) -> None:
        if status == 200:
            summary.succeeded += 1
        else:
            summary.failed += 1
        self._write(
            {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body},
                "error": None,
            }
        )

    def _write_error_line(
        self, custom_id: str | None, number: int, reject: _LineError, summary: BatchSummary
    ) -> None:
        summary.failed += 1
        self._write(error_record(custom_id, number, reject))

    def _write(self, record: dict[str, Any]) -> None:
        if self._sink is not None:
            self._sink(record)
        else:
            write_record(self._fd, record)


def write_record(fd: int, record: dict[str, Any]) -> None:
    """One ``write`` of the whole line (a kill cannot split it; a full disk can, and the rerun
    cuts the partial line off)."""
    data = (json.dumps(record, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
