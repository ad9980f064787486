"""Speculative decoding: cheap guesses of a row's next k tokens, which one target pass then
verifies (acceptance.py keeps what the target would have produced). The round itself is
`rows.speculative_round`, which `generate` and the server both take; here are its pieces:
the guesses, `verify_or_step`, `cut`, `put_rows`, and the auto-off's rates.

Prompt lookup (n-gram matching, as transformers' `prompt_lookup_num_tokens` and vLLM's
`ngram` speculator do): the last n tokens of a row's sequence so far (prompt and output) are
looked for earlier in it, for n from `max_n` down to `min_n`; at the latest earlier match of
the longest n that matches (the latest with k tokens after it, if any has), the k tokens that
followed are the proposal. It runs on the device, on the row's token buffer, so a decode loop
proposes without a host round trip. A draft model (`draft_proposals`) decodes k tokens from
its own cache, kept beside the rows'.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.config import ModelConfig
from llama_jax.decode.acceptance import accept
from llama_jax.decode.grammar import masked
from llama_jax.decode.sampling import SamplingParams, Strategy, filter_logits, sample
from llama_jax.decode.step import next_logits
from llama_jax.model.kv_cache import KVCache
from llama_jax.model.params import Params
from llama_jax.model.transformer import apply
from llama_jax.nn.attention.dot_product import DECODE_QUERIES
from llama_jax.errors import GenerateError
from llama_jax.nn.heads import is_task_head, lm_head
from llama_jax.plan.costs import param_counts


def ngram_proposal(tokens_N: jax.Array, length: jax.Array, k: int, min_n: int, max_n: int
                   ) -> tuple[jax.Array, jax.Array]:
    """One row's proposal from its `length` tokens at the front of `tokens_N`: k tokens (the
    first `count` of them proposed; 0 when no n-gram of the suffix recurs) and `count`."""
    N = tokens_N.shape[0]
    i_N = jnp.arange(N)
    count, start = jnp.int32(0), jnp.int32(0)
    for n in range(min_n, max_n + 1):  # the longest n that matches wins: it is found last
        suffix_n = jax.lax.dynamic_slice(tokens_N, (length - n,), (n,))
        # Windows i .. i + n - 1 equal to the suffix that end before it (a token follows).
        equal_N = jnp.ones((N,), bool)
        for j in range(n):
            equal_N &= jnp.roll(tokens_N, -j) == suffix_n[j]
        equal_N &= (i_N + n < length) & (length >= n)
        # The latest match with k tokens after it, else the latest: in a run of repeats
        # ("a b a b a b") the latest match is right behind the suffix, one token short.
        full = jnp.max(jnp.where(equal_N & (i_N + n + k <= length), i_N, -1))
        latest = jnp.where(full >= 0, full, jnp.max(jnp.where(equal_N, i_N, -1)))
        found = latest >= 0
        start = jnp.where(found, latest + n, start)
        count = jnp.where(found, jnp.minimum(k, length - latest - n), count)
    proposal_k = jax.lax.dynamic_slice(tokens_N, (jnp.minimum(start, N - k),), (k,))
    # dynamic_slice clamps a start past N - k: shift the proposal back into place.
    shift = start - jnp.minimum(start, N - k)
    proposal_k = jnp.roll(proposal_k, -shift)
    return proposal_k, count.astype(jnp.int32)


def ngram_proposals(tokens_BN: jax.Array, length_B: jax.Array, k: int, min_n: int,
                    max_n: int) -> tuple[jax.Array, jax.Array]:
    """`ngram_proposal` of every row: `[B, k]` tokens and `[B]` counts."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"ngram=({min_n}, {max_n}) must satisfy 1 <= min <= max, and "
                         f"k={k} must be >= 1")
    return jax.vmap(lambda t, n: ngram_proposal(t, n, k, min_n, max_n))(tokens_BN, length_B)


# ------------------------------------------------------------------- the speculative decoder

METHODS = ("ngram", "draft")
# A verify pass feeds the last token and k guesses: at most DECODE_QUERIES queries, the most
# that attend to the cache as a decode step does (dense, every cache kind).
MAX_GUESSES = DECODE_QUERIES - 1
# Prompt lookup's auto-off: each row's running rate of first guesses that were the model's next
# token moves this far toward each round's (verified or, on a plain step, compared), from
# HIT_RATE_START: a few rounds of misses turn verification off, a few of hits back on.
RATE_STEP = 0.25
HIT_RATE_START = 0.5


# What a verify pass's guesses cost over a plain step, per platform: (per guess at batch 1,
# added per guess for each further row), as measured (BENCHMARKS.md). On a 2-core CPU (the
# benchmark model) a step computes: a pass of 5 tokens costs 1.2-1.4 steps at batch 1, and a
# server's rounds that verified about 4 at batch 8. On a GPU (bench/gpu.py's D=2048 model in
# bf16, an H200) a step reads weights: a pass of 3 to 16 tokens cost 0.86-0.94 steps at
# batch 1 and 0.99-1.35 at batch 8. TPUs read weights at decode too; unmeasured, they take the
# GPU's figures.
VERIFY_COSTS = {"cpu": (0.1, 0.093), "gpu": (0.03, 0.005), "tpu": (0.03, 0.005)}


def verify_cost(batch: int, k: int, platform: str = "cpu") -> float:
    """What a round that verifies k guesses costs in plain decode steps on `platform`
    ("cpu", "gpu" or "tpu"; `VERIFY_COSTS`; another platform is costed as a CPU, which errs
    toward plain steps)."""
    per_guess, per_row = VERIFY_COSTS.get(platform, VERIFY_COSTS["cpu"])
    return 1.0 + (per_guess + per_row * (batch - 1)) * k


def draft_break_even(config: ModelConfig, draft_config: ModelConfig, batch: int, k: int,
                     platform: str = "cpu") -> float:
    """The guesses a draft model's round must keep for it to cost no more per token than a
    server's plain round, which takes a step of the model and one of the draft (keeping the
    draft's cache in step): a verify round costs `verify_cost` and k draft steps, a draft
    step the draft's share r of the model's parameters. (V + k r) / (1 + kept) <= 1 + r."""
    r = param_counts(draft_config).total / param_counts(config).total
    return (verify_cost(batch, k, platform) + k * r) / (1 + r) - 1


@dataclasses.dataclass(frozen=True)
class Speculation:
    """How a decoder speculates; static, part of its compiled programs. `method`: "ngram"
    (prompt lookup, n-gram sizes `ngram`) or "draft" (a small model of `draft_config` sharing
    the target's vocabulary, its parameters an argument). `k` guesses per verify pass.
    A row verifies its guesses only while it may expect to keep at least `min_kept` of them
    per pass (`expected_kept`; below, a plain step is cheaper); `generate` verifies a draft
    model's in every round (a server's rows by `min_kept` too)."""

    method: str
    k: int
    ngram: tuple[int, int] = (1, 3)
    draft_config: ModelConfig | None = None
    min_kept: float = 0.0


def speculation(config: ModelConfig, method: str | None, k: int, ngram: tuple[int, int],
                draft: tuple[ModelConfig, Params] | None, batch: int,
                min_accepted: float | None = None,
                platform: str = "cpu") -> Speculation | None:
    """The static speculation settings of a request, or None; a `GenerateError` names a
    setting that cannot be. `min_accepted` defaults to the break-even at `batch` on
    `platform`: `verify_cost`'s for prompt lookup, `draft_break_even` for a draft."""
    if method is None and draft is None:
        return None
    if method is None:
        method = "draft"
    if method not in METHODS:
        raise GenerateError(f"speculate={method!r} is not one of "
                            f"{', '.join(METHODS)} (or None: off)")
    if not 1 <= k <= MAX_GUESSES:
        raise GenerateError(f"num_speculative_tokens={k} must be in [1, "
                            f"{MAX_GUESSES}]")
    if method == "ngram":
        if draft is not None:
            raise GenerateError("speculate='ngram' guesses by prompt lookup: give no draft "
                                "model (or speculate='draft')")
        ngram = tuple(int(n) for n in ngram)
        if len(ngram) != 2 or not 1 <= ngram[0] <= ngram[1]:
            raise GenerateError(f"ngram={ngram} must be (min, max) with 1 <= min <= max")
        if min_accepted is None:
            min_accepted = verify_cost(batch, k, platform) - 1.0
        return Speculation("ngram", k, ngram, min_kept=float(min_accepted))
    if draft is None:
        raise GenerateError("speculate='draft' needs draft=(draft_config, draft_params)")
    draft_config = draft[0]
    if draft_config.vocab_size != config.vocab_size:
        raise GenerateError(f"the draft model's vocabulary ({draft_config.vocab_size} tokens) "
                            f"is not the model's ({config.vocab_size}): a draft must share "
                            "the tokenizer")
    if is_task_head(draft_config):
        raise GenerateError(f"the draft model has a task head ({draft_config.head!r}), not "
                            "the LM head: it cannot guess tokens")
    if min_accepted is None:
        min_accepted = draft_break_even(config, draft_config, batch, k, platform)
    return Speculation("draft", k, draft_config=draft_config, min_kept=float(min_accepted))


