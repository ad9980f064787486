"""Shared behaviour of the command-line entry points: bad input is one readable line and exit 2."""

from __future__ import annotations

import functools
import sys
from typing import Callable

from llama_jax.config import ConfigError
from llama_jax.data import DataError
from llama_jax.decoder import GenerateError
from llama_jax.formats import CheckpointError
from llama_jax.trainer import TrainingError

# Errors that describe the user's input (or a run that cannot go on); anything else is a bug
# and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CheckpointError, GenerateError,
                                            DataError, TrainingError)


def user_errors_exit(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wraps a CLI `main`: a user error prints `error: <message>` on stderr and exits 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except USER_ERRORS as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped
