"""A server's shape, computed once from its flags: the most rows, the longest row, the decode
steps per program, the prefill chunk, and its KV cache: a pool of pages (the rows' and the
prefix cache's) and the bytes one device holds of them. The engine runs it; the start-up
check (`app.check_cache_fits`), `--compile-only` (`aot/serving.py`) and `plan.info` count it,
all through `ServerShape.of` (`decode.decoder.server_shape` for a model's parameters).

    shape = ServerShape.of(context=8192, page_bytes=16 * 131072, max_batch=16)
    shape.n_pages, shape.pool_bytes, shape.cache_len
"""

from __future__ import annotations

import dataclasses

from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import pages_for
from llama_jax.plan.costs import (SERVING_PAGE_SIZE, SERVING_PREFILL_CHUNK,
                                  SERVING_STEPS_PER_DISPATCH, default_prefix_cache_bytes,
                                  format_bytes, prefix_cache_blocks, serving_cache_len)
from llama_jax.shapes import MIN_BUCKET

# The rows' pages take at most this share of the memory a device has free after the weights
# unless told (`--kv-cache-bytes`): the rest is the programs' working memory.
KV_CACHE_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class ServerShape:
    """At most `max_batch` rows of at most `max_seq_len` tokens (prompt and output), `steps`
    decode steps (or speculative rounds of `speculative_tokens` guesses) per program, prompts
    prefilled `prefill_chunk` tokens at a time, and a pool of pages of `page_size` positions:
    `rows_pages` for the rows and `prefix_blocks` chunks' worth for the prefix cache, split
    over `devices`, each device holding `page_bytes` per page (a draft model's share
    included)."""

    max_batch: int
    max_seq_len: int
    steps: int
    prefill_chunk: int
    page_size: int
    speculative_tokens: int
    page_bytes: int
    devices: int
    rows_pages: int
    prefix_blocks: int = 0

    @classmethod
    def of(cls, context: int, page_bytes: int, *, max_batch: int = 8,
           max_seq_len: int | None = None, steps: int = SERVING_STEPS_PER_DISPATCH,
           prefill_chunk: int = SERVING_PREFILL_CHUNK, page_size: int = SERVING_PAGE_SIZE,
           speculative_tokens: int = 0, devices: int = 1, kv_cache_bytes: int | None = None,
           cache_room: int | None = None, prefix_cache_bytes: int = 0) -> ServerShape:
        """The shape of a server of a model of `context` tokens. The rows' pages are
        `kv_cache_bytes` of them per device; by default a `max_seq_len` row for each row,
        or as many pages as `KV_CACHE_SHARE` of `cache_room` (a device's memory free after
        the weights; None: unknown) holds when fewer. A GenerateError names the flag that
        cannot be."""
        max_seq_len = context if max_seq_len is None else max_seq_len
        if not 1 <= max_seq_len <= context:
            raise GenerateError(f"max_seq_len={max_seq_len} (--max-seq-len) must be in "
                                f"[1, {context}] (the model's context)")
        if max_batch < 1 or steps < 1:
            raise GenerateError(f"max_batch={max_batch} (--max-batch) and steps_per_dispatch="
                                f"{steps} (--steps-per-dispatch) must be >= 1")
        if prefill_chunk < MIN_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise GenerateError(f"prefill_chunk={prefill_chunk} (--prefill-chunk) must be a "
                                f"power of two >= {MIN_BUCKET}")
        # A chunk is whole pages: the prefix cache keeps chunks as pages.
        if page_size < 1 or page_size & (page_size - 1) or page_size > prefill_chunk:
            raise GenerateError(f"page_size={page_size} (--page-size) must be a power of two "
                                f"<= the prefill chunk ({prefill_chunk})")
        if prefix_cache_bytes < 0:
            raise GenerateError(f"prefix_cache_bytes={prefix_cache_bytes} "
                                "(--prefix-cache-bytes) must be >= 0")
        row = pages_for(serving_cache_len(max_seq_len, speculative_tokens), page_size)
        rows_pages, held_by = max_batch * row, ""
        share = None if cache_room is None else max(int(cache_room * KV_CACHE_SHARE), 0)
        if kv_cache_bytes is not None:
            rows_pages = kv_cache_bytes // page_bytes
            held_by = f"--kv-cache-bytes {kv_cache_bytes}"
        elif share is not None and share < rows_pages * page_bytes:
            rows_pages = share // page_bytes
            held_by = (f"{KV_CACHE_SHARE:.0%} of the {format_bytes(cache_room)} free after "
                       "the weights (--kv-cache-bytes by default)")
        if rows_pages < row:
            raise GenerateError(
                f"{held_by} holds {rows_pages} pages of {page_size} positions ({page_bytes} "
                f"bytes each), fewer than the {row} of one row of --max-seq-len {max_seq_len}"
                + (f" and {speculative_tokens} guesses" if speculative_tokens else ""))
        shape = cls(max_batch, max_seq_len, steps, prefill_chunk, page_size, speculative_tokens,
                    page_bytes, devices, rows_pages)
        return shape.with_prefix_cache(prefix_cache_bytes)

    def with_prefix_cache(self, nbytes: int) -> ServerShape:
        """This shape with a prefix cache of `nbytes` per device (whole chunks)."""
        blocks = prefix_cache_blocks(nbytes, self.block_bytes, self.prefill_chunk,
                                     self.max_seq_len)
        return dataclasses.replace(self, prefix_blocks=blocks)

    def with_default_prefix_cache(self, cache_room: int | None) -> ServerShape:
        """This shape with the prefix cache a server keeps when not told
        (`default_prefix_cache_bytes`), given `cache_room` (a device's memory free after
        the weights; None: unknown): a share of what the pool leaves of it."""
        left = None if cache_room is None else cache_room - self.pool_bytes
        return self.with_prefix_cache(default_prefix_cache_bytes(left, self.pool_bytes))

    @property
    def cache_len(self) -> int:
        """The positions a row holds at its largest (a verify pass writes its guesses past
        the row's last token)."""
        return serving_cache_len(self.max_seq_len, self.speculative_tokens)

    @property
    def chunk_pages(self) -> int:
        return self.prefill_chunk // self.page_size

    @property
    def n_pages(self) -> int:
        """The pool's pages: the rows' and the prefix cache's, a multiple of the devices
        (its pages are split over them)."""
        pages = self.rows_pages + self.prefix_blocks * self.chunk_pages
        return -(-pages // self.devices) * self.devices

    @property
    def advance(self) -> int:
        """The most positions a program advances a row by."""
        return self.steps * (1 + self.speculative_tokens)

    @property
    def block_bytes(self) -> int:
        """A device's bytes of one prefix cache block (a chunk's pages)."""
        return self.chunk_pages * self.page_bytes

    @property
    def rows_bytes(self) -> int:
        return self.rows_pages * self.page_bytes

    @property
    def prefix_bytes(self) -> int:
        return self.prefix_blocks * self.block_bytes

    @property
    def pool_bytes(self) -> int:
        """A device's bytes of the whole pool."""
        return self.n_pages * self.page_bytes