def draft_proposals(config: ModelConfig, params: Params, cache: KVCache, end_B: jax.Array,
                    before_B: jax.Array, last_B: jax.Array, sampling: SamplingParams, k: int,
                    strategy: Strategy, key_B: jax.Array
                    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """The draft model's k guesses per row, drawn as the row samples (`[B, k]`), the
    distributions they were drawn from (`[B, k, V]`; None when no row samples) and its cache.
    Each row's last token `last_B` sits at the target's cache end `end_B`. The draft's first
    pass feeds it with the token before it (`before_B`), which is missing from the draft's
    cache when all k guesses of the round before were kept."""
    cache = cache.replace(end=end_B - 1)
    h_B2D, cache, _ = apply(config, params, jnp.stack([before_B, last_B], 1), cache=cache)
    logits_BV = lm_head(config, params, h_B2D[:, -1:])[:, 0]

    def draw(logits_BV, i):
        keys_B = jax.vmap(jax.random.fold_in, (0, None))(key_B, i)
        token_B = sample(logits_BV, keys_B, sampling, strategy)
        q_BV = (jax.nn.softmax(filter_logits(logits_BV, sampling, strategy.truncate), -1)
                if strategy.draw else None)
        return token_B, q_BV

    def step(carry, i):
        logits_BV, cache = carry
        token_B, q_BV = draw(logits_BV, i)
        logits_BV, cache = next_logits(config, params, token_B, cache)
        return (logits_BV, cache), (token_B, q_BV)

    (logits_BV, cache), (tokens_KB, q_KBV) = jax.lax.scan(
        step, (logits_BV, cache), jnp.arange(k - 1))
    last_B, q_BV = draw(logits_BV, k - 1)
    guess_BK = jnp.concatenate([tokens_KB.T, last_B[:, None]], axis=1)
    q_BKV = None if q_BV is None else jnp.concatenate(
        [jnp.swapaxes(q_KBV, 0, 1), q_BV[:, None]], axis=1)
    return guess_BK, q_BKV, cache


class Verified(NamedTuple):
    """A round's outcome per row: its first `n_B` of `tokens_BT` emitted (kept guesses, then
    the target's token), the model's log-probabilities at each position (`[B, T, V]`), the
    cache with the pass written, whether the row verified, the guesses it kept, and whether
    its first guess was the model's token (verified or not)."""

    tokens_BT: jax.Array
    n_B: jax.Array
    logprobs_BTV: jax.Array
    cache: KVCache
    verified_B: jax.Array
    kept_B: jax.Array
    hit_B: jax.Array


def verify_or_step(config: ModelConfig, params: Params, cache: KVCache, last_B: jax.Array,
                   guess_BK: jax.Array, q_BKV: jax.Array | None, n_guess_B: jax.Array,
                   sampling: SamplingParams, strategy: Strategy, keys_B2: jax.Array,
                   verifying_B: jax.Array, run_pass: bool, mask_BTW: jax.Array | None = None
                   ) -> Verified:
    """With `run_pass`, one target pass over each row's last token and guesses, in which the
    rows `verifying_B` verify their guesses (`accept`, with the rows' first keys) and the
    others take a plain step (their second keys); without, a plain decode step of all. Tokens
    are chosen among those `mask_BTW` allows at each position (constrained rows, grammar.py:
    a guess it forbids is never kept); log-probabilities are the model's. A
    row's tokens do not depend on what its neighbours do. Which one runs is the caller's
    static choice, never a `lax.cond`: XLA:CPU copies a cache that is a cond's operand in
    and out of it (a server ran 0.72x as fast)."""
    T = guess_BK.shape[1] + 1

    def hit(token_B):
        return guess_BK[:, 0] == token_B

    def verify():
        tokens_BT = jnp.concatenate([last_B[:, None], guess_BK], axis=1)
        h_BTD, verified_cache, _ = apply(config, params, tokens_BT, cache=cache)
        logits_BTV = lm_head(config, params, h_BTD)
        allowed_BTV = masked(logits_BTV, mask_BTW)
        tokens_BT, n_B = accept(allowed_BTV, guess_BK, q_BKV, sampling, strategy,
                                keys_B2[:, 0])
        kept_B, hit_B = jnp.minimum(n_B - 1, n_guess_B), n_B > 1
        token_B = sample(allowed_BTV[:, 0], keys_B2[:, 1], sampling, strategy)
        tokens_BT = jnp.where(verifying_B[:, None], tokens_BT, token_B[:, None])
        n_B = jnp.where(verifying_B, n_B, 1)
        kept_B = jnp.where(verifying_B, kept_B, 0)
        hit_B = jnp.where(verifying_B, hit_B, hit(token_B))
        return Verified(tokens_BT, n_B, jax.nn.log_softmax(logits_BTV.astype(jnp.float32)),
                        verified_cache, verifying_B, kept_B, hit_B)

    def plain():
        logits_BV, stepped_cache = next_logits(config, params, last_B, cache)
        token_B = sample(masked(logits_BV, None if mask_BTW is None else mask_BTW[:, 0]),
                         keys_B2[:, 1], sampling, strategy)
        B, V = logits_BV.shape
        logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32))
        return Verified(jnp.broadcast_to(token_B[:, None], (B, T)), jnp.ones_like(token_B),
                        jnp.broadcast_to(logprobs_BV[:, None], (B, T, V)), stepped_cache,
                        jnp.zeros((B,), bool), jnp.zeros_like(token_B), hit(token_B))

    return verify() if run_pass else plain()


