"""Rendering a model's jinja2 chat template the way Hugging Face's ``apply_chat_template`` does.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable
sandbox. The environment matches the one templates are written against: ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that keeps non-ASCII text as is,
``raise_exception`` and ``strftime_now``, and ``{% generation %}`` blocks (which only mark
assistant text for training masks, so their body is rendered unchanged).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specbatch.errors import ChatTemplateError, InvalidRequestError


class _GenerationBlock(Extension):
    tags = {"generation"}  # noqa: RUF012 (jinja2 reads this class attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Rejection(jinja2.TemplateError):
    """The template's own ``raise_exception``: it refuses the conversation on purpose."""


def _raise_exception(message: str) -> None:
    raise _Rejection(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; compile once per model, render per request.

    A template that does not compile, or fails on a one-message conversation, raises
    :class:`ChatTemplateError` (the model's fault); one that rejects particular messages
    raises :class:`InvalidRequestError` naming ``messages`` (the request's).
    """

    SMOKE_TEST = ({"role": "user", "content": "Hello"},)

    def __init__(self, source: str) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the model's chat template is not valid jinja2 (line {exc.lineno}: {exc.message})"
            ) from None
        try:
            self._template.render(self._context([dict(m) for m in self.SMOKE_TEST], True, {}))
        except _Rejection:
            pass  # it wants another kind of conversation (a system turn first, say): fine
        except Exception as exc:
            raise ChatTemplateError(
                "the model's chat template fails on a one-message conversation: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    @staticmethod
    def _context(
        messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any]
    ) -> dict[str, Any]:
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        # Templates test `tools is not none`; an undefined variable would pass that test.
        context: dict[str, Any] = {"tools": None, "documents": None, **variables}
        context.update(messages=cleaned, add_generation_prompt=add_generation_prompt)
        return context

    def render(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The template's text for ``messages``; ``variables`` become template variables.

        Keys whose value is None are dropped from each message first, as templates test for a
        missing ``content`` or ``tool_calls`` rather than for None. ``variables`` cannot replace
        ``messages`` or ``add_generation_prompt``. Raises `InvalidRequestError` (a
        ``ValueError``) when a message is not a dict or the template rejects the conversation.
        """
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidRequestError(
                    f"messages[{index}] must be a dict, got {type(message).__name__}", "messages"
                )
        try:
            return self._template.render(self._context(messages, add_generation_prompt, variables))
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        except (
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            ArithmeticError,
        ) as exc:
            # Template code tripping over these messages' shape (the smoke test passed).
            raise InvalidRequestError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                "messages",
            ) from None
