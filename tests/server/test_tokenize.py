"""``/tokenize`` and ``/detokenize`` (vLLM's): against the engine's own tokenizer and chat
template, and against what a completion or chat completion counts as its prompt; bad bodies get
a 4xx naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from specbatch.server.protocol import ChatCompletionRequest
from specbatch.server.tools import template_knows_tools
from tests.server.conftest import RunningServer


def post(server: RunningServer, path: str, body: Any) -> httpx.Response:
    raw = json.dumps(body).encode("utf-8", "surrogatepass")  # (lone surrogates go as sent)
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=60)


def test_a_prompt_is_the_tokenizers_ids_and_what_a_completion_counts(
    server: RunningServer,
) -> None:
    tokenizer = server.engine.tokenizer
    text = "The quick brown fox, naïve café ☃"
    out = post(server, "/tokenize", {"model": "tiny", "prompt": text}).json()
    assert out["tokens"] == tokenizer.encode(text)
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    completion = post(
        server, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0}
    ).json()
    assert completion["usage"]["prompt_tokens"] == out["count"]
    back = post(server, "/detokenize", {"tokens": plain["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(plain["tokens"])}
    assert back["prompt"] == text


def test_messages_are_what_a_chat_completion_sends(server: RunningServer) -> None:
    tokenizer = server.engine.tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something"},
    ]
    out = post(server, "/tokenize", {"messages": messages}).json()
    _, ids = tokenizer.encode_chat(messages, True)
    assert out["tokens"] == ids
    chat = post(
        server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0}
    ).json()
    assert chat["usage"]["prompt_tokens"] == out["count"]
    no_prompt = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert no_prompt.json()["tokens"] == tokenizer.encode_chat(messages, False)[1]
    strs = post(server, "/tokenize", {"messages": messages, "return_token_strs": True}).json()
    assert strs["token_strs"] == [tokenizer.decode([token]) for token in ids]
    assert "".join(strs["token_strs"]) == tokenizer.decode(ids)


def test_tools_are_rendered_as_a_chat_completion_renders_them(server: RunningServer) -> None:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
    messages = [{"role": "user", "content": "Weather?"}]
    with_tools = post(server, "/tokenize", {"messages": messages, "tools": [tool]}).json()
    without = post(server, "/tokenize", {"messages": messages}).json()
    assert with_tools["count"] > without["count"]
    assert "get_weather" in server.engine.tokenizer.decode(with_tools["tokens"])
    request = ChatCompletionRequest.model_validate({"messages": messages, "tools": [tool]})
    tokenizer = server.engine.tokenizer
    knows = template_knows_tools(tokenizer.chat_template)
    _, options = request.template_options(knows)
    _, ids = tokenizer.encode_chat(request.conversation(knows), True, **options)
    assert with_tools["tokens"] == ids


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "prompt"),
        (
            "/tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            400,
            "prompt",
        ),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "tools": []}, 400, "tools"),
        ("/tokenize", {"prompt": "a", "stream": True}, 400, "stream"),
        ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [10**30]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_bodies_get_a_4xx_naming_the_field(
    server: RunningServer, path: str, body: Any, status: int, param: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"]
    assert post(server, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_empty_inputs(server: RunningServer) -> None:
    tokenizer = server.engine.tokenizer
    empty = post(server, "/tokenize", {"prompt": "", "add_special_tokens": False}).json()
    assert empty == {"count": 0, "max_model_len": 256, "tokens": []}
    assert post(server, "/tokenize", {"prompt": ""}).json()["tokens"] == tokenizer.encode("")
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
