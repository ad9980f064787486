"""Jit-compiled generation: prefill, then a `lax.while_loop` of decode steps over a donated state.

    new_tokens = llama_jax.generate(config, params, [[1, 415, 2936], [1, 22]], 64,
                                    temperature=0.7, top_p=0.9, seed=0)

Shapes are padded to buckets (batch to a power of two; prompt length and new tokens to powers
of two, at least 16) so that new prompts rarely recompile; each bucket compiles two executables,
`prefill` and `decode`, once. Prompts are left-padded into one KV cache (model/kv_cache.py): each
row keeps its own positions and never sees the padding, so a row generates exactly what it
would generate alone. The decode loop exits early once every row has stopped; it runs in chunks
of steps (`stream`) so a caller can print text as it comes at the cost of one host round trip
per chunk.

Sampling: see sampling.py. The random key for step s is `fold_in(key(seed), s)`, so results do
not depend on the chunking. Log-probabilities are those of the model's distribution (before
temperature and filters) for the chosen tokens. Which decoder runs (scan or unrolled) and
whether its copy and cache fit: decoder.py.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import warnings
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.parallel import sharding, target
from llama_jax.config import MeshConfig, ModelConfig, cache_dtype_name
from llama_jax.errors import ConfigError, GenerateError
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply
from llama_jax.nn.attention.dot_product import chosen_attention
from llama_jax.nn.heads import is_task_head, lm_head
from llama_jax.model.params import Params
from llama_jax.decode.decoder import (cache_bytes_per_device, decoder_params, is_unstacked,
                                      resolve_decode_impl)
from llama_jax.decode.sampling import SamplingParams, Strategy, check_settings
from llama_jax.decode.speculate import (SpecState, Speculation, speculation,
                                        speculative_round, start_speculation)
from llama_jax.decode.step import (NO_TOKEN, DecodeState, check_prompt, decode_step, emit,
                                   stop_table)
from llama_jax.parallel.sharding import placed
from llama_jax.shapes import bucket



@dataclasses.dataclass
class GenerationStats:
    compile_s: float = 0.0
    time_to_first_token_s: float = 0.0  # prefill and the first token, compile excluded
    decode_s: float = 0.0  # every step after the first token
    new_tokens: int = 0  # tokens generated across rows, stop tokens excluded
    truncated: bool = False  # max_new_tokens was cut to fit the context
    drafted_tokens: int = 0  # speculative guesses verified (all rows)
    accepted_tokens: int = 0  # of those, kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(self.drafted_tokens, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.decode_s + self.time_to_first_token_s, 1e-9)


@functools.partial(jax.jit, static_argnames=("config", "cache_len", "n_out", "cache_dtype",
                                             "strategy", "spec", "placement"))
def _prefill(config: ModelConfig, params: Params, prompts_BT: jax.Array, start_B: jax.Array,
             active_B: jax.Array, stop_BS: jax.Array, sampling: SamplingParams,
             max_new: jax.Array, key: jax.Array, draft_params: Params | None = None, *,
             cache_len: int, n_out: int, cache_dtype: str, strategy: Strategy,
             spec: Speculation | None = None, placement: tuple | None
             ) -> DecodeState | SpecState:
    """The prompts' cache and each row's first token; with `spec`, the speculative carry
    (and the draft model's cache of the prompts, for a draft)."""
    with placed(placement):
        state = _prefill_state(config, params, prompts_BT, start_B, active_B, stop_BS, sampling,
                               max_new, key, cache_len, n_out, cache_dtype, strategy)
        if spec is None:
            return state
        draft_cache = None
        if spec.draft_config is not None:
            draft_cache = init_cache(spec.draft_config, prompts_BT.shape[0], cache_len,
                                     cache_dtype, start_B, layout=_layout(draft_params))
            draft_cache = apply(spec.draft_config, draft_params, prompts_BT,
                                cache=draft_cache).cache
        return start_speculation(state, prompts_BT, start_B, spec, draft_cache)


def _layout(params: Params) -> str:
    """The cache layout of the decoder that runs `params`."""
    return "per_layer" if is_unstacked(params) else "stacked"


def _prefill_state(config, params, prompts_BT, start_B, active_B, stop_BS, sampling, max_new,
                   key, cache_len, n_out, cache_dtype, strategy) -> DecodeState:
    B = prompts_BT.shape[0]
    cache = init_cache(config, B, cache_len, cache_dtype, start_B, layout=_layout(params))
    h_BTD, cache, _ = apply(config, params, prompts_BT, cache=cache)
    state = DecodeState(
        cache=cache, tokens_BN=jnp.full((B, n_out), NO_TOKEN, jnp.int32),
        logprobs_BN=jnp.zeros((B, n_out), jnp.float32), last_B=prompts_BT[:, -1],
        done_B=~active_B, step=jnp.zeros((), jnp.int32), max_new=max_new, stop_BS=stop_BS,
        sampling=sampling, key=key)
    return emit(state, lm_head(config, params, h_BTD[:, -1:])[:, 0], strategy)


@functools.partial(jax.jit, static_argnames=("config", "strategy", "spec", "placement"),
                   donate_argnames=("state",))
def _decode(config: ModelConfig, params: Params, state: DecodeState | SpecState,
            n_steps: jax.Array, draft_params: Params | None = None, *, strategy: Strategy,
            spec: Speculation | None = None, placement: tuple | None
            ) -> DecodeState | SpecState:
    """Up to `n_steps` decode steps (speculative rounds, with `spec`); stops early when
    every row is done."""
    with placed(placement):
        return _decode_steps(config, params, state, n_steps, strategy, spec, draft_params)


def _decode_steps(config, params, state, n_steps, strategy, spec, draft_params):
    def keep_going(carry):
        i, st = carry
        return (i < n_steps) & ~jnp.all(_base(st).done_B)

    def step(carry):
        i, st = carry
        if spec is None:
            return i + 1, decode_step(config, params, st, strategy)
        return i + 1, speculative_round(config, params, st, spec, strategy, draft_params)

    _, state = jax.lax.while_loop(keep_going, step, (jnp.zeros((), jnp.int32), state))
    return state


def _base(state: DecodeState | SpecState) -> DecodeState:
    """The plain decode loop's part of a carry."""
    return state.base if isinstance(state, SpecState) else state


# Compiled prefill/decode programs by signature, least recently used first. Bounded: every
# executable holds its machine code (on CPU, memory mappings of its own, of which a process may
# have vm.max_map_count), and a long-lived process decoding many shapes would keep them all.
_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()
_MAX_EXECUTABLES = 64


def _compiled(fn, stats: GenerationStats, mesh_config: MeshConfig | None, *args, **static):
    """AOT-compiles `fn` once per (static args, argument shapes and shardings, mesh rules) so
    compile time can be reported apart from run time; returns the executable (called with the
    non-static args). Parameters on a mesh compile under `mesh_config`'s rules (the default
    rules when None): the cache and activations are laid out by them."""
    mesh = sharding.mesh_of(args)
    static["placement"] = None if mesh is None else (mesh, mesh_config or MeshConfig())
    leaves, treedef = jax.tree.flatten(args)
    signature = tuple((np.shape(x), jnp.result_type(x), getattr(x, "sharding", None))
                      if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x
                      for x in leaves)  # the config is a (hashable) leaf of its own
    key = (fn, tuple(sorted(static.items())), treedef, signature)
    if key not in _EXECUTABLES:
        start = time.perf_counter()
        _EXECUTABLES[key] = fn.lower(*args, **static).compile()
        stats.compile_s += time.perf_counter() - start
        if len(_EXECUTABLES) > _MAX_EXECUTABLES:
            _EXECUTABLES.popitem(last=False)
    _EXECUTABLES.move_to_end(key)
    return _EXECUTABLES[key]


def _validate(config: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    if is_task_head(config):
        raise GenerateError(f"the model has a task head ({config.head!r}), not the LM head: "
                            "it cannot generate (predict with `python -m llama_jax.eval.predict`)")
    if not prompts:
        raise GenerateError("prompts is empty: give at least one prompt (a list of token ids)")
    for i, prompt in enumerate(prompts):
        check_prompt(prompt, config.vocab_size, f"prompt {i}")
        if len(prompt) >= config.max_seq_len:
            raise GenerateError(f"prompt {i} has {len(prompt)} tokens; the model's context "
                                f"(max_seq_len) is {config.max_seq_len}, leaving no room to "
                                "generate")
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens={max_new_tokens} must be >= 1")
    check_settings(temperature, top_k, top_p, min_p)
    try:  # the decoders attend without it (a step, a verify pass), the prompt with it
        chosen_attention(config)
    except ConfigError as e:
        raise GenerateError(str(e)) from None


def stream(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]],
           max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
           stop_tokens: Sequence[int] | None = None, cache_dtype=None,
           decode_impl: str = "auto", mesh_config: MeshConfig | None = None,
           chunk_steps: int | None = 16, stats: GenerationStats | None = None,
           speculate: str | None = None, num_speculative_tokens: int = 4,
           ngram: tuple[int, int] = (1, 3), min_accepted: float | None = None,
           draft: tuple[ModelConfig, Params] | None = None,
           ) -> Iterator[tuple[list[list[int]], list[list[float]]]]:
    """Yields, after the first token and then after every `chunk_steps` decode steps, each
    row's newly generated tokens and their log-probabilities (stop tokens excluded).
    `chunk_steps=None` runs the whole decode in one call. `stats` is filled in if given.
    `cache_dtype` (any dtype-like, or "int8": int8 values with a float32 scale per cached
    vector) defaults to the model's compute dtype; `decode_impl` is
    one of `decoder.DECODE_IMPLS`; parameters on a mesh decode under `mesh_config`'s rules.
    Speculative decoding (the same output distribution; greedy output the same tokens):
    `speculate="ngram"` guesses by prompt lookup (`ngram`: the n-gram sizes matched), or
    `draft=(draft_config, draft_params)` by a small model sharing the vocabulary;
    `num_speculative_tokens` guesses per verify pass (a step of `chunk_steps` is a round).
    A row verifies prompt lookup's guesses only while it may expect to keep at least
    `min_accepted` of them per pass, from how often its first guess has been right
    (`speculate.worth_verifying`), taking plain steps otherwise (None: the break-even of
    `speculate.verify_cost`; 0: always verify)."""
    _validate(config, prompts, max_new_tokens, temperature, top_k, top_p, min_p)
    try:
        cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)
    except ConfigError as e:
        raise GenerateError(str(e)) from None
    stats = stats if stats is not None else GenerationStats()
    longest = max(len(p) for p in prompts)
    max_new = min(max_new_tokens, config.max_seq_len - longest)
    if max_new < max_new_tokens:
        stats.truncated = True
        warnings.warn(f"the context is full: generating at most {max_new} of {max_new_tokens} "
                      f"new tokens (longest prompt {longest}, max_seq_len {config.max_seq_len})",
                      stacklevel=2)
    stops = stop_table(config, stop_tokens)

    B, T, N = bucket(len(prompts), 1), bucket(longest), bucket(max_new)
    spec = speculation(config, speculate, num_speculative_tokens, ngram, draft, B,
                       min_accepted, target.platform_of_tree(params))
    prompts_BT = np.zeros((B, T), np.int32)
    start_B = np.full((B,), T - 1, np.int32)  # padding rows: one token, inactive
    for b, prompt in enumerate(prompts):
        prompts_BT[b, T - len(prompt):] = prompt
        start_B[b] = T - len(prompt)
    active_B = np.arange(B) < len(prompts)
    stop_BS = np.tile(np.asarray(stops, np.int32), (B, 1))
    sampling = SamplingParams.broadcast(B, temperature, top_k, top_p, min_p)
    strategy = Strategy.of(temperature, top_k, top_p)
    # A verify pass writes k + 1 slots past a row's end, the last of them for a row about to
    # finish.
    cache_len = T + N + (0 if spec is None else spec.k + 1)
    impl = resolve_decode_impl(decode_impl, params, cache_bytes_per_device(
        config, params, B, cache_len, cache_dtype, mesh_config))
    params = decoder_params(params, impl)
    draft_params = None if draft is None else decoder_params(draft[1], impl)
    args = (config, params, prompts_BT, start_B, active_B, stop_BS, sampling,
            np.int32(max_new), jax.random.key(seed), draft_params)
    prefill = _compiled(_prefill, stats, mesh_config, *args, cache_len=cache_len, n_out=N,
                        cache_dtype=cache_dtype, strategy=strategy, spec=spec)
    start = time.perf_counter()
    state = prefill(*args[1:])
    rows = len(prompts)  # rows past len(prompts) are batch padding
    emitted_B = np.zeros(rows, np.int64)
    while True:
        base = _base(state)
        count_B = (np.asarray(state.count_B)[:rows] if spec is not None  # waits for the device
                   else np.full(rows, int(base.step)))
        tokens_BN, logprobs_BN = np.asarray(base.tokens_BN), np.asarray(base.logprobs_BN)
        new = _new_tokens(tokens_BN[:rows], logprobs_BN[:rows], emitted_B, count_B, stops)
        stats.new_tokens += sum(len(t) for t in new[0])
        if spec is not None:
            stats.drafted_tokens, stats.accepted_tokens = int(state.drafted), int(state.kept)
        elapsed = time.perf_counter() - start
        if not emitted_B.any():
            stats.time_to_first_token_s = elapsed
        else:
            stats.decode_s += elapsed
        emitted_B = count_B
        yield new
        if bool(np.all(np.asarray(base.done_B))):
            return
        n_steps = np.int32(chunk_steps or N)
        decode = _compiled(_decode, stats, mesh_config, config, params, state, n_steps,
                           draft_params, strategy=strategy, spec=spec)
        start = time.perf_counter()
        state = decode(params, state, n_steps, draft_params)


