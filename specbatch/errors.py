"""Errors a user can act on. Each message names the file, field or value at fault."""

from __future__ import annotations


class SpecbatchError(Exception):
    """Base class of the errors specbatch raises on purpose."""


class ModelLoadError(SpecbatchError, ValueError):
    """A model file or directory is missing, truncated, corrupt or of an unsupported kind."""


class ConfigError(SpecbatchError, ValueError):
    """An engine or speculative configuration is impossible; raised at start-up."""
