"""The device programs of continuous batching (`serve/engine.py` drives them from the host):
a fixed set of decode rows — the slots — that requests enter and leave.

The slots are one batch of B rows: a KV cache (model/kv_cache.py) and each row's last token,
step, settings and key, kept on the device and donated to every program that updates them:
- `empty_slots`: B idle rows over a cache of a given size, laid out by the cache rules on a mesh;
- `prefill_chunk`: one chunk of a prompt into its one-row cache (`chunk_plan` cuts a prompt
  into chunks), and the logits after its last token;
- `insert`: that one-row cache written over a row, ending at the slots' write slot `end`, with
  the row's first token sampled from those logits;
- `decode`: K decode steps of every row (`step.next_logits`, the step `generate` takes);
- `speculate`: K speculative rounds (speculate.py) of every row instead, for a server that
  speculates: each row guesses from its own tokens (prompt lookup) or by a draft model (whose
  cache the slots hold beside the model's), one pass verifies, and each row advances by what
  it kept (1 to k + 1 tokens a round). Its rows have cache ends of their own and keep their
  token ids beside the cache (`Lookup`); a row's prompt sits from slot 0 and the rows are
  never moved;
- `rearrange`: every row's slots moved later and the cache resized (grown or cut).

A row's sampling key for step s is `fold_in(key, s)` of its own key, and rows never mix, so a
request's tokens do not depend on its companions. `lower_programs` lowers the largest of these
programs without running anything, for `llama_jax.aot` to compile for another target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from llama_jax.config import MeshConfig, ModelConfig
from llama_jax.decode.step import NO_TOKEN, next_logits
from llama_jax.decode.sampling import SamplingParams, Strategy, sample
from llama_jax.decode.speculate import (HIT_RATE_START, Speculation, cut, draft_proposals,
                                        ngram_proposals, put_rows, token_logprobs,
                                        updated_rate, verify_or_step, worth_verifying)
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import (KVCache, init_cache, moved, resized, shifted,
                                      with_row)
from llama_jax.model.params import Params
from llama_jax.model.transformer import apply
from llama_jax.nn.heads import lm_head
from llama_jax.parallel import sharding
from llama_jax.parallel.sharding import placed
from llama_jax.shapes import MIN_BUCKET, bucket

TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit)
# The strategy of a prefill: it samples one token per request, so it always takes every path
# and compiles once per shape.
PREFILL_STRATEGY = Strategy(draw=True, sort=True)
# The decode strategy that takes every path (a batch with a row using top-k or top-p), with
# top log-probabilities: the largest decode program.
WIDEST_STRATEGY = Strategy(draw=True, sort=True)


@struct.dataclass
class Lookup:
    """What prompt lookup keeps of the slots: each row's token ids at its cache slots (its
    prompt from slot 0, its output, and its last token at its end), its running rate of
    first guesses right (speculate.worth_verifying), that rate as the program before the
    last left it (which decides: the host has read it by the time it dispatches), and its
    guesses verified and kept since its request began."""

    tokens_BS: jax.Array
    hit_rate_B: jax.Array
    deciding_rate_B: jax.Array
    drafted_B: jax.Array
    accepted_B: jax.Array


@struct.dataclass
class Slots:
    """The decode rows on the device (with `lookup`, a speculating server's; with
    `draft_cache`, one whose draft model guesses)."""

    cache: KVCache
    last_B: jax.Array  # [B] int32: the token to feed next
    step_B: jax.Array  # [B] int32: tokens generated so far
    max_new_B: jax.Array  # [B] int32
    done_B: jax.Array  # [B] bool: stopped (a stop token or max_new); idles until freed
    sampling: SamplingParams
    key_B: jax.Array  # [B] typed keys
    stop_S: jax.Array  # [n_stop] int32: the ids that end a request
    lookup: Lookup | None = None
    draft_cache: KVCache | None = None  # the draft model's, ends per row like `cache`'s


@struct.dataclass
class Emitted:
    """Per row, the tokens of K steps (NO_TOKEN where the row was done), their
    log-probabilities and the `top` most likely tokens of each step."""

    tokens_BK: jax.Array
    logprobs_BK: jax.Array
    top_ids_BKn: jax.Array
    top_logprobs_BKn: jax.Array
    # speculating: each row's guesses verified and kept since its request began, and its
    # rate of first guesses right after the program
    drafted_B: jax.Array | None = None
    accepted_B: jax.Array | None = None
    hit_rate_B: jax.Array | None = None


@functools.partial(jax.jit, static_argnames=("config", "batch", "max_len", "cache_dtype",
                                             "layout", "spec", "placement"))
def empty_slots(stop_S: jax.Array, *, config: ModelConfig, batch: int, max_len: int,
                cache_dtype: str, layout: str, spec: Speculation | None = None,
                placement: tuple | None) -> Slots:
    """`batch` idle rows over a cache of `max_len` slots that stop on the ids `stop_S` (rows
    that speculate as `spec` says: cache ends of their own, their tokens, and a draft model's
    cache of as many slots)."""
    with placed(placement):
        B = batch
        cache = init_cache(config, B, max_len, cache_dtype, layout=layout)
        lookup = draft_cache = None
        if spec is not None and spec.method == "draft":
            draft_cache = init_cache(spec.draft_config, B, max_len, cache_dtype,
                                     layout=layout).with_row_ends()
        if spec is not None:
            cache = cache.with_row_ends()
            zeros_B = jnp.zeros((B,), jnp.int32)
            start_B = jnp.full((B,), HIT_RATE_START, jnp.float32)
            lookup = Lookup(jnp.zeros((B, max_len), jnp.int32), start_B, start_B, zeros_B,
                            zeros_B)
        return Slots(
            cache=cache, last_B=jnp.zeros((B,), jnp.int32), step_B=jnp.zeros((B,), jnp.int32),
            max_new_B=jnp.ones((B,), jnp.int32), done_B=jnp.ones((B,), bool),
            sampling=SamplingParams.broadcast(B), key_B=jax.random.split(jax.random.key(0), B),
            stop_S=stop_S, lookup=lookup, draft_cache=draft_cache)


def _choose(logits_BV, key_B, step_B, sampling, strategy: Strategy, top: int):
    """Each row's token of step `step_B` and the log-probabilities of its model distribution
    (before temperature and filters): of the token, and of the `top` most likely ones."""
    keys_B = jax.vmap(jax.random.fold_in)(key_B, step_B)
    token_B = sample(logits_BV, keys_B, sampling, strategy)
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32))
    logprob_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], -1)[:, 0]
    top_logprobs_Bn, top_ids_Bn = jax.lax.top_k(logprobs_BV, top)
    return token_B, logprob_B, top_ids_Bn, top_logprobs_Bn


def _advance(slots: Slots, token_B, active_B) -> Slots:
    """The rows after `token_B` was emitted where `active_B`."""
    step_B = slots.step_B + active_B
    stopped_B = jnp.any(token_B[:, None] == slots.stop_S, axis=-1)
    done_B = slots.done_B | (active_B & (stopped_B | (step_B >= slots.max_new_B)))
    return slots.replace(last_B=jnp.where(active_B, token_B, slots.last_B), step_B=step_B,
                         done_B=done_B)


def _decode_steps(config, params, slots: Slots, n_steps: int, strategy, top):
    def step(slots: Slots, _):
        logits_BV, cache = next_logits(config, params, slots.last_B, slots.cache)
        token_B, logprob_B, top_ids, top_logprobs = _choose(
            logits_BV, slots.key_B, slots.step_B, slots.sampling, strategy, top)
        active_B = ~slots.done_B
        emitted = (jnp.where(active_B, token_B, NO_TOKEN), logprob_B, top_ids, top_logprobs)
        return _advance(slots.replace(cache=cache), token_B, active_B), emitted

    slots, (tokens_KB, logprobs_KB, top_ids_KBn, top_logprobs_KBn) = jax.lax.scan(
        step, slots, length=n_steps)
    return slots, Emitted(tokens_KB.T, logprobs_KB.T, jnp.swapaxes(top_ids_KBn, 0, 1),
                          jnp.swapaxes(top_logprobs_KBn, 0, 1))


@functools.partial(jax.jit, static_argnames=("config", "n_steps", "strategy", "top",
                                             "placement"), donate_argnames=("slots",))
def decode(slots: Slots, params: Params, *, config: ModelConfig, n_steps: int,
           strategy: Strategy, top: int, placement: tuple | None) -> tuple[Slots, Emitted]:
    """`n_steps` decode steps of every row."""
    with placed(placement):
        return _decode_steps(config, params, slots, n_steps, strategy, top)


def _guesses(slots: Slots, end_B, draft_params, spec: Speculation, verify: bool, strategy,
             key_B):
    """Each row's guesses from its last token at its cache end `end_B` (k; a draft's in a
    round that does not verify: its first only, which keeps the draft's cache in step and
    its hit rate going), how many it has, the draft's distributions (None for prompt
    lookup) and the draft's cache."""
    k, tokens_BS = spec.k, slots.lookup.tokens_BS
    if spec.method == "ngram":
        guess_BK, n_guess_B = ngram_proposals(tokens_BS, end_B + 1, k, *spec.ngram)
        return guess_BK, n_guess_B, None, None
    k = k if verify else 1
    before_B = jnp.take_along_axis(tokens_BS, jnp.maximum(end_B - 1, 0)[:, None], 1)[:, 0]
    guess_BK, q_BKV, draft_cache = draft_proposals(
        spec.draft_config, draft_params, slots.draft_cache, end_B, before_B, slots.last_B,
        slots.sampling, k, strategy, key_B)
    return guess_BK, jnp.full_like(end_B, k), q_BKV, draft_cache


