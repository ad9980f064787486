"""What the engine's clients hand it and get back: a `Request` (one sequence to decode, its
settings and the callback that takes its tokens), the `Chunk`s it is delivered, and how a
program's output for a request's row becomes its next chunk (`read_row`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from llama_jax.decode.batching import TOP_LOGPROBS
from llama_jax.decode.grammar import Matcher
from llama_jax.decode.rows import Emitted
from llama_jax.decode.sampling import Strategy, check_settings
from llama_jax.decode.step import NO_TOKEN, check_prompt
from llama_jax.errors import GenerateError


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
    # Constrained (a chat request's response_format): its grammar's place, which decides what
    # its row may take next (decode/grammar.py); the engine resets it when the row starts.
    matcher: Matcher | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def strategy(self) -> Strategy:
        return Strategy.of(self.temperature, self.top_k, self.top_p)


def check_request(request: Request, vocab_size: int, max_seq_len: int) -> None:
    """Raises GenerateError, naming the lengths or the value, if `request` cannot run on a
    server of rows of `max_seq_len` tokens."""
    n = len(request.prompt)
    check_prompt(request.prompt, vocab_size)
    if request.max_tokens < 1:
        raise GenerateError(f"max_tokens={request.max_tokens} must be >= 1")
    check_settings(request.temperature, request.top_k, request.top_p, request.min_p)
    if n + request.max_tokens > max_seq_len:
        raise GenerateError(
            f"the prompt has {n} tokens and {request.max_tokens} more were asked for: "
            f"{n + request.max_tokens} > the server's context of {max_seq_len} tokens")
    if not 0 <= request.top_logprobs <= TOP_LOGPROBS:
        raise GenerateError(f"top_logprobs={request.top_logprobs} must be in "
                            f"[0, {TOP_LOGPROBS}]")


def read_row(e: Emitted, b: int, request: Request, stops: set[int]) -> tuple[Chunk, str | None]:
    """Row `b`'s tokens of a program's output `e` (on the host) as `request`'s next chunk, and
    why the request ends there, if it does ("stop": a stop id; "length": its `max_tokens`).
    Tokens it was delivered before a preemption are skipped; `request.generated` counts the
    rest."""
    chunk, reason = Chunk([], [], []), None
    for k, token in enumerate(e.tokens_BK[b].tolist()):
        if token == NO_TOKEN:
            break
        if request.matcher is not None and token not in stops:  # replayed tokens too
            request.matcher.accept(token)
        if request.replay:  # delivered before it was preempted
            request.replay -= 1
            continue
        if token in stops:
            reason = "stop"
            break
        chunk.tokens.append(token)
        chunk.logprobs.append(float(e.logprobs_BK[b, k]))
        if request.top_logprobs and e.top_ids_BKn.shape[-1]:
            chunk.top.append(list(zip(e.top_ids_BKn[b, k, :request.top_logprobs].tolist(),
                                      e.top_logprobs_BKn[b, k, :request.top_logprobs].tolist())))
        request.generated += 1
        if request.generated >= request.max_tokens:
            reason = "length"
            break
    return chunk, reason


def add_prompt_scores(chunk: Chunk, scores: list[Emitted], request: Request) -> None:
    """The scores of the prompt's tokens after the first into `chunk`: position p of the
    prefill chunks' scores (concatenated, on the host) scores token p + 1."""
    n, top = len(request.prompt), request.top_logprobs
    joined = jax.tree.map(lambda *x: np.concatenate(x, axis=1), *scores)
    chunk.prompt_logprobs = joined.logprobs_BK[0, :n - 1].tolist()
    chunk.prompt_top = [list(zip(ids[:top].tolist(), lps[:top].tolist()))
                        for ids, lps in zip(joined.top_ids_BKn[0, :n - 1],
                                            joined.top_logprobs_BKn[0, :n - 1])]
