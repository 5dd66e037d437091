"""Errors a user can act on. Each message names the file, field or value at fault."""

from __future__ import annotations


class SpecbatchError(Exception):
    """Base class of the errors specbatch raises on purpose."""


class ModelLoadError(SpecbatchError, ValueError):
    """A model file or directory is missing, truncated, corrupt or of an unsupported kind."""


class ConfigError(SpecbatchError, ValueError):
    """An engine or speculative configuration is impossible; raised at start-up."""


class InvalidRequestError(SpecbatchError, ValueError):
    """A request (its prompt or one of its sampling parameters) is invalid.

    ``param`` names the field at fault (``"prompt"``, ``"top_k"``, ``"logit_bias"``, ...), so
    that a server can point the client at it without parsing the message.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatTemplateError(SpecbatchError, RuntimeError):
    """The model's chat template is broken (does not compile, or fails on a plain conversation):
    a fault of the model files, not of the request that used it."""


class TensorParallelError(SpecbatchError, RuntimeError):
    """A tensor-parallel worker died or a collective failed: the engine cannot go on."""
