"""Shared behaviour of the command-line entry points: bad input is one readable line and exit 2;
the int8 flags of every CLI that decodes or plans decoding."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

from llama_jax.dtypes import CACHE_DTYPES
from llama_jax.errors import UserError
from llama_jax.quant import QUANTIZATIONS


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


def add_int8_arguments(parser: argparse.ArgumentParser, cache_default: str) -> None:
    """`--quantize`, `--quantize-head` and `--cache-dtype` (whose default `cache_default`
    describes)."""
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default=None,
                        help="the blocks' matmul weights as int8 values with per-channel "
                             "scales, quantized while loading (default: as stored)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --quantize: the LM head and embedding table too")
    parser.add_argument("--cache-dtype", choices=CACHE_DTYPES, default=None,
                        help=f"KV cache dtype (default: {cache_default}; int8: int8 values "
                             "with a float32 scale per token and head)")
