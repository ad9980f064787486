"""Shared behaviour of the command-line entry points: bad input is one readable line and exit 2;
the library's notes on stderr; the int8 flags of every CLI that decodes or plans decoding."""

from __future__ import annotations

import argparse
import functools
import logging
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


class _Notes(logging.Handler):
    """`note: <message>` for INFO, `warning: <message>` and so on above it, on the sys.stderr
    of the moment (a test may have replaced it)."""

    def emit(self, record: logging.LogRecord) -> None:
        level = "note" if record.levelno == logging.INFO else record.levelname.lower()
        print(f"{level}: {record.getMessage()}", file=sys.stderr)


def show_library_notes() -> None:
    """The library's INFO lines (a choice it made for the user, such as the decoder "auto"
    fell back to) and worse go to stderr. Records still reach the root logger's handlers, if
    a program has set any; a level set on the `llama_jax` logger is kept."""
    logger = logging.getLogger("llama_jax")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, _Notes) for h in logger.handlers):
        logger.addHandler(_Notes())


def add_speculation_arguments(parser: argparse.ArgumentParser, speculate_help: str,
                              methods: tuple[str, ...], max_guesses: int) -> None:
    """`--speculate` (one of `methods`, described by `speculate_help`),
    `--num-speculative-tokens` (up to `max_guesses`) and `--ngram`."""
    parser.add_argument("--speculate", choices=methods, default=None, help=speculate_help)
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help=f"guesses per verify pass, 1..{max_guesses}")
    parser.add_argument("--ngram", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"),
                        help="n-gram sizes prompt lookup matches")


def add_int8_arguments(parser: argparse.ArgumentParser, cache_default: str) -> None:
    """`--quantize`, `--quantize-head` and `--cache-dtype` (whose default `cache_default`
    describes)."""
    # imported here: a CLI that never decodes (data.prepare, whose workers import it) does not
    # load JAX
    from llama_jax.dtypes import CACHE_DTYPES
    from llama_jax.quant import QUANTIZATIONS

    parser.add_argument("--quantize", choices=QUANTIZATIONS, default=None,
                        help="the blocks' matmul weights as int8 values with per-channel "
                             "scales, quantized while loading (default: as stored)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --quantize: the LM head and embedding table too")
    parser.add_argument("--cache-dtype", choices=CACHE_DTYPES, default=None,
                        help=f"KV cache dtype (default: {cache_default}; int8: int8 values "
                             "with a float32 scale per token and head)")
