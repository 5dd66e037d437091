"""Chat template rendering: the environment templates are written against, and its errors."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import pytest

from specbatch.errors import ChatTemplateError, InvalidRequestError
from specbatch.tokenizer import SpecialTokens, Tokenizer
from specbatch.tokenizer.chat_template import ChatTemplate
from specbatch.tokenizer.spm_tokenizer import SPMTokenizer
from specbatch.tokenizer.spm_vocab import SPMVocab, TokenType

HELLO: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]


def render(source: str, messages: list[dict[str, Any]] = HELLO, **variables: Any) -> str:
    return ChatTemplate(source).render(messages, **variables)


def test_blocks_are_trimmed_like_transformers() -> None:
    source = (
        "{% for m in messages %}\n    {% if m %}{{ m['role'] }}: {{ m['content'] }}{% endif %}\n"
    )
    source += "{% endfor %}"
    assert render(source, [*HELLO, *HELLO]) == "user: hellouser: hello"


def test_generation_prompt_flag() -> None:
    source = "{% if add_generation_prompt %}<assistant>{% endif %}"
    assert render(source) == "<assistant>"
    assert ChatTemplate(source).render(HELLO, add_generation_prompt=False) == ""


def test_tojson_keeps_text_as_is() -> None:
    source = "{{ messages[0] | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2) }}"
    out = render(source, [{"role": "user", "content": "<é & 'ü'>"}])
    assert out.startswith('{"role": "user", "content": "<é & \'ü\'>"}|')
    assert out.endswith('{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}')


def test_raise_exception_is_the_requests_fault() -> None:
    source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system turn') }}"
    source += "{% endif %}"
    with pytest.raises(ValueError, match="need a system turn"):
        render(source)


def test_strftime_now() -> None:
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)


def test_generation_blocks_and_loop_controls() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "user", "content": str(i)} for i in range(4)]
    assert render(source, messages) == "[0][1]"


def test_variables_and_missing_tools() -> None:
    source = "{{ bos_token }}{% if tools is not none %}tools{% endif %}{{ custom }}"
    assert render(source, bos_token="<s>", custom="!") == "<s>!"
    assert render(source, bos_token="", tools=[{"name": "f"}]) == "tools"


def test_none_valued_keys_are_dropped() -> None:
    source = "{% for m in messages %}{{ 'content' in m }}{% endfor %}"
    assert render(source, [{"role": "assistant", "content": None}]) == "False"


def test_sandbox_blocks_python_internals() -> None:
    # A template that reaches for Python internals fails on every conversation: it is broken.
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    guarded = "{% if messages[0]['content'] == 'x' %}{{ ''.__class__.__subclasses__() }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="rejected") as caught:
        render(guarded, [{"role": "user", "content": "x"}])
    assert caught.value.param == "messages"


def test_bad_templates_are_the_models_fault_bad_messages_the_requests() -> None:
    with pytest.raises(ChatTemplateError, match="not valid jinja2"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="fails on a one-message conversation"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(InvalidRequestError, match=re.escape("messages[1] must be a dict")):
        render("x", [HELLO[0], "oops"])  # type: ignore[list-item]
    # works for plain text, trips over a message without content: the request's fault
    source = "{% for m in messages %}{{ m['content'] | length }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="failed on these messages"):
        render(source, [{"role": "user", "content": 3}])


def test_encode_chat_adds_no_bos_of_its_own() -> None:
    source = "{{ bos_token }}{{ messages | length }}{% if add_generation_prompt %}+{% endif %}"
    tokenizer = tiny_tokenizer(source)
    assert tokenizer.apply_chat_template(HELLO, add_generation_prompt=False) == "<s>1"
    text, ids = tokenizer.encode_chat(HELLO)
    assert text == tokenizer.apply_chat_template(HELLO)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1


def test_lone_surrogates_are_refused_by_name() -> None:
    tokenizer = tiny_tokenizer("{{ messages[0]['content'] }}")
    with pytest.raises(InvalidRequestError, match="not valid Unicode") as caught:
        tokenizer.apply_chat_template([{"role": "user", "content": "a\ud800"}])
    assert caught.value.param == "messages"
    with pytest.raises(InvalidRequestError, match=r"\(U\+DC00\) at character 1"):
        tokenizer.encode("a\udc00b")


def tiny_tokenizer(template: str | None) -> Tokenizer:
    pieces = ("<unk>", "<s>", "</s>", "▁a")
    types = (TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.NORMAL)
    vocab = SPMVocab(pieces, (0.0,) * 4, tuple(int(t) for t in types))
    return SPMTokenizer(vocab, SpecialTokens(1, 2, None, chat_template=template))


def test_tokenizer_passes_its_bos_and_eos() -> None:
    tokenizer = tiny_tokenizer("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    assert tokenizer.apply_chat_template(HELLO) == "<s>hello</s>"
    assert tokenizer.apply_chat_template(HELLO, bos_token="[B]") == "[B]hello</s>"


def test_model_without_template() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        tiny_tokenizer(None).apply_chat_template(HELLO)