def _speculative_rounds(config, params, draft_params, slots: Slots, n_rounds: int,
                        spec: Speculation, verify: bool, strategy, top):
    k = spec.k
    T = k + 1
    B, S = slots.last_B.shape[0], slots.cache.max_len
    # Which rows verify their guesses is decided for the whole program by their own rates as
    # the host saw them (`deciding_rate_B`), so that a row's tokens never depend on which
    # program its neighbours made the host choose: a row worth verifying makes it choose
    # `verify`.
    worth_B = worth_verifying(slots.lookup.deciding_rate_B, ~slots.done_B, spec)
    rate_before_B = slots.lookup.hit_rate_B

    def round_(carry, _):
        slots, count_B, out = carry
        lookup, active_B = slots.lookup, ~slots.done_B
        # A row that is done still takes part in the pass: keep its writes in the cache.
        end_B = jnp.where(active_B, slots.cache.end, jnp.minimum(slots.cache.end, S - T))
        keys_B3 = jax.vmap(lambda key: jax.random.split(key, 3))(
            jax.vmap(jax.random.fold_in)(slots.key_B, slots.step_B))
        guess_BK, n_guess_B, q_BKV, draft_cache = _guesses(
            slots, end_B, draft_params, spec, verify, strategy, keys_B3[:, 0])
        proposing_B = active_B & (n_guess_B > 0)
        v = verify_or_step(config, params, slots.cache.replace(end=end_B), slots.last_B,
                           guess_BK, q_BKV, n_guess_B, slots.sampling, strategy, keys_B3[:, 1:],
                           worth_B & proposing_B, run_pass=verify)
        n_B, stopped_B = cut(v.tokens_BT, v.n_B, slots.max_new_B - slots.step_B, slots.done_B,
                             slots.stop_S[None, None, :])
        top_logprobs_BTn, top_ids_BTn = jax.lax.top_k(v.logprobs_BTV, top)
        out = Emitted(*(put_rows(buffer, count_B, values, n_B) for buffer, values in zip(
            (out.tokens_BK, out.logprobs_BK, out.top_ids_BKn, out.top_logprobs_BKn),
            (v.tokens_BT, token_logprobs(v.logprobs_BTV, v.tokens_BT), top_ids_BTn,
             top_logprobs_BTn))))
        verified_B = proposing_B & v.verified_B
        lookup = lookup.replace(
            tokens_BS=put_rows(lookup.tokens_BS, end_B + 1, v.tokens_BT, n_B),
            hit_rate_B=updated_rate(lookup.hit_rate_B, v.hit_B, proposing_B),
            drafted_B=lookup.drafted_B + jnp.where(verified_B, n_guess_B, 0),
            accepted_B=lookup.accepted_B + jnp.where(verified_B, v.kept_B, 0))
        step_B = slots.step_B + n_B
        last_B = jnp.take_along_axis(v.tokens_BT, jnp.maximum(n_B - 1, 0)[:, None], 1)[:, 0]
        slots = slots.replace(
            cache=v.cache.replace(end=end_B + n_B), last_B=jnp.where(n_B > 0, last_B,
                                                                    slots.last_B),
            step_B=step_B, lookup=lookup, draft_cache=draft_cache,
            done_B=slots.done_B | (active_B & (stopped_B | (step_B >= slots.max_new_B))))
        return (slots, count_B + n_B, out), None

    W = n_rounds * T  # each row's tokens from column 0, NO_TOKEN after them
    out = Emitted(jnp.full((B, W), NO_TOKEN, jnp.int32), jnp.zeros((B, W), jnp.float32),
                  jnp.zeros((B, W, top), jnp.int32), jnp.zeros((B, W, top), jnp.float32))
    (slots, _, out), _ = jax.lax.scan(round_, (slots, jnp.zeros((B,), jnp.int32), out),
                                      length=n_rounds)
    lookup = slots.lookup
    return (slots.replace(lookup=lookup.replace(deciding_rate_B=rate_before_B)),
            out.replace(drafted_B=lookup.drafted_B, accepted_B=lookup.accepted_B,
                        hit_rate_B=lookup.hit_rate_B))


