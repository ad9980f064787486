"""The device programs of continuous batching (`serve/engine.py` drives them from the host):
a fixed set of decode rows — the slots — that requests enter and leave.

The slots are one batch of B rows: a KV cache (model/kv_cache.py) and each row's last token,
step, settings and key, kept on the device and donated to every program that updates them:
- `empty_slots`: B idle rows over a cache of a given size, laid out by the cache rules on a mesh;
- `prefill`: one request's prompt (left-padded to T) into a one-row cache, and its first token;
- `insert`: that one-row cache written over a row, ending at the slots' write slot `end`;
- `decode`: K decode steps of every row (`generate.next_logits`, the step `generate` takes);
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
from llama_jax.decode.generate import NO_TOKEN, next_logits, placed
from llama_jax.decode.sampling import SamplingParams, Strategy, sample
from llama_jax.model.kv_cache import KVCache, init_cache, resized, shifted, with_row
from llama_jax.model.params import Params
from llama_jax.model.transformer import apply
from llama_jax.nn.heads import lm_head
from llama_jax.parallel import sharding

TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit)
# The strategy of a prefill: it samples one token per request, so it always takes every path
# and compiles once per shape.
PREFILL_STRATEGY = Strategy(draw=True, sort=True)
# The decode strategy that takes every path (a batch with a row using top-k or top-p), with
# top log-probabilities: the largest decode program.
WIDEST_STRATEGY = Strategy(draw=True, sort=True)


@struct.dataclass
class Slots:
    """The decode rows on the device."""

    cache: KVCache
    last_B: jax.Array  # [B] int32: the token to feed next
    step_B: jax.Array  # [B] int32: tokens generated so far
    max_new_B: jax.Array  # [B] int32
    done_B: jax.Array  # [B] bool: stopped (a stop token or max_new); idles until freed
    sampling: SamplingParams
    key_B: jax.Array  # [B] typed keys
    stop_S: jax.Array  # [n_stop] int32: the ids that end a request


@struct.dataclass
class Emitted:
    """Per row, the tokens of K steps (NO_TOKEN where the row was done), their
    log-probabilities and the `top` most likely tokens of each step."""

    tokens_BK: jax.Array
    logprobs_BK: jax.Array
    top_ids_BKn: jax.Array
    top_logprobs_BKn: jax.Array


@functools.partial(jax.jit, static_argnames=("config", "batch", "max_len", "cache_dtype",
                                             "layout", "placement"))
def empty_slots(stop_S: jax.Array, *, config: ModelConfig, batch: int, max_len: int,
                cache_dtype: str, layout: str, placement: tuple | None) -> Slots:
    """`batch` idle rows over a cache of `max_len` slots that stop on the ids `stop_S`."""
    with placed(placement):
        B = batch
        return Slots(
            cache=init_cache(config, B, max_len, cache_dtype, layout=layout),
            last_B=jnp.zeros((B,), jnp.int32), step_B=jnp.zeros((B,), jnp.int32),
            max_new_B=jnp.ones((B,), jnp.int32), done_B=jnp.ones((B,), bool),
            sampling=SamplingParams.broadcast(B), key_B=jax.random.split(jax.random.key(0), B),
            stop_S=stop_S)


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


@functools.partial(jax.jit, static_argnames=("config", "cache_dtype", "layout", "placement",
                                             "score_prompt"))
def prefill(params: Params, prompt_1T: jax.Array, n: jax.Array, sampling: SamplingParams,
            key_1: jax.Array, *, config: ModelConfig, cache_dtype: str, layout: str,
            placement: tuple | None, score_prompt: bool
            ) -> tuple[KVCache, Emitted, Emitted | None]:
    """The one-row cache of a request whose `n` prompt tokens end `prompt_1T` (left-padded to
    T), its first token and, with `score_prompt`, the log-probabilities of the prompt's tokens
    1..T-1 given those before them (and their top alternatives)."""
    with placed(placement):
        T = prompt_1T.shape[1]
        one = init_cache(config, 1, T, cache_dtype, (T - n)[None], layout=layout)
        h_1TD, one, _ = apply(config, params, prompt_1T, cache=one)
        logits_1TV = lm_head(config, params, h_1TD if score_prompt else h_1TD[:, -1:])
        token_1, logprob_1, top_ids, top_logprobs = _choose(
            logits_1TV[:, -1], key_1, jnp.zeros((1,), jnp.int32), sampling, PREFILL_STRATEGY,
            TOP_LOGPROBS)
        first = Emitted(token_1[:, None], logprob_1[:, None], top_ids[:, None],
                        top_logprobs[:, None])
        if not score_prompt:
            return one, first, None
        logprobs_1TV = jax.nn.log_softmax(logits_1TV[:, :-1].astype(jnp.float32))
        top_logprobs_1Tn, top_ids_1Tn = jax.lax.top_k(logprobs_1TV, TOP_LOGPROBS)
        next_1T = prompt_1T[:, 1:]
        return one, first, Emitted(next_1T, jnp.take_along_axis(
            logprobs_1TV, next_1T[..., None], -1)[..., 0], top_ids_1Tn, top_logprobs_1Tn)


@functools.partial(jax.jit, donate_argnames=("slots",))
def insert(slots: Slots, one: KVCache, first: Emitted, row: jax.Array, max_new: jax.Array,
           sampling: SamplingParams, key_1: jax.Array) -> Slots:
    """Row `row` holding a prefilled request: its one-row cache placed to end at the cache's
    `end`, its settings, and its first token."""
    one = shifted(resized(one, slots.cache.max_len), slots.cache.end - one.end)
    put = lambda rows, value: rows.at[row].set(value[0])  # noqa: E731
    slots = slots.replace(
        cache=with_row(slots.cache, row, one), step_B=slots.step_B.at[row].set(0),
        max_new_B=slots.max_new_B.at[row].set(max_new), done_B=slots.done_B.at[row].set(False),
        key_B=put(slots.key_B, key_1), sampling=jax.tree.map(put, slots.sampling, sampling))
    token_B = jnp.full_like(slots.last_B, first.tokens_BK[0, 0])
    return _advance(slots, token_B, jnp.arange(token_B.shape[0]) == row)


@functools.partial(jax.jit, static_argnames=("max_len",), donate_argnames=("slots",))
def rearrange(slots: Slots, shift: jax.Array, *, max_len: int) -> Slots:
    """The rows' slots moved `shift` later, then the cache resized to `max_len` slots (grown
    before the move, cut after it)."""
    cache = slots.cache
    if max_len > cache.max_len:
        cache = resized(cache, max_len)
    cache = shifted(cache, shift)
    if max_len < cache.max_len:
        cache = resized(cache, max_len)
    return slots.replace(cache=cache)


def lower_programs(config: ModelConfig, params: Params, *, max_batch: int, prompt_len: int,
                   cache_slots: int, steps: int, cache_dtype: str, layout: str,
                   mesh_config: MeshConfig | None = None,
                   ) -> tuple[dict[str, jax.stages.Lowered], Slots]:
    """The largest programs a server of `max_batch` rows runs, lowered without running
    anything: the prefill of a `prompt_len`-token prompt, its insertion, and `steps` decode
    steps with every sampling path and top log-probabilities, over a cache of `cache_slots`.
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
                                 cache_dtype=cache_dtype, layout=layout, placement=placement)

    # The cache rules lay the slots out alike at any length: one slot's program is compiled
    # to learn the layout (the full one might not fit, and that is for the decode to say).
    layout_of = jax.tree.leaves(empty(1).compile().output_shardings)
    full = empty(cache_slots).out_info
    slots = placed_like(full, jax.tree.unflatten(jax.tree.structure(full), layout_of))
    one_row = placed_like((np.zeros((1, prompt_len), np.int32), np.int32(prompt_len),
                           SamplingParams.broadcast(1)))
    key_1 = jax.ShapeDtypeStruct((1,), jax.random.key(0).dtype, sharding=beside)
    lowered = {"prefill": prefill.lower(params, *one_row, key_1, config=config,
                                        cache_dtype=cache_dtype, layout=layout,
                                        placement=placement, score_prompt=False)}
    one, first, _ = (placed_like(x) for x in lowered["prefill"].out_info)
    lowered["insert"] = insert.lower(slots, one, first, *placed_like((np.int32(0), np.int32(1))),
                                     one_row[2], key_1)
    lowered["decode"] = decode.lower(slots, params, config=config, n_steps=steps,
                                     strategy=WIDEST_STRATEGY, top=TOP_LOGPROBS,
                                     placement=placement)
    return lowered, slots
