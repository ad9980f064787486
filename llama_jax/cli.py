"""Shared behaviour of the command-line entry points: bad input is one readable line and exit 2."""

from __future__ import annotations

import functools
import sys
from typing import Callable

from llama_jax.errors import UserError


def user_errors_exit(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wraps a CLI `main`: a `UserError` prints `error: <message>` on stderr and exits 2;
    anything else is a bug and keeps its traceback."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped
