"""The errors that describe a user's input, under one base class.

A `UserError` means the input (a config, a checkpoint, a corpus, a request) or the state of a
run cannot be used as asked; its message names the file, field or value. The command-line
entry points catch `UserError` alone and print one line (`cli.user_errors_exit`): anything else
is a bug and keeps its traceback. Each subclass also derives from the built-in exception it
always was (ValueError, RuntimeError), so `except ValueError` keeps working.
"""

from typing import Any


class UserError(Exception):
    """Input that cannot be used as asked; the message says what and where."""


class ConfigError(UserError, ValueError):
    """An invalid configuration; the message names the file (when there is one) and the field."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and what was expected."""


class DataError(UserError, ValueError):
    """A corpus, tokenizer or cache problem; the message names the file or setting."""


class GenerateError(UserError, ValueError):
    """A generation request that cannot be served; raised before anything is compiled."""


class ScoreError(UserError, ValueError):
    """A scoring request that cannot be served; raised before anything is compiled."""


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (e.g. the loss stayed non-finite); the message says why and where."""


def require(ok: bool, field: str, value: Any, message: str) -> None:
    """A config check: `ConfigError("field=value message")` unless `ok`."""
    if not ok:
        raise ConfigError(f"{field}={value!r} {message}")