@functools.partial(jax.jit, static_argnames=("config", "n_steps", "spec", "verify", "strategy",
                                             "top", "placement"), donate_argnames=("slots",))
def speculate(slots: Slots, params: Params, draft_params: Params | None = None, *,
              config: ModelConfig, n_steps: int, spec: Speculation, verify: bool,
              strategy: Strategy, top: int, placement: tuple | None) -> tuple[Slots, Emitted]:
    """`n_steps` speculative rounds of every row (slots with `lookup`): each row's tokens of
    the rounds, from column 0, and its guesses verified and kept so far. With `verify`,
    every round runs a verify pass, in which the rows worth it (`speculate.worth_verifying`
    at the program's start) verify their guesses; without, every round is a plain step (the
    host chooses, by `speculate.worth_verifying` of the rates the program before the last
    returned). The guesses are prompt lookup's, or a draft model's (`draft_params`, its
    cache in the slots; without `verify`, one step of it a round keeps its cache in step)."""
    with placed(placement):
        return _speculative_rounds(config, params, draft_params, slots, n_steps, spec, verify,
                                   strategy, top)



def check_prefill_chunk(chunk: int) -> None:
    """Refuses a prefill chunk that is not a power of two >= MIN_BUCKET."""
    if chunk < MIN_BUCKET or chunk & (chunk - 1):
        raise GenerateError(f"prefill_chunk={chunk} must be a power of two >= {MIN_BUCKET}")


