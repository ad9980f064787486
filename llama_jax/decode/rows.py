"""Decode rows: the state every decoder carries (`Rows`), one step of it and one speculative
round of it. `generate` loops over them in a `lax.while_loop`; the server's decode and
speculate programs (batching.py) are scans of the same step and round.

A row is one sequence: its KV cache from position 0 to an end of its own (the cache has an
end per row; a row attends to its own positions only), its last token, the tokens generated
so far, its sampling settings, its key and whether it is done (a stop token, or its
`max_new` tokens); a speculating row also its token ids and its rate of first guesses right
(`Lookup`), and a draft model's cache beside the model's. A row's key for step s is
`fold_in(key, s)` of its own key (`row_key`), and rows never mix, so a row's tokens do not
depend on its companions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.config import ModelConfig
from llama_jax.decode.grammar import masked
from llama_jax.decode.sampling import SamplingParams, Strategy, gumbel_noise, sample
from llama_jax.decode.speculate import (HIT_RATE_START, Speculation, cut, draft_proposals,
                                        ngram_proposals, put_rows, token_logprobs,
                                        updated_rate, verify_or_step)
from llama_jax.decode.step import NO_TOKEN, next_logits
from llama_jax.model.kv_cache import KVCache
from llama_jax.model.params import Params


def row_key(seed: int, row: int = 0) -> jax.Array:
    """The sampling key of row `row` of a batch decoded with `seed`: a one-prompt `generate`
    and a server's request of that seed sample alike."""
    return jax.random.fold_in(jax.random.key(seed), row)


@struct.dataclass
class Lookup:
    """What speculation keeps of the rows: each row's token ids at its cache positions (its
    prompt from position 0, its output, and its last token at its end), its running rate of
    first guesses right (speculate.worth_verifying), the rate that decides whether it
    verifies in a program (a server's: as the program before the last left it, which the host
    has read by the time it dispatches), and its guesses verified and kept so far."""

    tokens_BS: jax.Array
    hit_rate_B: jax.Array
    deciding_rate_B: jax.Array
    drafted_B: jax.Array
    accepted_B: jax.Array

    @classmethod
    def fresh(cls, tokens_BS: jax.Array) -> "Lookup":
        """Rows of these token ids that have guessed nothing yet."""
        B = tokens_BS.shape[0]
        start_B = jnp.full((B,), HIT_RATE_START, jnp.float32)
        zeros_B = jnp.zeros((B,), jnp.int32)
        return cls(tokens_BS, start_B, start_B, zeros_B, zeros_B)


@struct.dataclass
class Rows:
    """The decode rows on the device (with `lookup`, speculating ones; with `draft_cache`,
    ones whose draft model guesses)."""

    cache: KVCache  # with an end per row
    last_B: jax.Array  # [B] int32: the token to feed next
    step_B: jax.Array  # [B] int32: tokens generated so far
    max_new_B: jax.Array  # [B] int32
    done_B: jax.Array  # [B] bool: stopped (a stop token or max_new); idles until freed
    sampling: SamplingParams
    key_B: jax.Array  # [B] typed keys
    stop_S: jax.Array  # [n_stop] int32: the ids that end a row (NO_TOKEN: none)
    lookup: Lookup | None = None
    draft_cache: KVCache | None = None  # the draft model's, ends per row like `cache`'s
    # constrained rows: the tokens each may take next, packed (grammar.py; every bit set for a
    # row without a grammar), written by the host before each step
    mask_BW: jax.Array | None = None


@struct.dataclass
class Emitted:
    """Per row, the tokens of K steps (of a step: NO_TOKEN where the row was done; of a
    round: the first n of them), their log-probabilities and the `top` most likely tokens of
    each step."""

    tokens_BK: jax.Array
    logprobs_BK: jax.Array
    top_ids_BKn: jax.Array
    top_logprobs_BKn: jax.Array
    # speculating: each row's guesses verified and kept since its request began, and its
    # rate of first guesses right after the program
    drafted_B: jax.Array | None = None
    accepted_B: jax.Array | None = None
    hit_rate_B: jax.Array | None = None


def step_keys(key_B: jax.Array, step_B: jax.Array) -> jax.Array:
    """Each row's key for its step `step_B`: its own key folded with the step."""
    return jax.vmap(jax.random.fold_in)(key_B, step_B)


