"""Engine outputs as OpenAI response bodies and server-sent-event chunks."""

from __future__ import annotations

import json
from typing import Any

from specbatch.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from specbatch.server.tools import TAGS, CallReader, ToolCall, read_calls
from specbatch.tokenizer import Tokenizer

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def sse(payload: dict[str, Any]) -> str:
    # Error events may echo client text: escaped like error bodies (see errors.SafeJSONResponse).
    return f"data: {json.dumps(payload, ensure_ascii='error' in payload)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V
    the prefix cache held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_tokens(finals: list[RequestOutput]) -> int:
    return sum(o.metrics.num_cached_tokens for o in finals if o.metrics is not None)


def _token_text(tokenizer: Tokenizer, token: int, entry: PositionLogprobs) -> str:
    logprob = entry.get(token)
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token])


def _top(entry: PositionLogprobs, n: int) -> list[tuple[int, float]]:
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in entry.items() if lp.rank <= n)
    return [(token, logprob) for _, token, logprob in ranked[:n]]


def completion_logprobs(
    c: CompletionOutput, top_n: int, tokenizer: Tokenizer, offset: int = 0
) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(c.token_ids, c.logprobs, strict=False):
        text = _token_text(tokenizer, token, entry)
        tokens.append(text)
        token_logprobs.append(entry[token].logprob if token in entry else None)
        top: dict[str, float] = {}
        for t, lp in _top(entry, top_n):  # best first: a token text seen twice keeps its best
            top.setdefault(_token_text(tokenizer, t, entry), lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(c: CompletionOutput, top_n: int, tokenizer: Tokenizer) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = []
    for token, entry in zip(c.token_ids, c.logprobs, strict=False):
        text = _token_text(tokenizer, token, entry)
        content.append(
            {
                "token": text,
                "logprob": entry[token].logprob if token in entry else None,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (t_text := _token_text(tokenizer, t, entry)),
                        "logprob": lp,
                        "bytes": list(t_text.encode("utf-8")),
                    }
                    for t, lp in _top(entry, top_n)
                ],
            }
        )
    return {"content": content}


def completion_response(
    rid: str,
    created: int,
    model: str,
    finals: list[RequestOutput],
    n: int,
    top_n: int,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    choices = []
    for prompt_index, output in enumerate(finals):
        for c in output.outputs:
            choices.append(
                {
                    "index": prompt_index * n + c.index,
                    "text": c.text,
                    "logprobs": completion_logprobs(c, top_n, tokenizer),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(
            sum(len(o.prompt_token_ids) for o in finals),
            sum(len(c.token_ids) for o in finals for c in o.outputs),
            cached_tokens(finals),
        ),
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    c: CompletionOutput,
    top_n: int,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": c.text,
                "logprobs": completion_logprobs(c, top_n, tokenizer),
                "finish_reason": c.finish_reason,
            }
        ],
    }


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A completion that stopped after making calls finished with ``tool_calls``."""
    return "tool_calls" if called and reason == "stop" else reason


def chat_response(
    rid: str,
    created: int,
    model: str,
    final: RequestOutput,
    top_n: int | None,
    tokenizer: Tokenizer,
    call_format: str | None = None,
) -> dict[str, Any]:
    """A chat completion body; with a ``call_format`` (``tools.TAGS`` or ``tools.WHOLE``)
    tool calls are read out of each completion's text into ``message.tool_calls``."""
    choices = []
    for c in final.outputs:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        calls: list[ToolCall] = []
        if call_format is not None:
            message["content"], calls = read_calls(c.text, call_format)
            if calls:
                message["tool_calls"] = [call.as_message() for call in calls]
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c, top_n, tokenizer) if top_n is not None else None,
                "finish_reason": _finish_reason(c.finish_reason, bool(calls)),
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(
            len(final.prompt_token_ids),
            sum(len(c.token_ids) for c in final.outputs),
            cached_tokens([final]),
        ),
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    c: CompletionOutput,
    started: set[int],
    top_n: int | None,
    tokenizer: Tokenizer,
    readers: dict[int, CallReader] | None = None,
    call_format: str | None = None,
) -> dict[str, Any]:
    """One streamed chunk of a completion. With ``readers`` (one per completion, made here,
    reading ``call_format``) tool calls are read out of the text: content is sent up to a
    call's opening tag, and each call goes out whole, as a ``tool_calls`` delta, once its block
    closes (a reply that is all calls: at its end)."""
    delta: dict[str, Any] = {"content": c.text}
    finish_reason = c.finish_reason
    if readers is not None:
        reader = readers.setdefault(c.index, CallReader(call_format or TAGS))
        made = len(reader.calls)
        delta["content"], _ = reader.feed(c.text)
        if finish_reason is not None:
            rest, _ = reader.finish()
            delta["content"] += rest
            finish_reason = _finish_reason(finish_reason, bool(reader.calls))
        if len(reader.calls) > made:
            new = reader.calls[made:]
            delta["tool_calls"] = [call.as_delta(made + i) for i, call in enumerate(new)]
    if c.index not in started:
        started.add(c.index)
        delta["role"] = "assistant"
    choice: dict[str, Any] = {"index": c.index, "delta": delta, "finish_reason": finish_reason}
    if top_n is not None:
        choice["logprobs"] = chat_logprobs(c, top_n, tokenizer)
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
