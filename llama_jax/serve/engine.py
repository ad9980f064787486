"""Continuous batching: a fixed set of decode rows that requests enter and leave while the
others keep decoding.

    engine = Engine(config, params, max_batch=8, stop_ids=config.stop_ids)
    engine.warm_up(); engine.start()
    engine.submit(Request(prompt=[1, 415, 2936], max_tokens=64, deliver=print))

The rows are `decode/rows.py`'s and their device programs `decode/batching.py`'s; this is the
host side. The engine thread, between programs:
- admits a waiting request (or the `n` choices of one prompt, `submit_group`) once rows and
  its prompt's pages are free for it: the rows are reserved, its prompt is looked up in the
  prefix cache and its pages taken (below);
- prefills admitted prompts chunk by chunk (`batching.prefill_chunk`, `prefill_chunk` tokens per
  chunk, the last padded to a power of two) into its pages, about one chunk's worth of tokens
  between two decode programs, so the rows decoding keep emitting while a long prompt
  arrives; a prompt whose last chunk is done enters each of its rows (`batching.insert`,
  which samples each choice's first token from the shared last logits with the choice's own
  key);
- runs `steps_per_dispatch` decode steps for every row in one program (`batching.decode`), and
  reads the previous program's tokens while this one runs; it hands each request its tokens
  (`deliver`), and frees a row (and its pages) once its request has stopped, asked to stop
  (a stop string) or been cancelled; a row whose request will have all its `max_tokens` once
  the programs dispatched so far have run is free at once, before their tokens are read (the
  host counts them). Rows that stopped mid-dispatch idle on the device until then.

The KV cache is a pool of pages (`page_size` positions each; `kv_cache_bytes` per device
hold the rows' pages, by default as many as `max_batch` rows of `max_seq_len` need): each
row's request holds the pages its positions have reached (serve/pages.py), and every program
reads and writes through the tables the host hands it (`decode/batching.py`). A prompt is
admitted when its pages are free (not when a row of `max_seq_len` is), so short requests
fill more rows; before each dispatch every row decoding takes the pages that dispatch may
write (`_room`, from each row's end at most, which the host mirrors). When the pool runs
short, cached prefixes are let go of, then the newest row is preempted: its pages are given
back and its request queued again in front, to be prefilled and decoded anew, its tokens
already delivered skipped (they come out the same: a request's tokens do not depend on its
companions). A program attends over the table width that holds every row's next dispatch
(the power of two of positions, between `MIN_CACHE_LEN` and the context; a speculating
server keeps it at its largest: a verify pass's sums over the positions round differently
at another width, and a request's log-probabilities would depend on the requests before it),
so short requests decode as fast as in a small cache. Programs are compiled per width (and
prefill chunk shape), once.

Prefix cache (`prefix_cache_bytes` > 0, pages beside the rows'): every full chunk a prompt
computes stays in its pages, keyed by the chain of its token ids (`serve/prefix_index.py`,
least recently used let go of), which the cache holds beside the row. A new prompt's table
starts with its longest cached run of full chunks (at most all but the chunk holding its last
token), no copy, and it computes the rest. The chunk programs depend only on where a chunk
starts and its length, so a prompt runs the same programs on the same inputs cold or warm:
its cache, logits and tokens are the same, bit for bit. Requests that score their prompt
(`prompt_logprobs`) neither read nor fill the cache: they compute every chunk with the
scoring programs, as with the cache off. A prompt's `n` choices share its full pages; each
choice after the first gets a copy of its last page, where it writes its own tokens.

A request's tokens do not depend on its companions: rows never mix (MoE decodes without
dropping; a prompt's chunks route through a capacity factor chunk by chunk), its position is
its cache position, and its sampling key for step s is `fold_in(key, s)` of its own
key: by default `rows.row_key(seed)`, the key of a one-prompt `generate`'s row, so a seeded
request samples what `generate(..., seed=seed)` samples alone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.config import MeshConfig, ModelConfig, cache_dtype_name
from llama_jax.decode import batching as programs
from llama_jax.decode.decoder import (decoder_params, page_bytes, pool_devices,
                                      resolve_decode_impl, rows_cache_bytes)
from llama_jax.decode.speculate import speculation
from llama_jax.shapes import bucket
from llama_jax.decode.step import NO_TOKEN, check_prompt, stop_table
from llama_jax.decode.sampling import SamplingParams, Strategy, check_settings
from llama_jax.decode.batching import (TOP_LOGPROBS, check_page_size, check_prefill_chunk,
                                       chunk_pages, chunk_plan, chunk_shapes)
from llama_jax.decode.rows import Emitted, row_key
from llama_jax.decode.speculate import HIT_RATE_START, worth_a_pass
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import NO_PAGE, pages_for
from llama_jax.model.params import Params
from llama_jax.parallel import sharding, target
from llama_jax.plan.costs import (SERVING_PAGE_SIZE, SERVING_PREFILL_CHUNK,
                                  SERVING_STEPS_PER_DISPATCH, prefix_cache_blocks,
                                  serving_cache_len, serving_pool_pages, serving_rows_pages)
from llama_jax.serve.pages import PagePool, RowTable
from llama_jax.serve.prefix_index import PrefixIndex

log = logging.getLogger("llama_jax.serve")

MIN_CACHE_LEN = 64  # the fewest positions the rows' cache shrinks to
# The engine's counters (`stats()`) and what they count.
COUNTERS = {"prefill_chunks": "Prefill programs run",
            "prefix_cache_lookups": "Prompts looked up in the prefix cache",
            "prefix_cache_hits": "Prompts that restored at least one prefix cache block",
            "prefix_cache_hit_tokens": "Prompt tokens restored from the prefix cache",
            "speculative_drafted_tokens": "Guesses verified by speculative decoding",
            "speculative_accepted_tokens": "Guesses speculative decoding kept",
            "preemptions": "Rows preempted (their pages given back, their requests queued "
                           "again) when the KV cache's pages ran short"}


class QueueFull(Exception):
    """The request queue is full; the caller should retry later."""


@dataclasses.dataclass
class Chunk:
    """What a request gets after a program: its new tokens (stop tokens excluded), their
    log-probabilities and, if asked, the top alternatives of each (`(id, logprob)` pairs,
    most likely first); and, once it is over, why ("stop", "length", "cancelled") or the
    error that ended it."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    error: BaseException | None = None
    # With the first tokens of a request that asked for them: the log-probability of each
    # prompt token after the first given those before it, and its top alternatives.
    prompt_logprobs: list[float] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to decode. `deliver(chunk)` is called on the engine thread after each
    program that gave the request tokens, and once more when it finishes; it returns True to
    stop the request there (e.g. a stop string appeared: finish reason "stop"). `key` is the
    request's sampling key (default `rows.row_key(seed)`)."""

    prompt: Sequence[int]
    max_tokens: int
    deliver: Callable[[Chunk], bool | None]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    key: jax.Array | None = None
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # also score the prompt (its top_logprobs alternatives)
    cancelled: bool = False  # set from any thread: the engine frees its row at the next chance
    generated: int = dataclasses.field(default=0, init=False)
    finished: bool = dataclasses.field(default=False, init=False)
    # Prompt tokens restored from the prefix cache, set before the request's first delivery.
    cached_tokens: int = dataclasses.field(default=0, init=False)
    # Speculating: the guesses verified for the request and those kept, so far.
    drafted_tokens: int = dataclasses.field(default=0, init=False)
    accepted_tokens: int = dataclasses.field(default=0, init=False)
    # Preempted and decoding anew: its first tokens, delivered already, still to skip.
    replay: int = dataclasses.field(default=0, init=False)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def strategy(self) -> Strategy:
        return Strategy.of(self.temperature, self.top_k, self.top_p)