def choose(logits_BV, key_B, step_B, sampling, strategy: Strategy, top: int, mask_BW=None,
           noise_BV=None):
    """Each row's token of step `step_B` (among the tokens `mask_BW` allows, grammar.py) and
    the log-probabilities of its model distribution (before temperature, filters and the
    mask): of the token, and of the `top` most likely ones. `noise_BV`: the draw's noise
    (`step_noise`), drawn already."""
    token_B = sample(masked(logits_BV, mask_BW), step_keys(key_B, step_B), sampling, strategy,
                     noise_BV)
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32))
    logprob_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], -1)[:, 0]
    top_logprobs_Bn, top_ids_Bn = jax.lax.top_k(logprobs_BV, top)
    return token_B, logprob_B, top_ids_Bn, top_logprobs_Bn


def advance(rows: Rows, token_B, active_B) -> Rows:
    """The rows after `token_B` was emitted where `active_B`."""
    step_B = rows.step_B + active_B
    stopped_B = jnp.any(token_B[:, None] == rows.stop_S, axis=-1)
    done_B = rows.done_B | (active_B & (stopped_B | (step_B >= rows.max_new_B)))
    return rows.replace(last_B=jnp.where(active_B, token_B, rows.last_B), step_B=step_B,
                        done_B=done_B)


def step(config: ModelConfig, params: Params, rows: Rows, strategy: Strategy, top: int
         ) -> tuple[Rows, Emitted]:
    """One token for every row not done: the model over its last token at its own end, the
    LM head (`forward`), and the token drawn with its key for this step (`pick`). A row that
    is done stays where it ended (writing there, unseen)."""
    cache, logits_BV = forward(config, params, rows.cache, rows.last_B, rows.done_B)
    return pick(rows.replace(cache=cache), logits_BV, strategy, top)


def forward(config: ModelConfig, params: Params, cache: KVCache, last_B: jax.Array,
            done_B: jax.Array) -> tuple[KVCache, jax.Array]:
    """The first half of a step: the rows' cache after each one's last token `last_B` (a row
    that is done keeps its end) and the logits of its next token `[B, V]`. Apart from `pick`,
    a constrained decoder runs it while the host computes the masks."""
    logits_BV, stepped = next_logits(config, params, last_B, cache)
    return stepped.replace(end=jnp.where(done_B, cache.end, stepped.end)), logits_BV


def forward_drawing(config: ModelConfig, params: Params, cache: KVCache, last_B: jax.Array,
                    done_B: jax.Array, key_B: jax.Array, step_B: jax.Array, draw: bool
                    ) -> tuple[KVCache, jax.Array, jax.Array | None]:
    """A split step's first program: `forward`, and where the rows `draw`, the noise of their
    draw at step `step_B` (`step_noise`; else None), which `pick` then takes."""
    cache, logits_BV = forward(config, params, cache, last_B, done_B)
    return cache, logits_BV, step_noise(key_B, step_B, logits_BV) if draw else None


def step_noise(key_B: jax.Array, step_B: jax.Array, logits_BV: jax.Array) -> jax.Array:
    """The noise of each row's draw at step `step_B` (`choose`'s, from the same keys). A
    constrained step draws it in `forward`'s program, beside the model, which leaves `pick`
    (the program the next forward waits for) the mask and the argmax: threefry's 8 x 8,192
    draws are ~0.5 ms on a 2-core CPU."""
    return gumbel_noise(step_keys(key_B, step_B), logits_BV)


def pick(rows: Rows, logits_BV: jax.Array, strategy: Strategy, top: int,
         noise_BV: jax.Array | None = None) -> tuple[Rows, Emitted]:
    """The second half of a step: each row's token from `forward`'s logits (among those
    `rows.mask_BW` allows; `noise_BV`: its draw's noise, `step_noise`, drawn already), and the
    rows after it."""
    active_B = ~rows.done_B
    token_B, logprob_B, top_ids_Bn, top_logprobs_Bn = choose(
        logits_BV, rows.key_B, rows.step_B, rows.sampling, strategy, top, rows.mask_BW,
        noise_BV)
    emitted = Emitted(jnp.where(active_B, token_B, NO_TOKEN)[:, None], logprob_B[:, None],
                      top_ids_Bn[:, None], top_logprobs_Bn[:, None])
    return advance(rows, token_B, active_B), emitted


@struct.dataclass
class Proposal:
    """A round's guesses per row (`[B, K]`), how many each row has, the draft's distributions
    they were drawn from (None for prompt lookup) and the draft's cache after them."""

    guess_BK: jax.Array
    n_guess_B: jax.Array
    q_BKV: jax.Array | None
    draft_cache: KVCache | None