def lower_programs(config: ModelConfig, params: Params, *, batch: int, prompt_len: int,
                   new_tokens: int, cache_dtype: str,
                   ) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """The greedy prefill program `stream` would run for `batch` prompts of `prompt_len` tokens
    and `new_tokens` more, and one step of its decode loop (`decode_step`, whose cost is the
    loop's per token), lowered without running anything: `params` may
    be abstract (`jax.ShapeDtypeStruct`s placed on one device of any platform, stacked for the
    scan decoder or unstacked for the unrolled one), and every other input is placed beside
    them. What `llama_jax.aot` compiles for hardware this host does not have."""
    device = next(iter(jax.tree.leaves(params)[0].sharding.device_set))
    here = jax.sharding.SingleDeviceSharding(device)

    def placed_like(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype,
                                                           sharding=here), tree)

    B, T, N = batch, bucket(prompt_len), bucket(new_tokens)
    inputs = placed_like((
        np.zeros((B, T), np.int32), np.zeros((B,), np.int32), np.ones((B,), bool),
        np.zeros((B, 1), np.int32), SamplingParams.broadcast(B), np.int32(N)))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=here)
    static = dict(strategy=Strategy.of(0.0, 0, 1.0), placement=None)
    prefill = _prefill.lower(config, params, *inputs, key, cache_len=T + N, n_out=N,
                             cache_dtype=cache_dtype, **static)
    state = placed_like(prefill.out_info)  # the decode loop's state, as prefill leaves it
    one_step = jax.jit(functools.partial(decode_step, config, strategy=static["strategy"]),
                       donate_argnames="state")
    return prefill, one_step.lower(params, state)


