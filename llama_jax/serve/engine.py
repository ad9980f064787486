"""Continuous batching: a fixed set of decode rows that requests enter and leave while the
others keep decoding.

    engine = Engine(config, params, max_batch=8, stop_ids=config.stop_ids)
    engine.warm_up(); engine.start()
    engine.submit(Request(prompt=[1, 415, 2936], max_tokens=64, deliver=print))

The rows are `decode/rows.py`'s and their device programs `decode/batching.py`'s; this is the
host side. The engine thread, between programs:
- admits a waiting request (or the `n` choices of one prompt, `submit_group`) once rows are
  free for it: the rows are reserved and its prompt is looked up in the prefix cache (below);
- prefills admitted prompts chunk by chunk (`batching.prefill_chunk`, `prefill_chunk` tokens per
  chunk, the last padded to a power of two), about one chunk's worth of tokens between two
  decode programs, so the rows decoding keep emitting while a long prompt arrives; a prompt
  whose last chunk is done is written into each of its rows (`batching.insert`, which samples
  each choice's first token from the shared last logits with the choice's own key);
- runs `steps_per_dispatch` decode steps for every row in one program (`batching.decode`), and
  reads the previous program's tokens while this one runs; it hands each request its tokens
  (`deliver`), and frees a row once its request has stopped, asked to stop (a stop string) or
  been cancelled; a row whose request will have all its `max_tokens` once the programs
  dispatched so far have run is free at once, before their tokens are read (the host counts
  them). Rows that stopped mid-dispatch idle on the device until then.

Prefix cache (`prefix_cache_bytes` > 0): every full chunk a prompt computes is copied into a
device pool of blocks (`decode/prefix_pool.py`), keyed by the chain of its token ids
(`serve/prefix_index.py`, least recently used evicted). A new prompt restores its longest
cached run of full chunks (at most all but the chunk holding its last token) and computes the
rest. The chunk programs depend only on where a chunk starts and its length, so a prompt runs
the same programs on the same inputs cold or warm: its cache, logits and tokens are the same,
bit for bit. Requests that score their prompt (`prompt_logprobs`) neither read nor fill the
cache: they compute every chunk with the scoring programs, as with the cache off.

Each row holds its request's sequence from cache position 0 and ends where it has got to
(the cache has an end per row), so rows are never moved: a row is written whole when its
prompt is inserted. The cache grows and shrinks at its end (`batching.resize`): before each
program the host makes it the power of two (between `MIN_CACHE_LEN` and the context) that
holds what every row decoding may write in the next dispatch (`_room`, from each row's end
at most, which the host mirrors), and halves it once half would do; a speculating server
keeps it at its largest. A step attends over the cache's positions, so short requests
decode as fast as in a small cache. Programs are compiled per cache length (and prefill
chunk shape), once.

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
from llama_jax.decode import prefix_pool
from llama_jax.decode import batching as programs
from llama_jax.decode.decoder import decoder_params, resolve_decode_impl, rows_cache_bytes
from llama_jax.decode.speculate import speculation
from llama_jax.shapes import bucket
from llama_jax.decode.step import NO_TOKEN, check_prompt, stop_table
from llama_jax.decode.sampling import SamplingParams, Strategy, check_settings
from llama_jax.decode.prefix_pool import prefix_block_bytes
from llama_jax.decode.batching import (TOP_LOGPROBS, check_prefill_chunk, chunk_capacity,
                                       chunk_plan, chunk_shapes)
from llama_jax.decode.rows import Emitted, row_key
from llama_jax.decode.speculate import HIT_RATE_START, worth_a_pass
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import KVCache
from llama_jax.model.params import Params
from llama_jax.parallel import sharding, target
from llama_jax.plan.costs import (SERVING_PREFILL_CHUNK, SERVING_STEPS_PER_DISPATCH,
                                  prefix_cache_blocks, serving_cache_len)
from llama_jax.serve.prefix_index import PrefixIndex

log = logging.getLogger("llama_jax.serve")

MIN_CACHE_LEN = 64  # the fewest positions the rows' cache shrinks to
# The engine's counters (`stats()`) and what they count.
COUNTERS = {"prefill_chunks": "Prefill programs run",
            "prefix_cache_lookups": "Prompts looked up in the prefix cache",
            "prefix_cache_hits": "Prompts that restored at least one prefix cache block",
            "prefix_cache_hit_tokens": "Prompt tokens restored from the prefix cache",
            "speculative_drafted_tokens": "Guesses verified by speculative decoding",
            "speculative_accepted_tokens": "Guesses speculative decoding kept"}


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
    the rows reserved for them: the chunks still to run, the one-row cache and last logits so
    far, the prompt's scores per chunk (if asked for), the keys of its full chunks in the
    prefix cache and the tokens restored from it."""

    requests: list[Request]
    rows: list[int]
    chunks: collections.deque
    keys: list[bytes]
    cached: int
    cache: KVCache | None = None
    logits: jax.Array | None = None
    scores: list[Emitted] = dataclasses.field(default_factory=list)

    @property
    def prompt(self) -> Sequence[int]:
        return self.requests[0].prompt

    @property
    def scoring(self) -> bool:
        return self.requests[0].prompt_logprobs


