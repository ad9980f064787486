"""Continuous batching: a fixed set of decode slots that requests enter and leave while the
others keep decoding.

    engine = Engine(config, params, max_batch=8, stop_ids=config.stop_ids)
    engine.warm_up(); engine.start()
    engine.submit(Request(prompt=[1, 415, 2936], max_tokens=64, deliver=print))

The slots and their device programs are `decode/slots.py`'s; this is the host side. The engine
thread, between programs:
- admits a waiting request into a free row: its prompt is padded to a bucketed length T and
  prefilled into a one-row cache (`slots.prefill`, which also samples the first token) that is
  written over the row (`slots.insert`);
- runs `steps_per_dispatch` decode steps for every row in one program (`slots.decode`), and
  reads the previous program's tokens while this one runs; it hands each request its tokens
  (`deliver`), and frees a row once its request has stopped, asked to stop (a stop string) or
  been cancelled; a row whose request will have all its `max_tokens` once the programs
  dispatched so far have run is free at once, before their tokens are read (the host counts
  them). Rows that stopped mid-dispatch idle on the device until then.

The rows share the cache's write slot `end` (each row's sequence ends there; `start` marks where
it begins). A prompt of T padded tokens needs end >= T, and K decode steps need K free slots
after `end`, so before each program the host arranges the slots (`_arrange`): it moves every
row's slots (`slots.rearrange`) so that `end` is far enough along, or back to the start of
the longest row in use; and it resizes the cache to a power of two that holds the rows in use
plus the next steps, between `MIN_SLOTS` and the context plus slack. A step reads every slot,
so short requests decode as fast as in a small cache. The host mirrors `end`, the size and each
row's start; programs are compiled per size (and prompt bucket), once.

A request's tokens do not depend on its companions: rows never mix (MoE decodes without
dropping), its position is its slot minus its start, and its sampling key for step s is
`fold_in(key, s)` of its own key: with `key(seed)`, the key `generate` uses for a one-prompt
batch, so a seeded request samples what `generate(..., seed=seed)` samples alone.
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
from llama_jax.decode import slots as programs
from llama_jax.decode.decoder import (cache_bytes_per_device, decoder_params,
                                      resolve_decode_impl)
from llama_jax.decode.generate import NO_TOKEN, bucket
from llama_jax.decode.sampling import SamplingParams, Strategy
from llama_jax.decode.slots import TOP_LOGPROBS, Emitted
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import KVCache
from llama_jax.model.params import Params
from llama_jax.parallel import sharding
from llama_jax.plan.costs import SERVING_STEPS_PER_DISPATCH, serving_cache_slots

log = logging.getLogger("llama_jax.serve")

MIN_SLOTS = 64  # the smallest cache the slots shrink to


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
    request's sampling key (default `key(seed)`)."""

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
    prompt: Emitted | None = None  # a prefill's prompt log-probabilities, if asked for