def _round_start(rows: Rows, spec: Speculation) -> tuple[jax.Array, jax.Array]:
    """Where each row's round starts (a row that is done still takes part in the pass: its
    writes are kept in the cache) and its three keys (the draft's, the verify's, the plain
    step's)."""
    T, S = spec.k + 1, rows.cache.max_len
    end_B = jnp.where(~rows.done_B, rows.cache.end, jnp.minimum(rows.cache.end, S - T))
    keys_B3 = jax.vmap(lambda key: jax.random.split(key, 3))(
        step_keys(rows.key_B, rows.step_B))
    return end_B, keys_B3


def propose(draft_params: Params | None, rows: Rows, spec: Speculation, verify: bool,
            strategy: Strategy) -> Proposal:
    """Each row's guesses from its last token (k; a draft's in a round that does not verify:
    its first only, which keeps the draft's cache in step and its hit rate going)."""
    end_B, keys_B3 = _round_start(rows, spec)
    k, tokens_BS = spec.k, rows.lookup.tokens_BS
    if spec.method == "ngram":
        guess_BK, n_guess_B = ngram_proposals(tokens_BS, end_B + 1, k, *spec.ngram)
        return Proposal(guess_BK, n_guess_B, None, None)
    k = k if verify else 1
    before_B = jnp.take_along_axis(tokens_BS, jnp.maximum(end_B - 1, 0)[:, None], 1)[:, 0]
    guess_BK, q_BKV, draft_cache = draft_proposals(
        spec.draft_config, draft_params, rows.draft_cache, end_B, before_B, rows.last_B,
        rows.sampling, k, strategy, keys_B3[:, 0])
    return Proposal(guess_BK, jnp.full_like(end_B, k), q_BKV, draft_cache)


def speculative_round(config: ModelConfig, params: Params, draft_params: Params | None,
                      rows: Rows, spec: Speculation, verify: bool, worth_B: jax.Array,
                      strategy: Strategy, top: int, proposal: Proposal | None = None,
                      mask_BTW: jax.Array | None = None) -> tuple[Rows, Emitted, jax.Array]:
    """One round of every row (rows with `lookup`): guesses (`proposal`, or `propose`'s now:
    prompt lookup's, or the draft model's from its cache), then, with `verify`, one pass of
    the model in which the rows `worth_B` with guesses verify them and the others take a
    plain step; without, a plain step of every row. Constrained rows choose among what
    `mask_BTW` allows at each position (`Constrained.guessed_masks` of the proposal's
    guesses). Returns the rows advanced each by its own count `n_B` (1 to k + 1; 0 for a row
    done), and the round's tokens (the first `n_B` of each row emitted)."""
    lookup, active_B = rows.lookup, ~rows.done_B
    end_B, keys_B3 = _round_start(rows, spec)
    if proposal is None:
        proposal = propose(draft_params, rows, spec, verify, strategy)
    proposing_B = active_B & (proposal.n_guess_B > 0)
    v = verify_or_step(config, params, rows.cache.replace(end=end_B), rows.last_B,
                       proposal.guess_BK, proposal.q_BKV, proposal.n_guess_B, rows.sampling,
                       strategy, keys_B3[:, 1:], worth_B & proposing_B, run_pass=verify,
                       mask_BTW=mask_BTW)
    n_B, stopped_B = cut(v.tokens_BT, v.n_B, rows.max_new_B - rows.step_B, rows.done_B,
                         rows.stop_S[None, None, :])
    top_logprobs_BTn, top_ids_BTn = jax.lax.top_k(v.logprobs_BTV, top)
    emitted = Emitted(v.tokens_BT, token_logprobs(v.logprobs_BTV, v.tokens_BT), top_ids_BTn,
                      top_logprobs_BTn)
    verified_B = proposing_B & v.verified_B
    lookup = lookup.replace(
        tokens_BS=put_rows(lookup.tokens_BS, end_B + 1, v.tokens_BT, n_B),
        hit_rate_B=updated_rate(lookup.hit_rate_B, v.hit_B, proposing_B),
        drafted_B=lookup.drafted_B + jnp.where(verified_B, proposal.n_guess_B, 0),
        accepted_B=lookup.accepted_B + jnp.where(verified_B, v.kept_B, 0))
    step_B = rows.step_B + n_B
    last_B = jnp.take_along_axis(v.tokens_BT, jnp.maximum(n_B - 1, 0)[:, None], 1)[:, 0]
    rows = rows.replace(
        cache=v.cache.replace(end=end_B + n_B), last_B=jnp.where(n_B > 0, last_B, rows.last_B),
        step_B=step_B, lookup=lookup, draft_cache=proposal.draft_cache,
        done_B=rows.done_B | (active_B & (stopped_B | (step_B >= rows.max_new_B))))
    return rows, emitted, n_B