def chunk_plan(n: int, start: int, chunk: int, max_len: int) -> list[tuple[int, int]]:
    """The chunks `(start, L)` that prefill a prompt of n tokens from token `start` (after
    the chunks a prefix cache restored): full chunks of `chunk` tokens, the last padded to a
    power of two (at least MIN_BUCKET), no chunk past `max_len` slots. A prompt always runs
    the same chunks from the same start."""
    chunks = []
    while start < n:
        L = min(bucket(n - start), chunk, max_len - start)
        chunks.append((start, L))
        start += L
    return chunks


def chunk_capacity(start: int, L: int) -> int:
    """The slots of a prompt's cache after its chunk `(start, L)`: the next power of two of the
    chunk's end (at least MIN_BUCKET), so that the chunks compile a program per capacity."""
    return bucket(start + L)


def chunk_shapes(chunk: int, max_len: int) -> list[tuple[int, int]]:
    """Every `(start, L)` the prompts of a server of `max_len` tokens prefill (a prompt leaves
    at least one token for the output)."""
    return sorted(set().union(*(chunk_plan(n, 0, chunk, max_len) for n in range(1, max_len))))


@functools.partial(jax.jit, static_argnames=("config", "max_len", "cache_dtype", "layout",
                                             "placement"))
def prefill_chunk(params: Params, one: KVCache | None, tokens_1L: jax.Array, last: jax.Array,
                  next_1L: jax.Array | None = None, *, config: ModelConfig, max_len: int,
                  cache_dtype: str, layout: str, placement: tuple | None
                  ) -> tuple[KVCache, jax.Array, Emitted | None]:
    """One chunk of a prompt prefilled into its one-row cache: the L tokens `tokens_1L` at
    slots `one.end ..` (`one` holds the prompt before them: None at the first chunk; the
    tokens after index `last` are padding). Returns the cache in `max_len` slots (the next
    power of two of the chunk's end: `chunk_capacity`), ending after token `last`; the logits
    `[1, V]` after it; and, given `next_1L` (each token's successor in the prompt), their
    log-probabilities and top alternatives.

    Where the chunk starts is an input, not part of the program, so that prompts compile one
    program per capacity and length; a chunk's values depend only on the prompt up to its end,
    so a prompt runs the same programs on the same inputs whatever was cached."""
    with placed(placement):
        if one is None:
            one = init_cache(config, 1, max_len, cache_dtype, layout=layout)
        else:
            one = resized(one, max_len)
        h_1LD, one, _ = apply(config, params, tokens_1L, cache=one)
        one = one.replace(end=one.end - tokens_1L.shape[1] + last + 1)
        h_1D = jax.lax.dynamic_index_in_dim(h_1LD, last, axis=1, keepdims=False)
        logits_1V = lm_head(config, params, h_1D[:, None])[:, 0]
        if next_1L is None:
            return one, logits_1V, None
        logprobs_1LV = jax.nn.log_softmax(lm_head(config, params, h_1LD).astype(jnp.float32))
        top_logprobs_1Ln, top_ids_1Ln = jax.lax.top_k(logprobs_1LV, TOP_LOGPROBS)
        return one, logits_1V, Emitted(next_1L, jnp.take_along_axis(
            logprobs_1LV, next_1L[..., None], -1)[..., 0], top_ids_1Ln, top_logprobs_1Ln)


