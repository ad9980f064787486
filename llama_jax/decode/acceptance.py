"""Verifying a speculative guess: which of a row's k guessed tokens one target pass keeps, and
the token after them, so that the row's output is distributed exactly as without speculation.

The target pass over `[last, x_1 .. x_k]` gives the target's logits for each guess's position
and one more. Greedy rows keep the longest prefix of guesses equal to the target's argmax, then
take the target's argmax after it (a correction, or a bonus token when every guess was kept).
Sampled rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023): guess x_i,
drawn from the proposer's q_i, is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection the next token is drawn from the residual max(p_i − q_i, 0), normalised, and
after k kept guesses from p_{k+1}. p is the target's distribution under the row's sampling
settings (sampling.py: temperature, top-k, top-p, min-p), so each emitted token is distributed
as the non-speculative decoder would draw it. A proposer without probabilities (prompt lookup)
is a point mass: q_i(x_i) = 1, and the residual is p_i without x_i.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.decode.sampling import SamplingParams, Strategy, argmax, filter_logits


def target_probs(logits_BTV: jax.Array, sampling: SamplingParams, truncate: bool) -> jax.Array:
    """Each position's distribution `[B, T, V]` under its row's sampling settings."""
    B, T, V = logits_BTV.shape
    per_position = jax.tree.map(lambda a: jnp.repeat(a, T), sampling)
    filtered = filter_logits(logits_BTV.reshape(B * T, V), per_position, truncate)
    return jax.nn.softmax(filtered, axis=-1).reshape(B, T, V)


def accept(logits_BTV: jax.Array, guess_BK: jax.Array, q_BKV: jax.Array | None,
           sampling: SamplingParams, strategy: Strategy, key_B: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
    """The tokens a row emits after a target pass over `[last, guesses]` (`T = k + 1`
    positions): `(tokens_BT, n_B)`, the first `n_B` of `tokens_BT` (n_B - 1 kept guesses, then
    the target's token after them). `q_BKV`: the proposer's distributions the guesses were
    drawn from (None: point masses); `key_B`: a key per row, its draws its own."""
    B, T, V = logits_BTV.shape
    greedy_BT = argmax(logits_BTV.reshape(B * T, V)).reshape(B, T)
    kept_BK = guess_BK == greedy_BT[:, :-1]
    if strategy.draw:
        p_BTV = target_probs(logits_BTV, sampling, strategy.truncate)
        keys_B2 = jax.vmap(lambda key: jax.random.split(key))(key_B)
        u_BK = jax.vmap(lambda key: jax.random.uniform(key, (T - 1,)))(keys_B2[:, 0])
        q_at_guess_BKV = (jax.nn.one_hot(guess_BK, V, dtype=p_BTV.dtype) if q_BKV is None
                          else q_BKV)
        p_x_BK = jnp.take_along_axis(p_BTV[:, :-1], guess_BK[..., None], -1)[..., 0]
        q_x_BK = jnp.take_along_axis(q_at_guess_BKV, guess_BK[..., None], -1)[..., 0]
        sampled_B1 = (sampling.temperature > 0)[:, None]
        kept_BK = jnp.where(sampled_B1, u_BK * q_x_BK < p_x_BK, kept_BK)
    n_kept_B = jnp.sum(jnp.cumprod(kept_BK, axis=1), axis=1)
    next_B = jnp.take_along_axis(greedy_BT, n_kept_B[:, None], 1)[:, 0]
    if strategy.draw:
        residual_BKV = jnp.maximum(p_BTV[:, :-1] - q_at_guess_BKV, 0.0)
        after_BTV = jnp.concatenate([residual_BKV, p_BTV[:, -1:]], axis=1)
        dist_BV = jnp.take_along_axis(after_BTV, n_kept_B[:, None, None], 1)[:, 0]
        # A residual of zero mass is only reached by rounding (p = q kept every guess): draw
        # from p there.
        p_at_B = jnp.take_along_axis(p_BTV, n_kept_B[:, None, None], 1)[:, 0]
        dist_BV = jnp.where(jnp.sum(dist_BV, -1, keepdims=True) > 0, dist_BV, p_at_B)
        gumbel_BV = jax.vmap(lambda key: jax.random.gumbel(key, (V,)))(keys_B2[:, 1])
        drawn_B = argmax(jnp.log(dist_BV) + gumbel_BV)
        next_B = jnp.where(sampling.temperature > 0, drawn_B, next_B)
    position_T = jnp.arange(T)
    guesses_BT = jnp.pad(guess_BK, ((0, 0), (0, 1)))
    tokens_BT = jnp.where(position_T < n_kept_B[:, None], guesses_BT, next_B[:, None])
    return tokens_BT.astype(jnp.int32), (n_kept_B + 1).astype(jnp.int32)
