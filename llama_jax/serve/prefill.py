"""Prompts admitted to a server and being prefilled, chunk by chunk, in rows reserved for
them: each prompt's pages are taken on admission (`Allocator.reserve_prompt`), its chunks run
first come first (`batching.prefill_chunk`, a draft model's too), and each full chunk it
computes is kept in the prefix cache."""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax

from llama_jax.decode.batching import chunk_pages, chunk_plan
from llama_jax.decode.rows import Emitted
from llama_jax.serve.allocator import Allocator, Demands
from llama_jax.serve.programs import Programs
from llama_jax.serve.requests import Request
from llama_jax.shapes import padded_row


@dataclasses.dataclass(eq=False)
class PrefillJob:
    """A prompt being prefilled for the requests that share it (a prompt's `n` choices), in
    the rows reserved for them (its pages are held in its own name, beside a spare page for
    each further choice to copy its last page into): the chunks still to run, the last
    logits so far, the prompt's scores per chunk (if asked for), the keys of its full chunks
    in the prefix cache and the tokens restored from it."""

    requests: list[Request]
    rows: list[int]
    chunks: collections.deque
    keys: list[bytes]
    cached: int
    spares: list[int]
    logits: jax.Array | None = None
    scores: list[Emitted] = dataclasses.field(default_factory=list)

    @property
    def prompt(self) -> Sequence[int]:
        return self.requests[0].prompt

    @property
    def scoring(self) -> bool:
        return self.requests[0].prompt_logprobs


class PrefillQueue:
    """The jobs being prefilled (`jobs`, first come first) by `programs` into pages of
    `allocator`, and the rows reserved for them (`reserved`: row -> job); `counters` count
    chunks run and prefix cache lookups, hits and tokens restored."""

    def __init__(self, programs: Programs, allocator: Allocator,
                 counters: collections.Counter):
        self.programs, self.allocator, self.counters = programs, allocator, counters
        self.shape = allocator.shape
        self.jobs: collections.deque[PrefillJob] = collections.deque()
        self.reserved: dict[int, PrefillJob] = {}

    def start(self, group: list[Request], rows: list[int], demands: Demands
              ) -> PrefillJob | None:
        """Reserves `rows` for the requests of `group` (one prompt) and its pages beside the
        `demands` (scoring prompts neither read nor fill the prefix cache), and queues it;
        None (taking nothing) when the pool lacks them."""
        prompt, scoring = group[0].prompt, group[0].prompt_logprobs
        job = PrefillJob(group, rows, collections.deque(), [], 0, [])
        reserved = self.allocator.reserve_prompt(job, prompt, len(group), not scoring, demands)
        if reserved is None:
            return None
        job.keys, job.cached, job.spares = reserved
        job.chunks.extend(chunk_plan(len(prompt), job.cached, self.shape.prefill_chunk,
                                     self.shape.max_seq_len))
        if job.keys:
            self.counters["prefix_cache_lookups"] += 1
            self.counters["prefix_cache_hits"] += job.cached > 0
            self.counters["prefix_cache_hit_tokens"] += job.cached
        for b in rows:
            self.reserved[b] = job
        self.jobs.append(job)
        return job

    def run_chunk(self, job: PrefillJob) -> int:
        """Runs the next chunk of `job` (a draft model's too), and keeps it in the prefix
        cache if it is a full chunk the cache lacks; returns its length."""
        start, L = job.chunks.popleft()
        prompt = job.prompt
        real = prompt[start:start + L]
        tokens_1L = padded_row(real, L)
        next_1L = padded_row(prompt[start + 1:start + L + 1], L) if job.scoring else None
        pages_1N = self.allocator.tables.array([job],
                                               chunk_pages(start, L, self.shape.page_size))
        self.counters["prefill_chunks"] += 1
        job.logits, scores = self.programs.prefill_chunk(pages_1N, tokens_1L, start,
                                                         len(real) - 1, next_1L)
        if self.programs.draft_params is not None:
            self.programs.prefill_chunk(pages_1N, tokens_1L, start, len(real) - 1, None,
                                        draft=True)
        if scores is not None:
            job.scores.append(scores)
        chunk = start // self.shape.prefill_chunk
        if chunk < len(job.keys):  # a full chunk of a prompt that reads the cache
            self.allocator.keep_chunk(job, job.keys[chunk], chunk)
        return L

    def drop(self, job: PrefillJob) -> None:
        """Forgets `job` and frees the rows and pages it reserved."""
        if job in self.jobs:  # (a deque's failed remove formats the job: its logits fetched)
            self.jobs.remove(job)
        self.allocator.release(job, job.spares)
        job.spares = []
        for b in job.rows:
            if self.reserved.get(b) is job:
                del self.reserved[b]

    def requests(self) -> list[Request]:
        return [r for job in self.jobs for r in job.requests]

    def clear(self) -> None:
        """Forgets every job (the pool they were in is gone)."""
        self.jobs.clear()
        self.reserved.clear()