def worth_verifying(hit_rate_B: jax.Array, proposing_B: jax.Array, spec: Speculation
                    ) -> jax.Array:
    """The rows whose guesses are worth a verify pass: those with guesses whose running hit
    rate makes the guesses expected kept (`expected_kept`) at least `spec.min_kept`. Of
    numpy arrays too (a server's host chooses its program by it, not waiting for the
    device)."""
    return proposing_B & (expected_kept(hit_rate_B, spec.k) >= spec.min_kept)


def worth_a_pass(hit_rate_B: np.ndarray, in_use_B: np.ndarray, spec: Speculation) -> bool:
    """Whether a program's rounds should run verify passes (decided on the host, from the
    rows' rates): when the rows worth verifying may expect to keep more guesses than the
    passes cost all rows in use. The pass costs every row, so a row worth verifying alone
    may be outvoted: then it takes plain steps (the same distribution; a sampled row's draws
    then depend on its neighbours)."""
    worth_B = worth_verifying(hit_rate_B, in_use_B, spec)
    gain = expected_kept(hit_rate_B, spec.k)[worth_B].sum()
    return bool(worth_B.any() and gain >= spec.min_kept * in_use_B.sum())


def expected_kept(hit_rate_B, k: int):
    """The guesses a row may expect to keep of k at a hit rate a: a + a² + ... + a^k (each
    kept if the one before was, at rate a). Of numpy or JAX arrays."""
    return (hit_rate_B[:, None] ** np.arange(1, k + 1)).sum(axis=1)


def updated_rate(hit_rate_B: jax.Array, hit_B: jax.Array, proposing_B: jax.Array
                 ) -> jax.Array:
    """Each row's running hit rate moved toward this round's where the row had guesses."""
    return jnp.where(proposing_B, hit_rate_B + RATE_STEP * (hit_B - hit_rate_B), hit_rate_B)


def cut(tokens_BT: jax.Array, n_B: jax.Array, room_B: jax.Array, done_B: jax.Array,
        stop_B1S: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(n_B, stopped_B)`: each row's emitted count cut to the `room_B` tokens it may still
    emit and after its first stop token (ids `stop_B1S`, broadcast against `[B, T, 1]`); 0
    for rows already done."""
    position_T = jnp.arange(tokens_BT.shape[1])
    n_B = jnp.where(done_B, 0, jnp.minimum(n_B, room_B))
    stop_BT = jnp.any(tokens_BT[..., None] == stop_B1S, -1) & (position_T < n_B[:, None])
    stopped_B = jnp.any(stop_BT, axis=1)
    return jnp.where(stopped_B, jnp.argmax(stop_BT, axis=1) + 1, n_B), stopped_B


def put_rows(buffer: jax.Array, at_B: jax.Array, values_BT, n_B: jax.Array) -> jax.Array:
    """`buffer` `[B, N, ...]` with each row's first `n_B` values written from column `at_B`
    (values past the buffer dropped)."""
    B, T = n_B.shape[0], values_BT.shape[1]
    position_T = jnp.arange(T)
    columns_BT = jnp.where(position_T < n_B[:, None], at_B[:, None] + position_T,
                           buffer.shape[1])
    return buffer.at[jnp.arange(B)[:, None], columns_BT].set(values_BT, mode="drop")


def token_logprobs(logprobs_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    """The log-probabilities `[B, T]` of the tokens."""
    return jnp.take_along_axis(logprobs_BTV, tokens_BT[..., None], -1)[..., 0]
