"""Proposers for speculative decoding: cheap guesses of a row's next k tokens, which one
target pass then verifies.

Prompt lookup (n-gram matching, as transformers' `prompt_lookup_num_tokens` and vLLM's
`ngram` speculator do): the last n tokens of a row's sequence so far (prompt and output) are
looked for earlier in it, for n from `max_n` down to `min_n`; at the latest earlier match of
the longest n that matches, the k tokens that followed are the proposal. It runs on the
device, on the row's token buffer, so a decode loop proposes without a host round trip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
        latest = jnp.max(jnp.where(equal_N, i_N, -1))
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