class Engine:
    """Continuous batching over `max_batch` rows of at most `max_seq_len` tokens each (prompt
    and output; default the model's context). `stop_ids` end a request (default the model's
    EOS ids); `cache_dtype` and `decode_impl` are `generate`'s; `steps_per_dispatch` decode
    steps run per program; prompts are prefilled in chunks of `prefill_chunk` tokens (a power
    of two); `prefix_cache_bytes` (per device) hold full chunks of earlier prompts (0: none);
    at most `max_queue` requests (or groups) wait for a row (`submit` raises QueueFull beyond
    that). Parameters on a mesh decode under `mesh_config`'s rules. `speculate="ngram"`
    decodes by prompt lookup, `draft=(draft_config, draft_params)` (or `speculate="draft"`
    with it) by a draft model (`num_speculative_tokens`, `ngram` and `min_accepted` as for
    `generate`): each dispatch then runs `steps_per_dispatch` rounds. A draft prefills each
    prompt whole into its own cache (the prefix cache holds the model's chunks only)."""

    def __init__(self, config: ModelConfig, params: Params, *, max_batch: int = 8,
                 max_seq_len: int | None = None, stop_ids: Sequence[int] | None = None,
                 cache_dtype=None, decode_impl: str = "auto",
                 steps_per_dispatch: int = SERVING_STEPS_PER_DISPATCH,
                 prefill_chunk: int = SERVING_PREFILL_CHUNK, prefix_cache_bytes: int = 0,
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
        impl = resolve_decode_impl(decode_impl, params, rows_cache_bytes(
            config, params, max_batch, self.max_len, self.cache_dtype, mesh_config, draft))
        self.params = decoder_params(params, impl)
        self.draft_params = None if draft is None else decoder_params(draft[1], impl)
        self.layout = "stacked" if impl == "scan" else "per_layer"
        self.stop_ids = stop_table(config, stop_ids)
        # What a dispatch may advance a row by, and the positions past its end a round writes
        # (a verify pass's guesses).
        self.advance = self.steps * (1 + (self.spec.k if self.spec else 0))
        self.past_end = self.spec.k if self.spec else 0
        # Speculating rows keep the cache at its largest: a verify pass's sums over the cache
        # positions round differently at another length, and a request's log-probabilities
        # would depend on the requests before it.
        self.min_len = self.max_len if self.spec else min(self.max_len, MIN_CACHE_LEN)
        self.prefill_chunk = prefill_chunk
        self.prefix_blocks = prefix_cache_blocks(
            prefix_cache_bytes, prefix_block_bytes(config, params, prefill_chunk,
                                                   self.cache_dtype, mesh_config),
            prefill_chunk, self.max_seq_len)
        self._index: PrefixIndex | None = None
        self.counters: collections.Counter = collections.Counter()
        self._queue: queue.Queue[list[Request]] = queue.Queue(max_queue)
        self._held: list[Request] | None = None  # a group waiting for enough free rows
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
        self._reset_pool()

    # ------------------------------------------------------------------ the rows on the host

    def _reset(self) -> None:
        """Empty rows on a cache of the fewest positions."""
        B, config = self.max_batch, self.config
        self.cache_len = self.min_len
        self.rows = self._run(programs.empty_rows, np.asarray(self.stop_ids, np.int32),
                              config=config, batch=B, max_len=self.cache_len,
                              cache_dtype=self.cache_dtype, layout=self.layout,
                              spec=self.spec, placement=self.placement)
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

    def _reset_pool(self) -> None:
        """An empty prefix cache."""
        if not self.prefix_blocks:
            self.pool, self._index = None, None
            return
        self.pool = self._run(prefix_pool.empty_pool, config=self.config,
                              blocks=self.prefix_blocks, block_len=self.prefill_chunk,
                              cache_dtype=self.cache_dtype, layout=self.layout,
                              placement=self.placement)
        self._index = PrefixIndex(self.prefix_blocks, self.prefill_chunk, self.cache_dtype)

    def _size_for(self, n: int) -> int:
        return min(max(bucket(n), self.min_len), self.max_len)

    def _room(self, b: int) -> int:
        """The cache positions row `b` may write up to in the next dispatch."""
        return min(self.end_bound[b] + self.advance, self.last_end[b]) + self.past_end

    def _fit(self, need: int = 0) -> None:
        """Resizes the cache (at its end: every row starts at position 0) to hold `need`
        positions and the next dispatch of every row decoding: grown to the next size when
        short, cut when half of it would do."""
        need = max([need, *(self._room(b) for b in range(self.max_batch) if self._decoding(b))])
        size = self._size_for(need)
        if size > self.cache_len or size * 2 <= self.cache_len:
            self._resize(size)

    def _resize(self, size: int) -> None:
        if size != self.cache_len:
            self.rows = self._run(programs.resize, self.rows, max_len=size)
            self.cache_len = size

    # --------------------------------------------------------------------------- programs

    def _run(self, fn, *args, **static):
        """`fn(*args, **static)`, compiled once per static arguments and argument shapes (and
        shardings: on a mesh, programs lay out their outputs by the sharding rules)."""
        key = (fn, tuple(sorted(static.items())), tuple(
            (np.shape(x), jnp.result_type(x), getattr(x, "sharding", None))
            for x in jax.tree.leaves(args)))
        if key not in self._executables:
            start = time.perf_counter()
            with warnings.catch_warnings():  # a resize cannot reuse the donated buffers
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                self._executables[key] = fn.lower(*args, **static).compile()
            log.info("compiled %s %s in %.1f s", fn.__name__,
                     {k: v for k, v in static.items() if k not in ("config", "placement")},
                     time.perf_counter() - start)
        return self._executables[key](*args)

    def _prefill_chunk(self, one: KVCache | None, tokens_1L: np.ndarray, last: int,
                       next_1L: np.ndarray | None, start: int, draft: bool = False):
        """A chunk of a prompt prefilled by the model (or by the draft model)."""
        self.counters["prefill_chunks"] += not draft
        config, params = ((self.spec.draft_config, self.draft_params) if draft
                          else (self.config, self.params))
        return self._run(programs.prefill_chunk, params, one, tokens_1L, np.int32(last),
                         next_1L, config=config,
                         max_len=chunk_capacity(start, tokens_1L.shape[1]),
                         cache_dtype=self.cache_dtype, layout=self.layout,
                         placement=self.placement)

    def _draft_prefill(self, prompt: Sequence[int]) -> KVCache | None:
        """The draft model's cache of the whole prompt, chunk by chunk as the model's (None
        without a draft)."""
        if self.draft_params is None:
            return None
        one = None
        for start, L in chunk_plan(len(prompt), 0, self.prefill_chunk, self.max_seq_len):
            real = prompt[start:start + L]
            tokens_1L = np.zeros((1, L), np.int32)
            tokens_1L[0, :len(real)] = real
            one = self._prefill_chunk(one, tokens_1L, len(real) - 1, None, start, draft=True)[0]
        return one

    def _insert(self, b: int, one: KVCache, logits_1V: jax.Array, max_new: int,
                sampling: SamplingParams, key_1: jax.Array, prompt: Sequence[int],
                draft_one: KVCache | None = None) -> Emitted:
        prompt_1S = None
        if self.spec:  # the guesses read the row's tokens beside its cache
            prompt_1S = np.zeros((1, self.cache_len), np.int32)
            prompt_1S[0, :len(prompt)] = prompt
        self.rows, first = self._run(programs.insert, self.rows, one, logits_1V, np.int32(b),
                                     np.int32(max_new), sampling, key_1, prompt_1S, draft_one)
        return first

    def _restore(self, blocks: list[int]) -> KVCache:
        """The prefill cache of the chunks in `blocks`, as the chunk before the next leaves it
        (a program per its capacity: `blocks` is padded to fill it)."""
        C = self.prefill_chunk
        max_len = chunk_capacity(0, len(blocks) * C)
        blocks_N = np.zeros(max_len // C, np.int32)
        blocks_N[:len(blocks)] = blocks
        return self._run(prefix_pool.restore, self.pool, blocks_N, np.int32(len(blocks)),
                         block_len=C, max_len=max_len)

    def _store(self, one: KVCache, chunk: int, block: int) -> None:
        self.pool = self._run(prefix_pool.store, self.pool, one, np.int32(chunk),
                              np.int32(block), block_len=self.prefill_chunk)

    def _decode(self, strategy: Strategy, top: int, verify: bool = False) -> Emitted:
        program, args, spec = ((programs.decode, (), {}) if self.spec is None else (
            programs.speculate, (self.draft_params,), {"spec": self.spec, "verify": verify}))
        self.rows, emitted = self._run(program, self.rows, self.params, *args,
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

    def _start_prefill(self, group: list[Request], rows: list[int]) -> _Prefill:
        """Reserves `rows` for the requests of `group` (one prompt) and restores the longest
        run of its full chunks the prefix cache holds (all but the one holding the last
        token, whose logits must be computed)."""
        prompt, C = group[0].prompt, self.prefill_chunk
        keys, blocks = [], []
        if self._index is not None and not group[0].prompt_logprobs:
            keys = self._index.keys(prompt)
            blocks = self._index.lookup(keys[:(len(prompt) - 1) // C])
            self.counters["prefix_cache_lookups"] += 1
            self.counters["prefix_cache_hits"] += bool(blocks)
            self.counters["prefix_cache_hit_tokens"] += len(blocks) * C
        cached = len(blocks) * C
        job = _Prefill(group, rows, collections.deque(chunk_plan(
            len(prompt), cached, C, self.max_seq_len)), keys, cached)
        if blocks:
            job.cache = self._restore(blocks)
        for b in rows:
            self._reserved[b] = job
        return job

    def _run_chunk(self, job: _Prefill) -> int:
        """Runs the next chunk of `job` (and stores it in the prefix cache if it is a full
        chunk the cache lacks); returns its length."""
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
        job.cache, job.logits, scores = self._prefill_chunk(job.cache, tokens_1L, len(real) - 1,
                                                            next_1L, start)
        if scores is not None:
            job.scores.append(scores)
        chunk = start // self.prefill_chunk
        if chunk < len(job.keys):  # a full chunk of a prompt that reads the cache
            block = self._index.allocate(job.keys[chunk])
            if block is not None:
                self._store(job.cache, chunk, block)
        return L

    def _insert_prefilled(self, job: _Prefill) -> list[_Program]:
        """Writes a prefilled prompt into each of its rows, with each choice's first token."""
        n, programs_ = len(job.prompt), []
        draft_one = self._draft_prefill(job.prompt)
        for b, request in zip(job.rows, job.requests):
            del self._reserved[b]
            if request.cancelled:
                self._finish(request, Chunk([], [], [], finish_reason="cancelled"))
                continue
            key_1 = (row_key(request.seed) if request.key is None else request.key)[None]
            sampling = SamplingParams.broadcast(1, request.temperature, request.top_k,
                                                request.top_p, request.min_p)
            self.end_bound[b], self.last_end[b] = n, n + request.max_tokens - 1
            self._fit(self._room(b))
            first = self._insert(b, job.cache, job.logits, request.max_tokens, sampling, key_1,
                                 job.prompt, draft_one)
            self.owners[b] = request
            self.inserted_before[b] = self.programs_dispatched
            self.dispatched[b] = 1
            request.cached_tokens = job.cached
            programs_.append(_Program(first, [request], job.scores or None))
        return programs_

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
        """Forgets a prompt being prefilled and frees the rows it reserved."""
        with contextlib.suppress(ValueError):
            self._jobs.remove(job)
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
        self._fit()
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
        chunk, the prefix cache's copies, and at every cache size: decode greedy, sampling and
        sampling with top-k/top-p (top log-probabilities and prompt scores compile when first
        asked for), inserting every prefilled length that fits, and resizing to every other
        size. The rows and the prefix cache are left empty."""
        start = time.perf_counter()
        sizes = sorted({self._size_for(n) for n in range(1, self.max_len + 1)})
        C = self.prefill_chunk
        sampling, key_1 = SamplingParams.broadcast(1), jax.random.key(0)[None]
        # A chunk program per capacity before and after it, and length (the start is an
        # input); each takes a cache of its capacity before from an earlier chunk. A draft
        # model's chunks have the same shapes.
        # a prefilled cache of each capacity, its logits, and the draft's cache
        after: dict[int, tuple] = {}
        compiled = set()
        for start_, L in chunk_shapes(C, self.max_seq_len):
            before = chunk_capacity(0, start_) if start_ else None
            program = (before, L, chunk_capacity(start_, L))
            if program in compiled:
                continue
            compiled.add(program)
            one, _, draft_one = (None,) * 3 if before is None else after[before]
            tokens_1L = np.zeros((1, L), np.int32)
            if self.draft_params is not None:
                draft_one = self._prefill_chunk(draft_one, tokens_1L, L - 1, None, start_,
                                                draft=True)[0]
            after[program[2]] = (*self._prefill_chunk(one, tokens_1L, L - 1, None, start_)[:2],
                                 draft_one)
        if self.pool is not None:
            for k in range(1, (self.max_seq_len - 1) // C + 1):
                self._restore([0] * k)
                self._store(after[chunk_capacity(0, k * C)][0], k - 1, 0)
        # The prefilled caches an insert meets, each with the shortest prompt it holds.
        shortest: dict[int, tuple[int, tuple]] = {}
        for n in range(self.max_seq_len - 1, 0, -1):
            capacity = chunk_capacity(*chunk_plan(n, 0, C, self.max_seq_len)[-1])
            shortest[capacity] = (n, after[capacity])
        for size in sizes:
            self._resize(size)
            for n, (one, logits, draft_one) in shortest.values():
                if n <= size:
                    self._insert(0, one, logits, 1, sampling, key_1, [0] * n, draft_one)
            for draw, sort in ((False, False), (True, False), (True, True)):
                for verify in (False, True) if self.spec else (False,):
                    self._decode(Strategy(draw, sort), top=0, verify=verify)
            for other in sizes:  # to every other size and back
                self._resize(other)
                self._resize(size)
        jax.block_until_ready(self.rows)
        self.counters.clear()
        self._reset()
        self._reset_pool()
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
        if self._stopping.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self._queue.put_nowait(list(requests))
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are waiting already") from None
        self._wake.set()

    def stats(self) -> dict:
        """Rows in use, requests (or groups) waiting, requests finished by reason, tokens
        generated, and the counters of prefill chunks and prefix cache lookups, hits and
        tokens restored."""
        return {"slots": self.max_batch, "slots_in_use": sum(r is not None for r in self.owners),
                "queued": self._queue.qsize() + (self._held is not None),
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
                and all(r is None for r in self.owners))

    def _admit(self) -> None:
        """Starts prefilling waiting groups, in order, while the rows free for them suffice:
        rows neither reserved nor decoding (or that will be free once the programs dispatched
        so far have run; their tokens are read from those programs)."""
        free = [b for b in range(self.max_batch)
                if not self._decoding(b) and b not in self._reserved]
        while free:
            group = self._held or self._next_group()
            if group is None:
                return
            if len(group) > len(free):
                self._held = group  # first come, first served: wait for rows
                return
            self._held = None
            rows, free = free[:len(group)], free[len(group):]
            try:
                self._jobs.append(self._start_prefill(group, rows))
            except Exception as e:
                log.exception("prefill failed")
                for b in rows:
                    self._reserved.pop(b, None)
                self._recover(group, e)

    def _next_group(self) -> list[Request] | None:
        """The next group's requests not cancelled (those cancelled finish here)."""
        while True:
            try:
                group = self._queue.get_nowait()
            except queue.Empty:
                return None
            for request in group:
                if request.cancelled:
                    self._finish(request, Chunk([], [], [], finish_reason="cancelled"))
            group = [r for r in group if not r.cancelled]
            if group:
                return group

    def _recover(self, touched, error: BaseException) -> None:
        """After a failed program: fails the requests it touched and, if the rows were lost
        with it (donated to a program that did not finish), every request in them; a lost
        prefix cache starts empty."""
        self._fail(touched, error)
        if any(x.is_deleted() for x in jax.tree.leaves(self.rows)):
            self._fail(self.owners, error)
            self._reset()
        if any(x.is_deleted() for x in jax.tree.leaves(self.pool)):
            self._reset_pool()

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
        drained = [*(self._held or []), *(r for job in self._jobs for r in job.requests)]
        for job in list(self._jobs):
            self._drop(job)
        self._held = None
        with contextlib.suppress(queue.Empty):
            while True:
                drained.extend(self._queue.get_nowait())
        return drained
