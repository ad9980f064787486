"""Continuous batching: a fixed set of decode rows that requests enter and leave while the
others keep decoding.

    engine = Engine(config, params, max_batch=8, stop_ids=config.stop_ids)
    engine.warm_up(); engine.start()
    engine.submit(Request(prompt=[1, 415, 2936], max_tokens=64, deliver=print))

The rows are `decode/rows.py`'s and their device programs `decode/batching.py`'s; this is the
host side, in parts: the programs compiled and the rows they advance (`programs.py`), the
pages (`allocator.py`), the prompts being prefilled (`prefill.py`), speculation's auto-off
(`verify_policy.py`) and what requests are handed (`requests.py`); here are the queue,
admission, the rows' ends, dispatch and delivery. The engine thread, between programs:
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
hold the rows' pages, by default as many as `max_batch` rows of `max_seq_len` need; the
server's shape is `plan/serving.py`'s `ServerShape`): each
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
from typing import Sequence

import jax
import numpy as np

from llama_jax.config import MeshConfig, ModelConfig, cache_dtype_name
from llama_jax.decode.batching import TOP_LOGPROBS
from llama_jax.decode.decoder import (decoder_params, resolve_decode_impl, rows_cache_bytes,
                                      server_shape)
from llama_jax.decode.grammar import ALL_ALLOWED, Constrained
from llama_jax.decode.rows import Emitted, row_key
from llama_jax.decode.sampling import SamplingParams, Strategy
from llama_jax.decode.speculate import speculation
from llama_jax.decode.step import stop_table
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import pages_for
from llama_jax.model.params import Params
from llama_jax.parallel import sharding, target
from llama_jax.plan.costs import (SERVING_PAGE_SIZE, SERVING_PREFILL_CHUNK,
                                  SERVING_STEPS_PER_DISPATCH)
from llama_jax.serve.allocator import Allocator
from llama_jax.serve.prefill import PrefillJob, PrefillQueue
from llama_jax.serve.programs import Programs
from llama_jax.serve.requests import (Chunk, QueueFull, Request, add_prompt_scores,
                                      check_request, read_row)
from llama_jax.serve.verify_policy import VerifyPolicy
from llama_jax.shapes import bucket

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
                           "again) when the KV cache's pages ran short",
            "constrained_requests": "Requests decoded under a grammar (response_format)",
            "grammar_mask_seconds": "Host time spent computing constrained rows' token masks"}


@dataclasses.dataclass
class _Program:
    """A dispatched program's outputs and the request each row held when it was dispatched."""

    emitted: Emitted
    owners: list[Request | None]
    prompt: list[Emitted] | None = None  # a prefill's prompt scores per chunk, if asked for
    number: int | None = None  # a decode program's, counted from 0


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
        self.cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)
        self.spec = speculation(config, speculate, num_speculative_tokens, ngram, draft,
                                max_batch, min_accepted, target.platform_of_tree(params))
        mesh = sharding.mesh_of(params)
        placement = None if mesh is None else (mesh, mesh_config or MeshConfig())
        if draft is not None and placement is not None:
            raise GenerateError("a server's draft model decodes on one device: serve it "
                                "without a mesh, or speculate by prompt lookup")
        self.shape = shape = server_shape(
            config, params, self.cache_dtype, mesh_config, draft, max_batch=max_batch,
            max_seq_len=max_seq_len, steps=steps_per_dispatch, prefill_chunk=prefill_chunk,
            page_size=page_size, speculative_tokens=self.spec.k if self.spec else 0,
            kv_cache_bytes=kv_cache_bytes, prefix_cache_bytes=prefix_cache_bytes)
        self.max_batch, self.max_seq_len = shape.max_batch, shape.max_seq_len
        impl = resolve_decode_impl(decode_impl, params, rows_cache_bytes(
            config, params, shape.n_pages, shape.page_size, self.cache_dtype, mesh_config,
            draft))
        self.layout = "stacked" if impl == "scan" else "per_layer"
        self.stop_ids = stop_table(config, stop_ids)
        self.programs = Programs(config, decoder_params(params, impl),
                                 None if draft is None else decoder_params(draft[1], impl),
                                 shape, self.stop_ids, self.cache_dtype, self.layout, self.spec,
                                 placement)
        # Speculating rows attend over every position: a verify pass's sums over them round
        # differently at another width, and a request's log-probabilities would depend on
        # the requests before it.
        self.min_len = shape.cache_len if self.spec else min(shape.cache_len, MIN_CACHE_LEN)
        self.counters: collections.Counter = collections.Counter()
        self._queue: queue.Queue[list[Request]] = queue.Queue(max_queue)
        self._requeued: collections.deque[list[Request]] = collections.deque()  # preempted
        self._held: list[Request] | None = None  # a group waiting for enough rows or pages
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._abort = threading.Event()  # the drain timed out: fail what is left
        self._wake = threading.Event()
        self.finished: collections.Counter = collections.Counter()  # requests by how they ended
        self.generated_tokens = 0
        self._reset()

    # ------------------------------------------------------------------ the rows on the host

    def _reset(self) -> None:
        """The host's side of empty rows over an empty pool, and no prefix cached."""
        B = self.max_batch
        self.width = pages_for(self.min_len, self.shape.page_size)
        self.allocator = Allocator(self.shape, self.cache_dtype)
        self.prefills = PrefillQueue(self.programs, self.allocator, self.counters)
        self.verify = None if self.spec is None else VerifyPolicy(self.spec, B)
        self.owners: list[Request | None] = [None] * B
        self.dispatched = [0] * B  # each row's tokens once the programs dispatched have run
        # Each row's cache end at most, once the programs dispatched have run, and at its
        # request's last token.
        self.end_bound = [0] * B
        self.last_end = [0] * B
        self.programs_dispatched = 0
        self.inserted = 0  # requests inserted so far: each row's number among them is its age
        self.inserted_at = [0] * B

    def _size_for(self, n: int) -> int:
        return min(max(bucket(n), self.min_len), self.shape.cache_len)

    def _room(self, b: int) -> int:
        """The cache positions row `b` may write up to in the next dispatch (a verify pass
        writes its guesses past the row's end)."""
        # a constrained step may run two forwards (the first, and the next step's)
        advance = max(self.shape.advance, 2) if self._constrained() else self.shape.advance
        return min(self.end_bound[b] + advance, self.last_end[b]) + self.shape.speculative_tokens

    def _demands(self) -> list[tuple[Request, int]]:
        """Each row decoding's request, and the positions its next dispatch may write."""
        return [(self.owners[b], self._room(b)) for b in range(self.max_batch)
                if self._decoding(b)]

    def _grow(self) -> None:
        """Gives every row decoding the pages its next dispatch may write (letting go of
        cached prefixes, then preempting the newest rows, while the pool is short), and sets
        the table width to hold them."""
        while not self.allocator.make_room(self._demands()):
            decoding = [b for b in range(self.max_batch) if self._decoding(b)]
            self._preempt(max(decoding, key=lambda b: self.inserted_at[b]))
        demands = self._demands()
        self.allocator.grow(demands)
        most = max((positions for _, positions in demands), default=0)
        self.width = pages_for(self._size_for(most), self.shape.page_size)

    def _preempt(self, b: int) -> None:
        """Gives back row `b`'s pages and queues its request again, first: it will be
        prefilled and decoded anew, the tokens it has had skipped. Its row decodes on over no
        pages (writing nothing) until another request takes it."""
        request = self.owners[b]
        self.owners[b] = None
        self.allocator.release(request)
        self._requeued.append([request])
        self.counters["preemptions"] += 1
        log.info("preempted a request after %d tokens: the KV cache's pages ran short",
                 request.generated)

    def _decoding(self, b: int) -> bool:
        """Whether row `b` holds a request that the programs dispatched so far leave short of
        its `max_tokens` (it may still stop earlier)."""
        request = self.owners[b]
        return request is not None and self.dispatched[b] < request.max_tokens

    def _any_decoding(self) -> bool:
        return any(self._decoding(b) for b in range(self.max_batch))

    # ------------------------------------------------------------------ prefill and decode

    def _insert_prefilled(self, job: PrefillJob) -> list[_Program]:
        """Puts a prefilled prompt into each of its rows, with each choice's first token: the
        first choice takes the prompt's pages, each further one shares its full pages and
        copies its last (partial) one into a page of its own."""
        n, programs_ = len(job.prompt), []
        first_choice = True
        for b, request in zip(job.rows, job.requests):
            if request.cancelled:
                self._finish(request, Chunk([], [], [], finish_reason="cancelled"))
                continue
            spare = None if first_choice or not job.spares else job.spares.pop()
            copy = self.allocator.give_choice(job, request, n, spare)
            if copy is not None:
                self.programs.copy_pages([copy[0]], [copy[1]])
            first_choice = False
            key_1 = (row_key(request.seed) if request.key is None else request.key)[None]
            sampling = SamplingParams.broadcast(1, request.temperature, request.top_k,
                                                request.top_p, request.min_p)
            self.end_bound[b], self.last_end[b] = n, n + request.max_tokens - 1
            first = self.programs.insert(b, job.logits, job.prompt, request.max_tokens,
                                         sampling, key_1, self._first_mask(request))
            self.owners[b] = request
            if self.verify is not None:
                self.verify.inserted(b, self.programs_dispatched)
            self.inserted += 1
            self.inserted_at[b] = self.inserted
            self.dispatched[b] = 1
            request.cached_tokens = job.cached
            # Decoding anew after a preemption: skip what it has had (scores included).
            request.replay = request.generated
            request.drafted_tokens = request.accepted_tokens = 0
            scores = None if request.replay else job.scores or None
            programs_.append(_Program(first, [request], scores))
        self.prefills.drop(job)
        return programs_

    def _prefill_some(self, decoding: bool) -> list[_Program]:
        """Runs the admitted prompts' chunks, first come first: about `prefill_chunk` tokens
        of them while rows are decoding (at least one chunk), else until one prompt is done.
        Returns the first tokens of the prompts done."""
        spent, done = 0, []
        jobs = self.prefills.jobs
        while jobs and (spent < self.shape.prefill_chunk or (not decoding and not done)):
            job = jobs[0]
            try:
                spent += self.prefills.run_chunk(job)
                if not job.chunks:
                    jobs.popleft()
                    done += self._insert_prefilled(job)
            except Exception as e:
                log.exception("prefill failed")
                self.prefills.drop(job)
                self._recover(job.requests, e)
        return done

    def _first_mask(self, request: Request) -> np.ndarray | None:
        """A constrained request's mask for its first token, its grammar back at its start
        (a preempted request decodes anew); None for one without a grammar."""
        if request.matcher is None:
            return None
        if not request.replay and not request.generated:
            self.counters["constrained_requests"] += 1
        request.matcher.reset()
        return self._masks([request])

    def _masks(self, requests: Sequence[Request | None],
               guessed: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The rows' packed masks `[B, W]` (grammar.py: every token allowed for a row without
        a grammar); with `guessed`, a round's guesses and how many of each row's are real,
        `[B, K + 1, W]` at each position of the round (`Constrained.guessed_masks`). Their
        host time is counted."""
        start = time.perf_counter()
        matchers = [None if r is None else r.matcher for r in requests]
        words = next(m for m in matchers if m is not None).vocab.words
        rows = Constrained(matchers, words, self.stop_ids)
        out = rows.mask() if guessed is None else rows.guessed_masks(*guessed)
        self.counters["grammar_mask_seconds"] += time.perf_counter() - start
        return out

    def _constrained(self) -> bool:
        """Whether a row decoding is under a grammar: it needs each token read before the
        next step's mask, one step a program."""
        return any(self._decoding(b) and self.owners[b].matcher is not None
                   for b in range(self.max_batch))

    def _dispatch(self) -> _Program:
        """`steps` decode steps of every row, under the strategy its requests need (one step
        among the tokens each may take, while a row is constrained)."""
        self._grow()
        live = [r for b, r in enumerate(self.owners) if self._decoding(b)]
        strategy = Strategy(draw=any(r.strategy.draw for r in live),
                            truncate=any(r.strategy.truncate for r in live))
        verify = self.verify is not None and self.verify.worth_verifying(
            self.programs_dispatched, np.asarray([self._decoding(b)
                                                  for b in range(self.max_batch)]))
        rows = [r if self._decoding(b) else None for b, r in enumerate(self.owners)]
        constrained, skipped = self._constrained(), set(self.programs.fresh)
        tables = self.allocator.tables.array(self.owners, self.width)
        top = TOP_LOGPROBS if any(r.top_logprobs for r in live) else 0
        if self.spec is None and (constrained or self.programs.forwarded):
            emitted, advance = self._split_step(rows, constrained, tables, strategy, top)
            steps = 1
        else:
            guessed = (lambda *guesses: self._masks(rows, guesses)) if constrained else None
            emitted = self.programs.decode(tables, strategy, top, verify, guessed)
            # a constrained program: one round of at most k + 1 tokens
            steps, advance = ((1, self.shape.advance // self.shape.steps) if constrained else
                              (self.shape.steps, self.shape.advance))
        self.end_bound = [min(e + advance, last) if self._decoding(b) else e
                          for b, (e, last) in enumerate(zip(self.end_bound, self.last_end))]
        self.dispatched = [n + (b not in skipped) * steps for b, n in enumerate(self.dispatched)]
        self.programs_dispatched += 1
        return _Program(emitted, list(self.owners), number=self.programs_dispatched - 1)

    def _split_step(self, rows: list[Request | None], constrained: bool, tables: np.ndarray,
                    strategy: Strategy, top: int) -> tuple[Emitted, int]:
        """A constrained step in two programs (`Programs.forward`, `Programs.pick`): the pick
        among the masks the host computed while the forward ran, then the next forward, which
        runs while the host reads this pick's tokens and computes the next masks (the first
        forward first). Once no row is constrained, the last forward's pick alone. Returns the
        pick's tokens and the positions the rows advance by (the forwards')."""
        advance = 0
        if not self.programs.forwarded:
            self.programs.forward(tables, strategy)
            advance += 1
        masks_BW = (self._masks(rows) if constrained else np.full(
            (self.max_batch, -(-self.config.vocab_size // 32)), ALL_ALLOWED, np.int32))
        emitted = self.programs.pick(masks_BW, strategy, top)
        if constrained:
            self.programs.forward(tables, strategy)
            advance += 1
        return emitted, advance

    def widths(self) -> list[int]:
        """The table widths (pages) a program may attend over."""
        return sorted({pages_for(self._size_for(n), self.shape.page_size)
                       for n in range(1, self.shape.cache_len + 1)})

    def warm_up(self) -> float:
        """Compiles the programs a server meets (`Programs.warm_up`, at every table width)
        and returns the seconds it took. The rows and the pool are left empty."""
        start = time.perf_counter()
        self.programs.warm_up(self.widths())
        self.counters.clear()
        self._reset()
        return time.perf_counter() - start

    # --------------------------------------------------------------------------- requests

    def check(self, request: Request) -> None:
        """Raises GenerateError, naming the lengths or the value, if `request` cannot run."""
        check_request(request, self.config.vocab_size, self.max_seq_len)

    def submit(self, request: Request) -> None:
        """Queues `request` (raises QueueFull when `max_queue` requests already wait, or
        GenerateError if it cannot run)."""
        self.submit_group([request])

    def submit_group(self, requests: Sequence[Request]) -> None:
        """Queues requests for one prompt (a prompt's `n` choices) that are prefilled once,
        together, when as many rows are free; each then decodes with its own settings and
        key. Raises as `submit` does, or GenerateError if they differ in prompt or in
        scoring it, or are more than the rows, or their pages more than the pool's."""
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
        pages = self.allocator.prompt_pages(n, len(requests))
        if pages > self.shape.n_pages:
            raise GenerateError(f"{len(requests)} choices of a prompt of {n} tokens need "
                                f"{pages} pages of the KV cache's {self.shape.n_pages}")
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
                                     + len(self.prefills.requests())),
                "kv_pages_total": self.shape.n_pages,
                "kv_pages_used": self.allocator.pool.used,
                "finished": dict(self.finished), "generated_tokens": self.generated_tokens,
                "prefix_cache_blocks": self.shape.prefix_blocks,
                "prefix_cache_blocks_used": self.allocator.cached_blocks,
                **{name: self.counters[name] for name in COUNTERS}}

    def _finish(self, request: Request, chunk: Chunk) -> None:
        request.finished = True
        self.finished["error" if chunk.error is not None else chunk.finish_reason] += 1
        for b, owner in enumerate(self.owners):
            if owner is request:
                self.owners[b] = None
        self.allocator.release(request)
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
            self.verify.read(program.number, e.hit_rate_B)
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
            before = request.generated
            chunk, reason = read_row(e, b, request, stops)
            self.generated_tokens += request.generated - before
            if program.prompt is not None:
                add_prompt_scores(chunk, jax.device_get(program.prompt), request)
            if (chunk.tokens or chunk.prompt_logprobs is not None) and \
                    self._deliver(request, chunk) and not request.finished:
                reason = "stop"
            if request.cancelled and reason is None:
                reason = "cancelled"
            if reason is not None and not request.finished:
                self._finish(request, Chunk([], [], [], finish_reason=reason))

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
        return (self._queue.empty() and self._held is None and not self.prefills.jobs
                and not self._requeued and all(r is None for r in self.owners))

    def _admit(self) -> None:
        """Starts prefilling waiting groups, in order (preempted requests first), while the
        rows and pages free for them suffice: rows neither reserved nor decoding (or that
        will be free once the programs dispatched so far have run; their tokens are read
        from those programs), pages beside those the rows decoding take next."""
        free = [b for b in range(self.max_batch)
                if not self._decoding(b) and b not in self.prefills.reserved]
        while free:
            group = self._held or self._next_group()
            if group is None:
                return
            self._held = group  # first come, first served: it waits for rows and pages
            if len(group) > len(free):
                return
            try:
                job = self.prefills.start(group, free[:len(group)], self._demands())
            except Exception as e:
                log.exception("prefill failed")
                self._held = None
                self._recover(group, e)
                continue
            if job is None:
                return
            self._held, free = None, free[len(group):]

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
        if self.programs.lost():
            # The pool went with them: the prompts being prefilled too.
            self._fail([*self.owners, *self.prefills.requests()], error)
            self.prefills.clear()
            self.programs.reset()
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
            constrained = self._constrained()
            while constrained and pending:  # the next masks follow every token so far
                self._collect_next(pending)
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
                self._collect_next(pending)
            if not pending and self.idle() and not self._stopping.is_set():
                self._wake.wait(0.5)
                self._wake.clear()

    def _collect_next(self, pending: collections.deque[_Program]) -> None:
        program = pending.popleft()
        try:
            self._collect(program)
        except Exception as e:
            log.exception("a program failed")
            self._recover(program.owners, e)

    def _drain_queue(self) -> list[Request]:
        """Every request waiting or being prefilled, taken off the engine."""
        drained = [*(self._held or []), *self.prefills.requests(),
                   *(r for group in self._requeued for r in group)]
        self._requeued.clear()
        for job in list(self.prefills.jobs):
            self.prefills.drop(job)
        self._held = None
        with contextlib.suppress(queue.Empty):
            while True:
                drained.extend(self._queue.get_nowait())
        return drained