@functools.partial(jax.jit, donate_argnames=("slots",))
def insert(slots: Slots, one: KVCache, logits_1V: jax.Array, row: jax.Array,
           max_new: jax.Array, sampling: SamplingParams, key_1: jax.Array,
           prompt_1S: jax.Array | None = None, draft_one: KVCache | None = None
           ) -> tuple[Slots, Emitted]:
    """Row `row` holding a prefilled request: its one-row cache placed to end at the cache's
    `end` (with `lookup`: from slot 0, its prompt's tokens `prompt_1S` beside it, and the
    draft model's cache of the prompt `draft_one` where the slots hold a draft's), its
    settings, and its first token, sampled from the prompt's last `logits_1V` with the
    request's key (its step 0), which it also returns."""
    token_1, logprob_1, top_ids, top_logprobs = _choose(
        logits_1V, key_1, jnp.zeros((1,), jnp.int32), sampling, PREFILL_STRATEGY, TOP_LOGPROBS)
    first = Emitted(token_1[:, None], logprob_1[:, None], top_ids[:, None],
                    top_logprobs[:, None])
    one = resized(one, slots.cache.max_len)
    put = lambda rows, value: rows.at[row].set(value[0])  # noqa: E731
    if slots.lookup is None:
        one = shifted(one, slots.cache.end - one.end)
    else:
        zero = jnp.zeros((), jnp.int32)
        slots = slots.replace(lookup=slots.lookup.replace(
            tokens_BS=put(slots.lookup.tokens_BS, prompt_1S.at[0, one.end].set(token_1[0])),
            hit_rate_B=slots.lookup.hit_rate_B.at[row].set(HIT_RATE_START),
            deciding_rate_B=slots.lookup.deciding_rate_B.at[row].set(HIT_RATE_START),
            drafted_B=slots.lookup.drafted_B.at[row].set(zero),
            accepted_B=slots.lookup.accepted_B.at[row].set(zero)))
    if draft_one is not None:
        slots = slots.replace(draft_cache=with_row(
            slots.draft_cache, row, resized(draft_one, slots.cache.max_len)))
    slots = slots.replace(
        cache=with_row(slots.cache, row, one), step_B=slots.step_B.at[row].set(0),
        max_new_B=slots.max_new_B.at[row].set(max_new), done_B=slots.done_B.at[row].set(False),
        key_B=put(slots.key_B, key_1), sampling=jax.tree.map(put, slots.sampling, sampling))
    token_B = jnp.full_like(slots.last_B, token_1[0])
    return _advance(slots, token_B, jnp.arange(token_B.shape[0]) == row), first


@functools.partial(jax.jit, static_argnames=("max_len", "window"), donate_argnames=("slots",))
def rearrange(slots: Slots, shift: jax.Array, *, max_len: int, window: bool = False) -> Slots:
    """The rows' slots moved `shift` later, then the cache resized to `max_len` slots (grown
    before the move, cut after it). With `window` (the new slots a window of the old, or the
    old of the new, as `kv_cache.moved` requires) in one copy."""
    cache = slots.cache
    if window:
        return slots.replace(cache=moved(cache, shift, max_len))
    if max_len > cache.max_len:
        cache = resized(cache, max_len)
    cache = shifted(cache, shift)
    if max_len < cache.max_len:
        cache = resized(cache, max_len)
    return slots.replace(cache=cache)