def _new_tokens(tokens_BN: np.ndarray, logprobs_BN: np.ndarray, begin_B: np.ndarray,
                end_B: np.ndarray, stops: Sequence[int]
                ) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's columns [begin, end), without NO_TOKEN slots and stop tokens."""
    tokens, logprobs = [], []
    for row, lp, begin, end in zip(tokens_BN, logprobs_BN, begin_B, end_B):
        row, lp = row[begin:end], lp[begin:end]
        keep = (row != NO_TOKEN) & ~np.isin(row, stops)
        tokens.append(row[keep].tolist())
        logprobs.append(lp[keep].tolist())
    return tokens, logprobs


def generate(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
             stop_tokens: Sequence[int] | None = None, cache_dtype=None,
             decode_impl: str = "auto", mesh_config: MeshConfig | None = None,
             return_logprobs: bool = False, stats: GenerationStats | None = None,
             speculate: str | None = None, num_speculative_tokens: int = 4,
             ngram: tuple[int, int] = (1, 3), min_accepted: float | None = None,
             draft: tuple[ModelConfig, Params] | None = None):
    """New tokens for each prompt (a list of token-id lists), stop token excluded.

    `stop_tokens=None` stops on the model's EOS ids (`config.stop_ids`); `[]` generates exactly
    `max_new_tokens`; ids outside the vocabulary are ignored, with a warning.
    `cache_dtype` defaults to the model's compute dtype (an fp32 model decodes with an fp32
    cache); "int8" stores int8 values with a scale per cached vector. `decode_impl`: "auto"
    (`resolve_decode_impl`: unrolled on CPU and GPU when its weight copy fits, scan on TPU),
    "scan" or "unrolled": the same function either way. Parameters on a mesh decode under
    `mesh_config`'s sharding rules (default rules when None). With `return_logprobs`, returns
    `(tokens, logprobs)`. Speculative decoding (`speculate="ngram"`, or a `draft` model;
    `num_speculative_tokens`, `ngram`, `min_accepted`): see `stream`.
    """
    tokens = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    for new_tokens, new_logprobs in stream(
            config, params, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, seed=seed, stop_tokens=stop_tokens,
            cache_dtype=cache_dtype, decode_impl=decode_impl, mesh_config=mesh_config,
            chunk_steps=None, stats=stats, speculate=speculate,
            num_speculative_tokens=num_speculative_tokens, ngram=ngram,
            min_accepted=min_accepted, draft=draft):
        for row, (t, lp) in enumerate(zip(new_tokens, new_logprobs)):
            tokens[row] += t
            logprobs[row] += lp
    return (tokens, logprobs) if return_logprobs else tokens