class Engine:
    """Continuous batching over `max_batch` rows of at most `max_seq_len` tokens each (prompt
    and output; default the model's context). `stop_ids` end a request (default the model's
    EOS ids); `cache_dtype` and `decode_impl` are `generate`'s; `steps_per_dispatch` decode
    steps run per program; at most `max_queue` requests wait for a row (`submit` raises
    QueueFull beyond that). Parameters on a mesh decode under `mesh_config`'s rules."""

    def __init__(self, config: ModelConfig, params: Params, *, max_batch: int = 8,
                 max_seq_len: int | None = None, stop_ids: Sequence[int] | None = None,
                 cache_dtype=None, decode_impl: str = "auto",
                 steps_per_dispatch: int = SERVING_STEPS_PER_DISPATCH, max_queue: int = 64,
                 mesh_config: MeshConfig | None = None):
        self.config = config
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len or config.max_seq_len
        if not 1 <= self.max_seq_len <= config.max_seq_len:
            raise GenerateError(f"max_seq_len={self.max_seq_len} must be in [1, "
                                f"{config.max_seq_len}] (the model's context)")
        if max_batch < 1 or steps_per_dispatch < 1:
            raise GenerateError(f"max_batch={max_batch} and steps_per_dispatch="
                                f"{steps_per_dispatch} must be >= 1")
        self.steps = steps_per_dispatch
        self.cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)
        self.max_slots = serving_cache_slots(self.max_seq_len, self.steps)
        impl = resolve_decode_impl(decode_impl, params, cache_bytes_per_device(
            config, params, max_batch, self.max_slots, self.cache_dtype, mesh_config))
        self.params = decoder_params(params, impl)
        self.layout = "stacked" if impl == "scan" else "per_layer"
        mesh = sharding.mesh_of(params)
        self.placement = None if mesh is None else (mesh, mesh_config or MeshConfig())
        ids = config.stop_ids if stop_ids is None else stop_ids
        self.stop_ids = [int(t) for t in ids if 0 <= int(t) < config.vocab_size] or [NO_TOKEN]
        self.min_slots = min(self.max_slots, MIN_SLOTS)
        self._queue: queue.Queue[Request] = queue.Queue(max_queue)
        self._executables: dict = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._abort = threading.Event()  # the drain timed out: fail what is left
        self._wake = threading.Event()
        self.finished: collections.Counter = collections.Counter()  # requests by how they ended
        self.generated_tokens = 0
        self._reset()

    # ----------------------------------------------------------------- the slots on the host

    def _reset(self) -> None:
        """Empty rows on a cache of the smallest size."""
        B, config = self.max_batch, self.config
        self.slots = self._run(programs.empty_slots, np.asarray(self.stop_ids, np.int32),
                               config=config, batch=B, max_len=self.min_slots,
                               cache_dtype=self.cache_dtype, layout=self.layout,
                               placement=self.placement)
        self.owners: list[Request | None] = [None] * B
        self.dispatched = [0] * B  # each row's tokens once the programs dispatched have run
        self.end, self.size = 0, self.min_slots
        self.row_start = [0] * B  # each row's first slot

    def _size_for(self, n: int) -> int:
        return min(max(bucket(n), self.min_slots), self.max_slots)

    def _arrange(self, min_end: int) -> None:
        """Makes `end >= min_end` with `steps` free slots after it: moves every row's slots
        (later; or back to the start of the longest row in use, when the cache would
        otherwise grow or could halve) and resizes the cache to fit."""
        rows = [self.row_start[b] for b in range(self.max_batch) if self._decoding(b)]
        first = min(rows, default=self.end)  # where the longest row in use starts
        end = max(self.end, min_end) if rows else min_end
        size = self.size
        compact_end = max(self.end - first, min_end)
        if end + self.steps > size or self._size_for(compact_end + self.steps) * 2 <= size:
            end = compact_end
            size = self._size_for(end + self.steps)
        if end + self.steps > size:
            raise AssertionError(f"no room: end {end} + {self.steps} steps > {size} slots")
        self._place(end, size)

    def _place(self, end: int, size: int) -> None:
        """Moves every row's slots so that `end` is the next to write, in `size` slots."""
        if end == self.end and size == self.size:
            return
        shift = end - self.end
        self.slots = self._run(programs.rearrange, self.slots, np.int32(shift), max_len=size)
        self.row_start = [s + shift for s in self.row_start]
        self.end, self.size = end, size

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

    def _prefill(self, prompt_1T, n, sampling, key_1, score_prompt: bool = False):
        return self._run(programs.prefill, self.params, prompt_1T, n, sampling, key_1,
                         config=self.config, cache_dtype=self.cache_dtype, layout=self.layout,
                         placement=self.placement, score_prompt=score_prompt)

    def _insert(self, b: int, one: KVCache, first: Emitted, max_new: int,
                sampling: SamplingParams, key_1: jax.Array) -> None:
        self.slots = self._run(programs.insert, self.slots, one, first, np.int32(b),
                               np.int32(max_new), sampling, key_1)

    def _decode(self, strategy: Strategy, top: int) -> Emitted:
        self.slots, emitted = self._run(programs.decode, self.slots, self.params,
                                        config=self.config, n_steps=self.steps,
                                        strategy=strategy, top=top, placement=self.placement)
        return emitted

    def _admit_into(self, b: int, request: Request) -> _Program:
        """Prefills `request` and inserts it into row `b`."""
        n = len(request.prompt)
        T = min(bucket(n), self.max_seq_len)
        prompt_1T = np.zeros((1, T), np.int32)
        prompt_1T[0, T - n:] = request.prompt
        key_1 = (jax.random.key(request.seed) if request.key is None else request.key)[None]
        sampling = SamplingParams.broadcast(1, request.temperature, request.top_k,
                                            request.top_p, request.min_p)
        one, first, prompt = self._prefill(prompt_1T, np.int32(n), sampling, key_1,
                                           request.prompt_logprobs)
        self._arrange(T)
        self._insert(b, one, first, request.max_tokens, sampling, key_1)
        self.row_start[b] = self.end - n
        self.owners[b] = request
        self.dispatched[b] = 1
        return _Program(first, [request], prompt)

    def _decoding(self, b: int) -> bool:
        """Whether row `b` holds a request that the programs dispatched so far leave short of
        its `max_tokens` (it may still stop earlier)."""
        request = self.owners[b]
        return request is not None and self.dispatched[b] < request.max_tokens

    def _dispatch(self) -> _Program:
        """`steps` decode steps of every row, under the strategy its requests need."""
        self._arrange(0)
        live = [r for b, r in enumerate(self.owners) if self._decoding(b)]
        strategy = Strategy(draw=any(r.strategy.draw for r in live),
                            sort=any(r.strategy.sort for r in live))
        emitted = self._decode(strategy, TOP_LOGPROBS if any(r.top_logprobs for r in live) else 0)
        self.end += self.steps
        self.dispatched = [n + self.steps for n in self.dispatched]
        return _Program(emitted, list(self.owners))

    def warm_up(self) -> float:
        """Compiles the programs a server meets and returns the seconds it took: prefill at
        every prompt bucket; at every cache size, decode greedy, sampling and sampling with
        top-k/top-p (top log-probabilities compile when first asked for), inserting every
        bucket that fits, and resizing to every other size. The rows are left empty."""
        start = time.perf_counter()
        sizes = sorted({self._size_for(n) for n in range(1, self.max_slots + 1)})
        buckets = sorted({min(bucket(n), self.max_seq_len) for n in range(1, self.max_seq_len)})
        sampling, key_1 = SamplingParams.broadcast(1), jax.random.key(0)[None]
        prefilled = [self._prefill(np.zeros((1, T), np.int32), np.int32(1), sampling, key_1)
                     for T in buckets]
        for size in sizes:
            for T, (one, first, _) in zip(buckets, prefilled):
                if T + self.steps <= size:
                    self._place(T, size)
                    self._insert(0, one, first, 1, sampling, key_1)
            self._place(0, size)
            for draw, sort in ((False, False), (True, False), (True, True)):
                self._decode(Strategy(draw, sort), top=0)
            for other in sizes:
                self._place(0, other)
                self._place(0, size)
        jax.block_until_ready(self.slots)
        self._reset()
        return time.perf_counter() - start

    # --------------------------------------------------------------------------- requests

    def check(self, request: Request) -> None:
        """Raises GenerateError, naming the lengths or the value, if `request` cannot run."""
        n, vocab = len(request.prompt), self.config.vocab_size
        if n == 0:
            raise GenerateError("the prompt is empty: it needs at least one token")
        bad = [t for t in request.prompt if not 0 <= int(t) < vocab]
        if bad:
            raise GenerateError(f"the prompt has token id(s) {bad[:5]} outside the vocabulary "
                                f"[0, {vocab})")
        if request.max_tokens < 1:
            raise GenerateError(f"max_tokens={request.max_tokens} must be >= 1")
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
        self.check(request)
        if self._stopping.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are waiting already") from None
        self._wake.set()

    def stats(self) -> dict:
        """Rows in use, requests waiting, requests finished by reason, tokens generated."""
        return {"slots": self.max_batch, "slots_in_use": sum(r is not None for r in self.owners),
                "queued": self._queue.qsize(), "finished": dict(self.finished),
                "generated_tokens": self.generated_tokens}

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
        for b, request in enumerate(program.owners):
            if request is None or request.finished:
                continue
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
    def _prompt_logprobs(chunk: Chunk, prompt: Emitted, request: Request) -> None:
        """The scores of the prompt's tokens after the first (the last n - 1 of the T - 1)."""
        n, top = len(request.prompt), request.top_logprobs
        chunk.prompt_logprobs = prompt.logprobs_BK[0, 1 - n:].tolist() if n > 1 else []
        chunk.prompt_top = [list(zip(ids[:top].tolist(), lps[:top].tolist()))
                            for ids, lps in zip(prompt.top_ids_BKn[0, 1 - n:],
                                                prompt.top_logprobs_BKn[0, 1 - n:])
                            ] if n > 1 else []

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
        return self._queue.empty() and all(r is None for r in self.owners)

    def _admit(self, pending: collections.deque) -> None:
        """Admits waiting requests into the rows that are free, or will be once the programs
        dispatched so far have run (their tokens are read from those programs)."""
        for b in range(self.max_batch):
            if self._decoding(b):
                continue
            request = self._next_request()
            if request is None:
                return
            try:
                pending.append(self._admit_into(b, request))
            except Exception as e:
                log.exception("prefill failed")
                self._recover([request], e)

    def _next_request(self) -> Request | None:
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return None
            if request.cancelled:
                self._finish(request, Chunk([], [], [], finish_reason="cancelled"))
                continue
            return request

    def _recover(self, touched, error: BaseException) -> None:
        """After a failed program: fails the requests it touched and, if the slots were lost
        with it (donated to a program that did not finish), every request in them."""
        self._fail(touched, error)
        if any(x.is_deleted() for x in jax.tree.leaves(self.slots)):
            self._fail(self.owners, error)
            self._reset()

    def _loop(self) -> None:
        pending: collections.deque[_Program] = collections.deque()
        while True:
            if self._abort.is_set():
                self._fail([*self.owners, *self._drain_queue()], GenerateError("shut down"))
            if self._stopping.is_set() and self.idle() and not pending:
                return
            self._admit(pending)
            decoding = any(self._decoding(b) for b in range(self.max_batch))
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

    def _drain_queue(self) -> list[Request]:
        drained = []
        with contextlib.suppress(queue.Empty):
            while True:
                drained.append(self._queue.get_nowait())
        return drained