def lower_programs(config: ModelConfig, params: Params, *, max_batch: int, prompt_len: int,
                   chunk: int, cache_slots: int, steps: int, cache_dtype: str, layout: str,
                   mesh_config: MeshConfig | None = None, spec: Speculation | None = None,
                   draft_params: Params | None = None,
                   ) -> tuple[dict[str, jax.stages.Lowered], Slots]:
    """The largest programs a server of `max_batch` rows runs, lowered without running
    anything: the last prefill chunk of a `prompt_len`-token prompt (in chunks of `chunk`),
    its insertion, and `steps` decode steps with every sampling path and top
    log-probabilities, over a cache of `cache_slots`. A server that speculates as `spec`
    says runs `steps` rounds that verify instead of the decode steps, and with a draft model
    (`draft_params`) the draft's last prefill chunk too.
    `params` may be abstract (`jax.ShapeDtypeStruct`s placed on the devices of any platform;
    on a mesh, laid out by `mesh_config`'s rules). Returns them by name, and the slots they
    run over (abstract, laid out as `empty_slots` lays them out there)."""
    mesh = sharding.mesh_of(params)
    placement = None if mesh is None else (mesh, mesh_config or MeshConfig())
    if mesh is None:
        device = next(iter(jax.tree.leaves(params)[0].sharding.device_set))
        beside = jax.sharding.SingleDeviceSharding(device)
    else:
        beside = sharding.replicated(mesh)

    def placed_like(tree, shardings=None):
        shardings = shardings or jax.tree.map(lambda _: beside, tree)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s),
                            tree, shardings)

    stop_S = placed_like(np.zeros((1,), np.int32))

    def empty(max_len: int) -> jax.stages.Lowered:
        return empty_slots.lower(stop_S, config=config, batch=max_batch, max_len=max_len,
                                 cache_dtype=cache_dtype, layout=layout, spec=spec,
                                 placement=placement)

    # The cache rules lay the slots out alike at any length: one slot's program is compiled
    # to learn the layout (the full one might not fit, and that is for the decode to say).
    layout_of = jax.tree.leaves(empty(1).compile().output_shardings)
    full = empty(cache_slots).out_info
    slots = placed_like(full, jax.tree.unflatten(jax.tree.structure(full), layout_of))
    start, L = chunk_plan(prompt_len, 0, chunk, prompt_len)[-1]
    tokens = placed_like((np.zeros((1, L), np.int32), np.int32(L - 1)))

    def last_chunk(config: ModelConfig, params: Params) -> jax.stages.Lowered:
        before = None if start == 0 else placed_like(jax.eval_shape(
            lambda: init_cache(config, 1, chunk_capacity(0, start), cache_dtype, layout=layout)))
        return prefill_chunk.lower(params, before, *tokens, config=config,
                                   max_len=chunk_capacity(start, L), cache_dtype=cache_dtype,
                                   layout=layout, placement=placement)

    sampling = placed_like(SamplingParams.broadcast(1))
    key_1 = jax.ShapeDtypeStruct((1,), jax.random.key(0).dtype, sharding=beside)
    lowered = {"prefill": last_chunk(config, params)}
    one, logits, _ = (placed_like(x) for x in lowered["prefill"].out_info)
    prompt_1S = draft_one = None
    if spec is not None:
        prompt_1S = placed_like(np.zeros((1, cache_slots), np.int32))
    if draft_params is not None:
        lowered["draft prefill"] = last_chunk(spec.draft_config, draft_params)
        draft_one = placed_like(lowered["draft prefill"].out_info[0])
    lowered["insert"] = insert.lower(slots, one, logits, *placed_like((np.int32(0), np.int32(1))),
                                     sampling, key_1, prompt_1S, draft_one)
    if spec is None:
        lowered["decode"] = decode.lower(slots, params, config=config, n_steps=steps,
                                         strategy=WIDEST_STRATEGY, top=TOP_LOGPROBS,
                                         placement=placement)
    else:
        lowered["speculate"] = speculate.lower(slots, params, draft_params, config=config,
                                               n_steps=steps, spec=spec, verify=True,
                                               strategy=WIDEST_STRATEGY, top=TOP_LOGPROBS,
                                               placement=placement)
    return lowered, slots
