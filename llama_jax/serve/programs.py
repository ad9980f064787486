"""A server's device programs (`decode/batching.py`) and the rows they run over: each program
compiled once per static arguments and argument shapes, and the warm-up that compiles those a
server meets before its first request."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import warnings
from typing import Callable, Sequence

import jax
import numpy as np

from llama_jax.config import ModelConfig
from llama_jax.decode import batching
from llama_jax.decode.rows import Emitted
from llama_jax.decode.sampling import SamplingParams, Strategy
from llama_jax.decode.speculate import Speculation
from llama_jax.model.kv_cache import NO_PAGE
from llama_jax.model.params import Params
from llama_jax.plan.serving import ServerShape
from llama_jax.shapes import padded_row

log = logging.getLogger("llama_jax.serve")


class Programs:
    """The rows of a server of `shape` (`batching.empty_rows`: a pool of pages, a draft
    model's beside it) and the programs that advance them, each returning what the host
    reads. Every call replaces `rows` (the old ones are donated)."""

    def __init__(self, config: ModelConfig, params: Params, draft_params: Params | None,
                 shape: ServerShape, stop_ids: Sequence[int], cache_dtype: str, layout: str,
                 spec: Speculation | None, placement):
        self.config, self.params, self.draft_params = config, params, draft_params
        self.shape, self.cache_dtype, self.layout = shape, cache_dtype, layout
        self.spec, self.placement = spec, placement
        self.stop_ids = np.asarray(stop_ids, np.int32)
        self._executables: dict = {}
        self.rows = None
        self.reset()

    def reset(self) -> None:
        """Empty rows over an empty pool."""
        # the logits and noise of a `forward` not yet picked from
        self._forwarded: tuple[jax.Array, jax.Array | None] | None = None
        self._fresh: set[int] = set()  # rows inserted since that forward
        s = self.shape
        self.rows = self._run(batching.empty_rows, self.stop_ids, config=self.config,
                              batch=s.max_batch, n_pages=s.n_pages, page_size=s.page_size,
                              max_len=s.cache_len, cache_dtype=self.cache_dtype,
                              layout=self.layout, spec=self.spec, placement=self.placement)

    @property
    def compiled(self) -> int:
        """The programs compiled so far."""
        return len(self._executables)

    def lost(self) -> bool:
        """Whether the rows went with a program that did not finish (they were donated)."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.rows))

    def _key(self, fn, args, static) -> tuple:
        """A program's cache key: the function, its static arguments and its arguments' shapes
        and dtypes (each its own: `jnp.result_type` costs ~10 µs a leaf) and shardings (on a
        mesh, programs lay out their outputs by the sharding rules); the model's parameters
        (and the draft's), which never change, by name, and off a mesh the rows too, which
        every program returns in the structure they came in: hashing their ~25 leaves (the
        demo model's) cost ~0.3 ms a program, 5-10% of a constrained step. (On a mesh,
        programs lay the rows out differently: the first has them replicated.)"""
        named = [("params",) if a is self.params else ("draft",) if (
            a is self.draft_params and a is not None) else ("rows",) if (
            a is self.rows and a is not None and self.placement is None) else a for a in args]
        return (fn, tuple(sorted(static.items())), tuple(
            (np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "sharding", None))
            for x in jax.tree.leaves(named)))

    def _compile(self, fn, args, static):
        """The executable of `fn(*args, **static)`, compiled on first use."""
        key = self._key(fn, args, static)
        if key in self._executables:
            return self._executables[key]
        start = time.perf_counter()
        # The rows are donated whole; XLA may find no output for some of their buffers.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            self._executables[key] = fn.lower(*args, **static).compile()
        log.info("compiled %s %s in %.1f s", fn.__name__,
                 {k: v for k, v in static.items() if k not in ("config", "placement")},
                 time.perf_counter() - start)
        return self._executables[key]

    def _run(self, fn, *args, **static):
        """`fn(*args, **static)`, compiled once per `_key`."""
        return self._compile(fn, args, static)(*args)

    def prefill_chunk(self, pages_1N: np.ndarray, tokens_1L: np.ndarray, start: int,
                      last: int, next_1L: np.ndarray | None, draft: bool = False):
        """A chunk of a prompt prefilled into its pages by the model (or by the draft model,
        into its pool): the chunk's logits and, with `next_1L`, its scores."""
        fn, args, static = self._prefill_call(pages_1N, tokens_1L, start, last, next_1L, draft)
        self.rows, logits, scores = self._run(fn, *args, **static)
        return logits, scores

    def _prefill_call(self, pages_1N, tokens_1L, start, last, next_1L, draft):
        config, params = ((self.spec.draft_config, self.draft_params) if draft
                          else (self.config, self.params))
        return (batching.prefill_chunk, (self.rows, params, pages_1N, tokens_1L,
                                         np.int32(start), np.int32(last), next_1L),
                {"config": config, "draft": draft, "placement": self.placement})

    def insert(self, b: int, logits_1V: jax.Array, prompt: Sequence[int], max_new: int,
               sampling: SamplingParams, key_1: jax.Array, mask_1W: np.ndarray | None = None
               ) -> Emitted:
        """A prefilled prompt into row `b`, with its first token (among those `mask_1W`
        allows: a constrained request's)."""
        # the guesses read the row's tokens beside its cache
        prompt_1S = padded_row(prompt, self.shape.cache_len) if self.spec else None
        if self.forwarded:
            self._fresh.add(b)
        self.rows, first = self._run(batching.insert, self.rows, logits_1V, np.int32(b),
                                     np.int32(len(prompt)), np.int32(max_new), sampling, key_1,
                                     prompt_1S, mask_1W)
        return first

    def copy_pages(self, from_pages: Sequence[int], to_pages: Sequence[int]) -> None:
        self.rows = self._run(batching.copy_pages, self.rows, np.asarray(from_pages, np.int32),
                              np.asarray(to_pages, np.int32))

    def decode(self, pages_BN: np.ndarray, strategy: Strategy, top: int,
               verify: bool = False,
               guessed_masks: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
               ) -> Emitted:
        """`shape.steps` decode steps (speculating: rounds, verifying or not) of every row
        over the pages of `pages_BN`; speculating with `guessed_masks` (constrained rows'
        masks, decode/grammar.py, at each position of their guesses `[B, K]`, `n_guess_B`
        of each row's real), one round: the guesses, then the round under their masks.
        (Constrained rows without speculation: `forward` and `pick`.)"""
        fn, args, static = self._decode_call(
            pages_BN, strategy, top, verify,
            1 if guessed_masks is not None else self.shape.steps)
        if guessed_masks is not None:
            proposal = self._run(batching.guesses, self.rows, self.draft_params, pages_BN,
                                 spec=self.spec, verify=verify, strategy=strategy,
                                 placement=self.placement)
            args += (proposal, guessed_masks(np.asarray(proposal.guess_BK),
                                             np.asarray(proposal.n_guess_B)))
        self.rows, emitted = self._run(fn, *args, **static)
        return emitted

    @property
    def forwarded(self) -> bool:
        """Whether a `forward` ran that no `pick` took yet."""
        return self._forwarded is not None

    @property
    def fresh(self) -> set[int]:
        """The rows the next `pick` skips: inserted after the forward it picks from."""
        return self._fresh

    def forward(self, pages_BN: np.ndarray, strategy: Strategy) -> None:
        """The first half of a decode step of every row over its pages (`batching.forward`;
        with the noise of its draws where `strategy` draws), run while the host computes the
        masks of its second half."""
        self.rows, *forwarded = self._run(batching.forward, self.rows, self.params, pages_BN,
                                          config=self.config, draw=strategy.draw,
                                          placement=self.placement)
        self._forwarded = tuple(forwarded)

    def pick(self, masks_BW: np.ndarray, strategy: Strategy, top: int) -> Emitted:
        """The second half (`batching.pick`): each row's token among those `masks_BW` allows,
        but for the rows inserted since the forward."""
        skip_B = np.isin(np.arange(self.shape.max_batch), list(self._fresh))
        self.rows, emitted = self._run(batching.pick, self.rows, *self._forwarded, skip_B,
                                       masks_BW, strategy=strategy, top=top,
                                       placement=self.placement)
        self._forwarded, self._fresh = None, set()
        return emitted

    def _decode_call(self, pages_BN, strategy, top, verify, n_steps=None):
        program, args, spec = ((batching.decode, (), {}) if self.spec is None else (
            batching.speculate, (self.draft_params,), {"spec": self.spec, "verify": verify}))
        return (program, (self.rows, self.params, *args, pages_BN),
                {"config": self.config, "n_steps": n_steps or self.shape.steps,
                 "strategy": strategy, "top": top, "placement": self.placement, **spec})

    def warm_up(self, widths: Sequence[int]) -> None:
        """Compiles the programs a server meets, as many at once as there are CPU cores:
        every prefill chunk shape (a draft's too), and at every table width of `widths`
        (pages) decode greedy, sampling and sampling with top-k/top-p (top log-probabilities
        and prompt scores compile when first asked for); then the insertion and the page
        copy, run once. The rows are left empty."""
        s = self.shape
        calls, first = [], None
        # A chunk program per table width and length (the start is an input); no pages:
        # nothing is written.
        for start, L in batching.chunk_shapes(s.prefill_chunk, s.max_seq_len):
            pages_1N = np.full((1, batching.chunk_pages(start, L, s.page_size)), NO_PAGE,
                               np.int32)
            chunk = (pages_1N, np.zeros((1, L), np.int32), start, L - 1, None)
            first = first or chunk
            calls.append(self._prefill_call(*chunk, False))
            if self.draft_params is not None:
                calls.append(self._prefill_call(*chunk, True))
        for width in widths:
            pages_BN = np.full((s.max_batch, width), NO_PAGE, np.int32)
            for draw, truncate in ((False, False), (True, False), (True, True)):
                for verify in (False, True) if self.spec else (False,):
                    calls.append(self._decode_call(pages_BN, Strategy(draw, truncate), 0, verify))
        # XLA compiles outside the GIL. Chunks of one table width and length share a program.
        unique = {self._key(*call): call for call in calls}.values()
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(lambda call: self._compile(*call), unique))
        logits = self.prefill_chunk(*first)[0]
        self.insert(0, logits, [0], 1, SamplingParams.broadcast(1), jax.random.key(0)[None])
        self.copy_pages([0], [0])
        jax.block_until_ready(self.rows)
        self.reset()
