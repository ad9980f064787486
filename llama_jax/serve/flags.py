"""The flags that shape a server's device programs, shared by `python -m llama_jax.serve` and
the check that compiles them for another target (`python -m llama_jax.aot.serving`)."""

from __future__ import annotations

import argparse

from llama_jax.cli import add_int8_arguments, add_speculation_arguments
from llama_jax.config import DTYPES
from llama_jax.decode.decoder import DECODE_IMPLS
from llama_jax.decode.speculate import MAX_GUESSES, METHODS
from llama_jax.nn.attention.dot_product import ATTENTION_IMPLS
from llama_jax.plan.costs import (PREFIX_CACHE_SHARE, PREFIX_CACHE_ROWS_MULTIPLE,
                                  SERVING_PAGE_SIZE, SERVING_PREFILL_CHUNK,
                                  SERVING_STEPS_PER_DISPATCH)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's shape: its rows, KV cache pages, dtypes, int8 weights and cache, attention and
    decoder, mesh, decode steps per dispatch, prefill chunk, prefix cache and speculative
    decoding (`check_speculation_flags` checks the last after parsing)."""
    parser.add_argument("--max-batch", type=int, default=8,
                        help="the most rows decoding at once")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="tokens per request, prompt and output (default: the model's "
                             "context)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter and compute dtype (default: as stored)")
    add_int8_arguments(parser, cache_default="the compute dtype")
    parser.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                        help="how prompts' attention is computed")
    parser.add_argument("--decode-impl", choices=DECODE_IMPLS, default="auto")
    parser.add_argument("--mesh", default=None,
                        help="place the parameters on a mesh of the devices, e.g. "
                             "data=1,fsdp=1,tensor=8")
    parser.add_argument("--steps-per-dispatch", type=int, default=SERVING_STEPS_PER_DISPATCH,
                        help="decode steps per device program")
    parser.add_argument("--prefill-chunk", type=int, default=SERVING_PREFILL_CHUNK,
                        help="prompt tokens prefilled per program, between decode programs "
                             "(a power of two >= 16; also the prefix cache's block)")
    parser.add_argument("--page-size", type=int, default=SERVING_PAGE_SIZE,
                        help="positions per page of the KV cache (a power of two <= "
                             "--prefill-chunk)")
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="memory per device for the rows' KV cache pages; requests are "
                             "admitted while their pages are free (default: a --max-seq-len "
                             "row for each of --max-batch rows, or 90%% of the memory left "
                             "after the weights when less)")
    parser.add_argument("--prefix-cache-bytes", type=int, default=None,
                        help="memory per device for blocks of earlier prompts' KV (default: "
                             f"{PREFIX_CACHE_SHARE * 100:.0f}%% of what is free after the "
                             f"weights and slots, at most {PREFIX_CACHE_ROWS_MULTIPLE}x the "
                             "slots' cache)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute every prompt in full")
    add_speculation_arguments(parser, "speculative decoding: ngram (prompt lookup) or draft "
                                      "(a draft model, --draft-checkpoint; implied by it)",
                              METHODS, MAX_GUESSES)
    parser.add_argument("--draft-checkpoint",
                        help="a draft model's checkpoint (sharing the tokenizer), loaded as "
                             "--dtype and --quantize say; on one device (no --mesh)")
    parser.add_argument("--speculate-min-accepted", type=float, default=None,
                        help="prompt lookup: a row verifies while it expects to keep this "
                             "many guesses a pass (default: the break-even of the platform's "
                             "verify cost at --max-batch; 0: always)")


def check_speculation_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses a draft method without a draft, and a draft beside prompt lookup."""
    if args.speculate == "draft" and not args.draft_checkpoint:
        parser.error("--speculate draft needs --draft-checkpoint DIR")
    if args.speculate == "ngram" and args.draft_checkpoint:
        parser.error("--draft-checkpoint guesses by a draft model: drop --speculate ngram")