@dataclasses.dataclass
class _Program:
    """A dispatched program's outputs and the request each row held when it was dispatched."""

    emitted: Emitted
    owners: list[Request | None]
    prompt: list[Emitted] | None = None  # a prefill's prompt scores per chunk, if asked for
    number: int | None = None  # a decode program's, counted from 0


@dataclasses.dataclass(eq=False)
class _Prefill:
    """A prompt being prefilled for the requests that share it (a prompt's `n` choices), in
    the rows reserved for them (its pages are held in its own name, beside a page for each
    further choice to copy its last page into): the chunks still to run, the last logits so
    far, the prompt's scores per chunk (if asked for), the keys of its full chunks in the
    prefix cache and the tokens restored from it."""

    requests: list[Request]
    rows: list[int]
    chunks: collections.deque
    keys: list[bytes]
    cached: int
    spares: list[int] = dataclasses.field(default_factory=list)
    logits: jax.Array | None = None
    scores: list[Emitted] = dataclasses.field(default_factory=list)

    @property
    def prompt(self) -> Sequence[int]:
        return self.requests[0].prompt

    @property
    def scoring(self) -> bool:
        return self.requests[0].prompt_logprobs


class Engine:
    """Continuous batching over at most `max_batch` rows of at most `max_seq_len` tokens each
    (prompt and output; default the model's context), over a KV cache of pages of
    `page_size` positions: `kv_cache_bytes` per device of them for the rows (None: what
    `max_batch` rows of `max_seq_len` need). `stop_ids` end a request (default the model's EOS
    ids); `cache_dtype` and `decode_impl` are `generate`'s; `steps_per_dispatch` decode steps
    run per program; prompts are prefilled in chunks of `prefill_chunk` tokens (a power of
    two, at least `page_size`); `prefix_cache_bytes` (per device) of pages more hold full
    chunks of earlier prompts (0: none); at most `max_queue` requests (or groups) wait for a
    row (`submit` raises QueueFull beyond that). Parameters on a mesh decode under
    `mesh_config`'s rules. `speculate="ngram"` decodes by prompt lookup,
    `draft=(draft_config, draft_params)` (or `speculate="draft"` with it) by a draft model
    (`num_speculative_tokens`, `ngram` and `min_accepted` as for `generate`): each dispatch
    then runs `steps_per_dispatch` rounds. A draft's cache is a pool of as many pages beside
    the model's, each page holding the same positions."""

    def __init__(self, config: ModelConfig, params: Params, *, max_batch: int = 8,
                 max_seq_len: int | None = None, stop_ids: Sequence[int] | None = None,
                 cache_dtype=None, decode_impl: str = "auto",
                 steps_per_dispatch: int = SERVING_STEPS_PER_DISPATCH,
                 prefill_chunk: int = SERVING_PREFILL_CHUNK, prefix_cache_bytes: int = 0,
                 page_size: int = SERVING_PAGE_SIZE, kv_cache_bytes: int | None = None,
                 max_queue: int = 64, mesh_config: MeshConfig | None = None,
                 speculate: str | None = None, num_speculative_tokens: int = 4,
                 ngram: tuple[int, int] = (1, 3), min_accepted: float | None = None,
                 draft: tuple[ModelConfig, Params] | None = None):
        self.config = config
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len or config.max_seq_len
        if not 1 <= self.max_seq_len <= config.max_seq_len:
            raise GenerateError(f"max_seq_len={self.max_seq_len} must be in [1, "
                                f"{config.max_seq_len}] (the model's context)")
        if max_batch < 1 or steps_per_dispatch < 1:
            raise GenerateError(f"max_batch={max_batch} and steps_per_dispatch="
                                f"{steps_per_dispatch} must be >= 1")
        check_prefill_chunk(prefill_chunk)
        check_page_size(page_size, prefill_chunk)
        if prefix_cache_bytes < 0:
            raise GenerateError(f"prefix_cache_bytes={prefix_cache_bytes} must be >= 0")
        self.steps = steps_per_dispatch
        self.cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)
        self.spec = speculation(config, speculate, num_speculative_tokens, ngram, draft,
                                max_batch, min_accepted, target.platform_of_tree(params))
        mesh = sharding.mesh_of(params)
        self.placement = None if mesh is None else (mesh, mesh_config or MeshConfig())
        if draft is not None and self.placement is not None:
            raise GenerateError("a server's draft model decodes on one device: serve it "
                                "without a mesh, or speculate by prompt lookup")
        self.max_len = serving_cache_len(self.max_seq_len, self.spec and self.spec.k)
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        each = page_bytes(config, params, page_size, self.cache_dtype, mesh_config, draft)
        self.prefix_blocks = prefix_cache_blocks(
            prefix_cache_bytes, each * (prefill_chunk // page_size), prefill_chunk,
            self.max_seq_len)
        self.n_pages = serving_pool_pages(
            serving_rows_pages(max_batch, self.max_len, page_size, each, kv_cache_bytes),
            self.prefix_blocks, prefill_chunk, page_size, pool_devices(params))
        impl = resolve_decode_impl(decode_impl, params, rows_cache_bytes(
            config, params, self.n_pages, page_size, self.cache_dtype, mesh_config, draft))
        self.params = decoder_params(params, impl)
        self.draft_params = None if draft is None else decoder_params(draft[1], impl)
        self.layout = "stacked" if impl == "scan" else "per_layer"
        self.stop_ids = stop_table(config, stop_ids)
        # What a dispatch may advance a row by, and the positions past its end a round writes
        # (a verify pass's guesses).
        self.advance = self.steps * (1 + (self.spec.k if self.spec else 0))
        self.past_end = self.spec.k if self.spec else 0
        # Speculating rows attend over every position: a verify pass's sums over them round
        # differently at another width, and a request's log-probabilities would depend on
        # the requests before it.
        self.min_len = self.max_len if self.spec else min(self.max_len, MIN_CACHE_LEN)
        self.counters: collections.Counter = collections.Counter()
        self._queue: queue.Queue[list[Request]] = queue.Queue(max_queue)
        self._requeued: collections.deque[list[Request]] = collections.deque()  # preempted
        self._held: list[Request] | None = None  # a group waiting for enough rows or pages
        self._jobs: collections.deque[_Prefill] = collections.deque()
        self._reserved: dict[int, _Prefill] = {}  # rows reserved for a prompt being prefilled
        self._executables: dict = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._abort = threading.Event()  # the drain timed out: fail what is left
        self._wake = threading.Event()
        self.finished: collections.Counter = collections.Counter()  # requests by how they ended
        self.generated_tokens = 0
        self._reset()

    # ------------------------------------------------------------------ the rows on the host

    def _reset(self) -> None:
        """Empty rows over an empty pool, and no prefix cached."""
        B, config = self.max_batch, self.config
        self.width = pages_for(self.min_len, self.page_size)
        self.rows = self._run(programs.empty_rows, np.asarray(self.stop_ids, np.int32),
                              config=config, batch=B, n_pages=self.n_pages,
                              page_size=self.page_size, max_len=self.max_len,
                              cache_dtype=self.cache_dtype, layout=self.layout,
                              spec=self.spec, placement=self.placement)
        self.pages = PagePool(self.n_pages)
        self.tables = RowTable(self.pages, self.page_size)
        self._index = None if not self.prefix_blocks else PrefixIndex(
            self.prefix_blocks, self.prefill_chunk, self.cache_dtype, self.pages)
        self.owners: list[Request | None] = [None] * B
        self.dispatched = [0] * B  # each row's tokens once the programs dispatched have run
        # Each row's cache end at most, once the programs dispatched have run, and at its
        # request's last token.
        self.end_bound = [0] * B
        self.last_end = [0] * B
        # Speculating: the rows' rates of first guesses right after each decode program read
        # (the last two), and the decode program each row's request was inserted before.
        self.programs_dispatched = 0
        self.end_rates: dict[int, np.ndarray] = {}
        self.inserted_before = [0] * B
        self.inserted = 0  # requests inserted so far: each row's number among them is its age
        self.inserted_at = [0] * B

    def _size_for(self, n: int) -> int:
        return min(max(bucket(n), self.min_len), self.max_len)

    def _room(self, b: int) -> int:
        """The cache positions row `b` may write up to in the next dispatch."""
        return min(self.end_bound[b] + self.advance, self.last_end[b]) + self.past_end

    def _last_page_copies(self, n: int, choices: int) -> int:
        """The pages the further choices of a prompt of n tokens copy its last page into:
        none when that page is full (each choice then writes from a page of its own)."""
        return choices - 1 if n % self.page_size else 0

    def _short(self, extra: int = 0) -> int:
        """The pages the pool lacks for `extra` pages and the next dispatch of every row
        decoding."""
        need = extra + sum(self.tables.missing(self.owners[b], self._room(b))
                           for b in range(self.max_batch) if self._decoding(b))
        return need - self.pages.free

    def _grow(self) -> None:
        """Gives every row decoding the pages its next dispatch may write (letting go of
        cached prefixes, then preempting the newest rows, while the pool is short), and sets
        the table width to hold them."""
        while self._short() > 0:
            if self._index is None or not self._index.evict():
                decoding = [b for b in range(self.max_batch) if self._decoding(b)]
                self._preempt(max(decoding, key=lambda b: self.inserted_at[b]))
        rooms = [self._room(b) for b in range(self.max_batch) if self._decoding(b)]
        for b in range(self.max_batch):
            if self._decoding(b):
                self.tables.grow(self.owners[b], self._room(b))
        self.width = pages_for(self._size_for(max(rooms, default=0)), self.page_size)

    def _preempt(self, b: int) -> None:
        """Gives back row `b`'s pages and queues its request again, first: it will be
        prefilled and decoded anew, the tokens it has had skipped. Its row decodes on over no
        pages (writing nothing) until another request takes it."""
        request = self.owners[b]
        self.owners[b] = None
        self.tables.drop(request)
        self._requeued.append([request])
        self.counters["preemptions"] += 1
        log.info("preempted a request after %d tokens: the KV cache's pages ran short",
                 request.generated)

    # --------------------------------------------------------------------------- programs

    def _run(self, fn, *args, **static):
        """`fn(*args, **static)`, compiled once per static arguments and argument shapes (and
        shardings: on a mesh, programs lay out their outputs by the sharding rules)."""
        key = (fn, tuple(sorted(static.items())), tuple(
            (np.shape(x), jnp.result_type(x), getattr(x, "sharding", None))
            for x in jax.tree.leaves(args)))
        if key not in self._executables:
            start = time.perf_counter()
            # The rows are donated whole; XLA may find no output for some of their buffers.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                self._executables[key] = fn.lower(*args, **static).compile()
            log.info("compiled %s %s in %.1f s", fn.__name__,
                     {k: v for k, v in static.items() if k not in ("config", "placement")},
                     time.perf_counter() - start)
        return self._executables[key](*args)

    def _prefill_chunk(self, pages_1N: np.ndarray, tokens_1L: np.ndarray, start: int,
                       last: int, next_1L: np.ndarray | None, draft: bool = False):
        """A chunk of a prompt prefilled into its pages by the model (or by the draft model,
        into its pool): the chunk's logits and scores."""
        self.counters["prefill_chunks"] += not draft
        config, params = ((self.spec.draft_config, self.draft_params) if draft
                          else (self.config, self.params))
        self.rows, logits, scores = self._run(
            programs.prefill_chunk, self.rows, params, pages_1N, tokens_1L, np.int32(start),
            np.int32(last), next_1L, config=config, draft=draft, placement=self.placement)
        return logits, scores

    def _insert(self, b: int, logits_1V: jax.Array, prompt: Sequence[int], max_new: int,
                sampling: SamplingParams, key_1: jax.Array) -> Emitted:
        prompt_1S = None
        if self.spec:  # the guesses read the row's tokens beside its cache
            prompt_1S = np.zeros((1, self.max_len), np.int32)
            prompt_1S[0, :len(prompt)] = prompt
        self.rows, first = self._run(programs.insert, self.rows, logits_1V, np.int32(b),
                                     np.int32(len(prompt)), np.int32(max_new), sampling, key_1,
                                     prompt_1S)
        return first

    def _copy_pages(self, from_pages: list[int], to_pages: list[int]) -> None:
        self.rows = self._run(programs.copy_pages, self.rows, np.asarray(from_pages, np.int32),
                              np.asarray(to_pages, np.int32))

    def _decode(self, strategy: Strategy, top: int, verify: bool = False) -> Emitted:
        program, args, spec = ((programs.decode, (), {}) if self.spec is None else (
            programs.speculate, (self.draft_params,), {"spec": self.spec, "verify": verify}))
        pages_BN = self.tables.array(self.owners, self.width)
        self.rows, emitted = self._run(program, self.rows, self.params, *args, pages_BN,
                                       config=self.config, n_steps=self.steps,
                                       strategy=strategy, top=top, placement=self.placement,
                                       **spec)
        return emitted

    def _worth_verifying(self) -> bool:
        """Whether the next program's rounds should run verify passes (`worth_a_pass`), by
        the rates that decide on the device: as the program before the last left them, read
        by now without waiting for the last, or a fresh request's."""
        p = self.programs_dispatched
        rates = self.end_rates.get(p - 2, np.full(self.max_batch, HIT_RATE_START, np.float32))
        rates = np.where(np.asarray(self.inserted_before) >= p - 1, HIT_RATE_START, rates)
        in_use_B = np.asarray([self._decoding(b) for b in range(self.max_batch)])
        return worth_a_pass(rates, in_use_B, self.spec)

    def _start_prefill(self, group: list[Request], rows: list[int]) -> _Prefill | None:
        """Reserves `rows` for the requests of `group` (one prompt), and its prompt's pages:
        the longest run of its full chunks the prefix cache holds (all but the one holding
        the last token, whose logits must be computed), new ones for the rest, and one for
        each further choice to copy the last page into. None (taking nothing) when the pool,
        after letting go of cached prefixes, lacks those pages beside the next dispatch's."""
        prompt, C = group[0].prompt, self.prefill_chunk
        n, keys, cached_pages = len(prompt), [], []
        job = _Prefill(group, rows, collections.deque(), keys, 0)
        if self._index is not None and not group[0].prompt_logprobs:
            keys += self._index.keys(prompt)
            cached_pages = self._index.lookup(keys[:(n - 1) // C])
            self.tables.share(job, cached_pages)  # before letting go of cached prefixes
        copies = self._last_page_copies(n, len(group))
        need = self.tables.missing(job, n) + copies
        while self._short(need) > 0 and self._index is not None and self._index.evict():
            pass
        if self._short(need) > 0:
            self.tables.drop(job)
            return None
        self.tables.grow(job, n)
        job.spares = self.pages.take(copies)
        job.cached = len(cached_pages) * self.page_size
        job.chunks.extend(chunk_plan(n, job.cached, C, self.max_seq_len))
        if keys:
            self.counters["prefix_cache_lookups"] += 1
            self.counters["prefix_cache_hits"] += bool(cached_pages)
            self.counters["prefix_cache_hit_tokens"] += job.cached
        for b in rows:
            self._reserved[b] = job
        return job

    def _run_chunk(self, job: _Prefill) -> int:
        """Runs the next chunk of `job` (a draft model's too), and keeps it in the prefix
        cache if it is a full chunk the cache lacks; returns its length."""
        start, L = job.chunks.popleft()
        prompt = job.prompt
        tokens_1L = np.zeros((1, L), np.int32)
        real = prompt[start:start + L]
        tokens_1L[0, :len(real)] = real
        next_1L = None
        if job.scoring:
            following = prompt[start + 1:start + L + 1]
            next_1L = np.zeros((1, L), np.int32)
            next_1L[0, :len(following)] = following
        pages_1N = self.tables.array([job], chunk_pages(start, L, self.page_size))
        job.logits, scores = self._prefill_chunk(pages_1N, tokens_1L, start, len(real) - 1,
                                                 next_1L)
        if self.draft_params is not None:
            self._prefill_chunk(pages_1N, tokens_1L, start, len(real) - 1, None, draft=True)
        if scores is not None:
            job.scores.append(scores)
        chunk, per_chunk = start // self.prefill_chunk, self.prefill_chunk // self.page_size
        if chunk < len(job.keys):  # a full chunk of a prompt that reads the cache
            self._index.add(job.keys[chunk],
                            self.tables.pages(job)[chunk * per_chunk:(chunk + 1) * per_chunk])
        return L

    def _insert_prefilled(self, job: _Prefill) -> list[_Program]:
        """Puts a prefilled prompt into each of its rows, with each choice's first token: the
        first choice takes the prompt's pages, each further one shares its full pages and
        copies its last (partial) one into a page of its own."""
        n, programs_ = len(job.prompt), []
        pages, full = self.tables.pages(job), n // self.page_size
        first_choice = True
        for b, request in zip(job.rows, job.requests):
            del self._reserved[b]
            if request.cancelled:
                self._finish(request, Chunk([], [], [], finish_reason="cancelled"))
                continue
            if first_choice or full == len(pages):
                self.tables.share(request, pages)
            else:
                self.tables.share(request, pages[:full])
                spare = job.spares.pop()
                self.tables.give(request, [spare])
                self._copy_pages([pages[full]], [spare])
            first_choice = False
            key_1 = (row_key(request.seed) if request.key is None else request.key)[None]
            sampling = SamplingParams.broadcast(1, request.temperature, request.top_k,
                                                request.top_p, request.min_p)
            self.end_bound[b], self.last_end[b] = n, n + request.max_tokens - 1
            first = self._insert(b, job.logits, job.prompt, request.max_tokens, sampling, key_1)
            self.owners[b] = request
            self.inserted_before[b] = self.programs_dispatched
            self.inserted += 1
            self.inserted_at[b] = self.inserted
            self.dispatched[b] = 1
            request.cached_tokens = job.cached
            # Decoding anew after a preemption: skip what it has had (scores included).
            request.replay = request.generated
            request.drafted_tokens = request.accepted_tokens = 0
            scores = None if request.replay else job.scores or None
            programs_.append(_Program(first, [request], scores))
        self._release(job)
        return programs_

    def _release(self, job: _Prefill) -> None:
        """Lets go of the pages a prompt held in its own name."""
        self.tables.drop(job)
        self.pages.release(job.spares)
        job.spares = []

    def _prefill_some(self, decoding: bool) -> list[_Program]:
        """Runs the admitted prompts' chunks, first come first: about `prefill_chunk` tokens
        of them while rows are decoding (at least one chunk), else until one prompt is done.
        Returns the first tokens of the prompts done."""
        spent, done = 0, []
        while self._jobs and (spent < self.prefill_chunk or (not decoding and not done)):
            job = self._jobs[0]
            try:
                spent += self._run_chunk(job)
                if not job.chunks:
                    self._jobs.popleft()
                    done += self._insert_prefilled(job)
            except Exception as e:
                log.exception("prefill failed")
                self._drop(job)
                self._recover(job.requests, e)
        return done

    def _drop(self, job: _Prefill) -> None:
        """Forgets a prompt being prefilled and frees the rows and pages it reserved."""
        with contextlib.suppress(ValueError):
            self._jobs.remove(job)
        self._release(job)
        for b in job.rows:
            if self._reserved.get(b) is job:
                del self._reserved[b]

    def _decoding(self, b: int) -> bool:
        """Whether row `b` holds a request that the programs dispatched so far leave short of
        its `max_tokens` (it may still stop earlier)."""
        request = self.owners[b]
        return request is not None and self.dispatched[b] < request.max_tokens

    def _dispatch(self) -> _Program:
        """`steps` decode steps of every row, under the strategy its requests need."""
        self._grow()
        live = [r for b, r in enumerate(self.owners) if self._decoding(b)]
        strategy = Strategy(draw=any(r.strategy.draw for r in live),
                            sort=any(r.strategy.sort for r in live))
        emitted = self._decode(strategy, TOP_LOGPROBS if any(r.top_logprobs for r in live) else 0,
                               self.spec is not None and self._worth_verifying())
        self.end_bound = [min(e + self.advance, last) if self._decoding(b) else e
                          for b, (e, last) in enumerate(zip(self.end_bound, self.last_end))]
        self.dispatched = [n + self.steps for n in self.dispatched]
        self.programs_dispatched += 1
        return _Program(emitted, list(self.owners), number=self.programs_dispatched - 1)

    def warm_up(self) -> float:
        """Compiles the programs a server meets and returns the seconds it took: every prefill
        chunk shape (a draft's too), the insertion and the page copy, and at every table
        width: decode greedy, sampling and sampling with top-k/top-p (top log-probabilities
        and prompt scores compile when first asked for). The rows and the pool are left
        empty."""
        start = time.perf_counter()
        # A chunk program per table width and length (the start is an input); no pages:
        # nothing is written.
        logits = None
        for start_, L in chunk_shapes(self.prefill_chunk, self.max_seq_len):
            pages_1N = np.full((1, chunk_pages(start_, L, self.page_size)), NO_PAGE, np.int32)
            tokens_1L = np.zeros((1, L), np.int32)
            logits = self._prefill_chunk(pages_1N, tokens_1L, start_, L - 1, None)[0]
            if self.draft_params is not None:
                self._prefill_chunk(pages_1N, tokens_1L, start_, L - 1, None, draft=True)
        self._insert(0, logits, [0], 1, SamplingParams.broadcast(1), jax.random.key(0)[None])
        self._copy_pages([0], [0])
        for size in sorted({self._size_for(n) for n in range(1, self.max_len + 1)}):
            self.width = pages_for(size, self.page_size)
            for draw, sort in ((False, False), (True, False), (True, True)):
                for verify in (False, True) if self.spec else (False,):
                    self._decode(Strategy(draw, sort), top=0, verify=verify)
        jax.block_until_ready(self.rows)
        self.counters.clear()
        self._reset()
        return time.perf_counter() - start

    # --------------------------------------------------------------------------- requests

    def check(self, request: Request) -> None:
        """Raises GenerateError, naming the lengths or the value, if `request` cannot run."""
        n = len(request.prompt)
        check_prompt(request.prompt, self.config.vocab_size)
        if request.max_tokens < 1:
            raise GenerateError(f"max_tokens={request.max_tokens} must be >= 1")
        check_settings(request.temperature, request.top_k, request.top_p, request.min_p)
        if n + request.max_tokens > self.max_seq_len:
            raise GenerateError(
                f"the prompt has {n} tokens and {request.max_tokens} more were asked for: "
                f"{n + request.max_tokens} > the server's context of {self.max_seq_len} tokens")
        if not 0 <= request.top_logprobs <= TOP_LOGPROBS:
            raise GenerateError(f"top_logprobs={request.top_logprobs} must be in "
                                f"[0, {TOP_LOGPROBS}]")

    def submit(self, request: Request) -> None:
        """Queues `request` (raises QueueFull when `max_queue` requests already wait, or
        GenerateError if it cannot run)."""
        self.submit_group([request])

    def submit_group(self, requests: Sequence[Request]) -> None:
        """Queues requests for one prompt (a prompt's `n` choices) that are prefilled once,
        together, when as many rows are free; each then decodes with its own settings and
        key. Raises as `submit` does, or GenerateError if they differ in prompt or in
        scoring it, or are more than the rows."""
        for request in requests:
            self.check(request)
        first = requests[0]
        if any(list(r.prompt) != list(first.prompt) or r.prompt_logprobs != first.prompt_logprobs
               for r in requests[1:]):
            raise GenerateError("the requests of a group must share the prompt and "
                                "prompt_logprobs")
        if len(requests) > self.max_batch:
            raise GenerateError(f"a group of {len(requests)} requests is more than the "
                                f"{self.max_batch} rows")
        n = len(first.prompt)
        pages = pages_for(n, self.page_size) + self._last_page_copies(n, len(requests))
        if pages > self.n_pages:
            raise GenerateError(f"{len(requests)} choices of a prompt of {n} tokens need "
                                f"{pages} pages of the KV cache's {self.n_pages}")
        if self._stopping.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self._queue.put_nowait(list(requests))
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are waiting already") from None
        self._wake.set()

    def stats(self) -> dict:
        """Rows in use, requests (or groups) waiting, requests running (holding a row) and
        waiting (queued, or being prefilled), the KV cache's pages and those held, requests
        finished by reason, tokens generated, and the counters of prefill chunks, prefix
        cache lookups, hits and tokens restored, and preemptions."""
        held = self._held or []
        running = sum(r is not None for r in self.owners)
        return {"slots": self.max_batch, "slots_in_use": running,
                "queued": self._queue.qsize() + bool(held) + len(self._requeued),
                "requests_running": running,
                "requests_waiting": (self._queue.qsize() + len(held) + len(self._requeued)
                                     + sum(len(job.requests) for job in list(self._jobs))),
                "kv_pages_total": self.n_pages, "kv_pages_used": self.pages.used,
                "finished": dict(self.finished), "generated_tokens": self.generated_tokens,
                "prefix_cache_blocks": self.prefix_blocks,
                "prefix_cache_blocks_used": 0 if self._index is None else len(self._index),
                **{name: self.counters[name] for name in COUNTERS}}

    def _finish(self, request: Request, chunk: Chunk) -> None:
        request.finished = True
        self.finished["error" if chunk.error is not None else chunk.finish_reason] += 1
        for b, owner in enumerate(self.owners):
            if owner is request:
                self.owners[b] = None
        self.tables.drop(request)
        self._deliver(request, chunk)

    def _deliver(self, request: Request, chunk: Chunk) -> bool:
        try:
            return bool(request.deliver(chunk))
        except Exception as e:  # a consumer's bug ends its request, never the engine
            log.exception("delivering to a request failed")
            if not request.finished:
                self._finish(request, Chunk([], [], [], error=e))
            return True

    def _collect(self, program: _Program) -> None:
        """Hands each live request its tokens from `program` and finishes those that ended."""
        e = jax.device_get(program.emitted)
        stops = set(self.stop_ids)
        if e.hit_rate_B is not None:
            self.end_rates = {program.number: e.hit_rate_B,
                              **{n: r for n, r in self.end_rates.items()
                                 if n == program.number - 1}}
        for b, request in enumerate(program.owners):
            if request is None or request.finished:
                continue
            if e.drafted_B is not None:  # counts since the request began
                self.counters["speculative_drafted_tokens"] += (int(e.drafted_B[b])
                                                                - request.drafted_tokens)
                self.counters["speculative_accepted_tokens"] += (int(e.accepted_B[b])
                                                                 - request.accepted_tokens)
                request.drafted_tokens = int(e.drafted_B[b])
                request.accepted_tokens = int(e.accepted_B[b])
            chunk, reason = Chunk([], [], []), None
            if program.prompt is not None:
                self._prompt_logprobs(chunk, jax.device_get(program.prompt), request)
            for k, token in enumerate(e.tokens_BK[b].tolist()):
                if token == NO_TOKEN:
                    break
                if request.replay:  # delivered before it was preempted
                    request.replay -= 1
                    continue
                if token in stops:
                    reason = "stop"
                    break
                chunk.tokens.append(token)
                chunk.logprobs.append(float(e.logprobs_BK[b, k]))
                if request.top_logprobs and e.top_ids_BKn.shape[-1]:
                    chunk.top.append(list(zip(
                        e.top_ids_BKn[b, k, :request.top_logprobs].tolist(),
                        e.top_logprobs_BKn[b, k, :request.top_logprobs].tolist())))
                request.generated += 1
                self.generated_tokens += 1
                if request.generated >= request.max_tokens:
                    reason = "length"
                    break
            if (chunk.tokens or chunk.prompt_logprobs is not None) and \
                    self._deliver(request, chunk) and not request.finished:
                reason = "stop"
            if request.cancelled and reason is None:
                reason = "cancelled"
            if reason is not None and not request.finished:
                self._finish(request, Chunk([], [], [], finish_reason=reason))

    @staticmethod
    def _prompt_logprobs(chunk: Chunk, scores: list[Emitted], request: Request) -> None:
        """The scores of the prompt's tokens after the first: position p of the chunks'
        scores (concatenated) scores token p + 1."""
        n, top = len(request.prompt), request.top_logprobs
        joined = jax.tree.map(lambda *x: np.concatenate(x, axis=1), *scores)
        chunk.prompt_logprobs = joined.logprobs_BK[0, :n - 1].tolist()
        chunk.prompt_top = [list(zip(ids[:top].tolist(), lps[:top].tolist()))
                            for ids, lps in zip(joined.top_ids_BKn[0, :n - 1],
                                                joined.top_logprobs_BKn[0, :n - 1])]

    def _fail(self, requests, error: BaseException) -> None:
        for request in requests:
            if request is not None and not request.finished:
                self._finish(request, Chunk([], [], [], error=error))

    # ------------------------------------------------------------------------ the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="llama_jax-engine", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout: float = 30.0) -> bool:
        """Stops taking requests, lets those admitted or queued finish for up to
        `drain_timeout` seconds (then cancels them) and joins the thread. True if it drained."""
        self._stopping.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(drain_timeout)
        drained = not self._thread.is_alive()
        if not drained:
            self._abort.set()
            self._wake.set()
            self._thread.join(10.0)
        return drained

    def idle(self) -> bool:
        return (self._queue.empty() and self._held is None and not self._jobs
                and not self._requeued and all(r is None for r in self.owners))

    def _admit(self) -> None:
        """Starts prefilling waiting groups, in order (preempted requests first), while the
        rows and pages free for them suffice: rows neither reserved nor decoding (or that
        will be free once the programs dispatched so far have run; their tokens are read
        from those programs), pages beside those the rows decoding take next."""
        free = [b for b in range(self.max_batch)
                if not self._decoding(b) and b not in self._reserved]
        while free:
            group = self._held or self._next_group()
            if group is None:
                return
            self._held = group  # first come, first served: it waits for rows and pages
            if len(group) > len(free):
                return
            rows = free[:len(group)]
            try:
                job = self._start_prefill(group, rows)
            except Exception as e:
                log.exception("prefill failed")
                self._held = None
                self._recover(group, e)
                continue
            if job is None:
                return
            self._held, free = None, free[len(group):]
            self._jobs.append(job)

    def _next_group(self) -> list[Request] | None:
        """The next group's requests (a preempted one's first) still to run (those cancelled
        finish here; a preempted one may have finished from the programs before)."""
        while True:
            if self._requeued:
                group = self._requeued.popleft()
            else:
                try:
                    group = self._queue.get_nowait()
                except queue.Empty:
                    return None
            for request in group:
                if request.cancelled and not request.finished:
                    self._finish(request, Chunk([], [], [], finish_reason="cancelled"))
            group = [r for r in group if not r.finished]
            if group:
                return group

    def _recover(self, touched, error: BaseException) -> None:
        """After a failed program: fails the requests it touched and, if the rows were lost
        with it (donated to a program that did not finish), every request in them; a lost
        prefix cache starts empty."""
        self._fail(touched, error)
        if any(x.is_deleted() for x in jax.tree.leaves(self.rows)):
            # The pool went with them: the prompts being prefilled too.
            self._fail([*self.owners, *(r for job in self._jobs for r in job.requests)],
                       error)
            self._jobs.clear()
            self._reserved.clear()
            self._reset()

    def _loop(self) -> None:
        pending: collections.deque[_Program] = collections.deque()
        while True:
            if self._abort.is_set():
                self._fail([*self.owners, *self._drain_queue()], GenerateError("shut down"))
            if self._stopping.is_set() and self.idle() and not pending:
                return
            self._admit()
            pending.extend(self._prefill_some(self._any_decoding()))
            decoding = self._any_decoding()
            if decoding:
                try:
                    pending.append(self._dispatch())
                except Exception as e:
                    log.exception("decode failed")
                    self._recover(self.owners, e)
            # Read a program's tokens once the next one is queued behind it (the device runs
            # that one meanwhile), or when nothing else will be queued.
            while pending and (len(pending) > 1 or not decoding):
                program = pending.popleft()
                try:
                    self._collect(program)
                except Exception as e:
                    log.exception("a program failed")
                    self._recover(program.owners, e)
            if not pending and self.idle() and not self._stopping.is_set():
                self._wake.wait(0.5)
                self._wake.clear()

    def _any_decoding(self) -> bool:
        return any(self._decoding(b) for b in range(self.max_batch))

    def _drain_queue(self) -> list[Request]:
        """Every request waiting or being prefilled, taken off the engine."""
        drained = [*(self._held or []), *(r for job in self._jobs for r in job.requests),
                   *(r for group in self._requeued for r in group)]
        self._requeued.clear()
        for job in list(self._jobs):
            self._drop(job)
        self._held = None
        with contextlib.suppress(queue.Empty):
            while True:
                drained.extend(self._queue.get_nowait())
        return drained
