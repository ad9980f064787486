"""Jit-compiled generation: prefill, then a `lax.while_loop` of decode steps over a donated state.

    new_tokens = llama_jax.generate(config, params, [[1, 415, 2936], [1, 22]], 64,
                                    temperature=0.7, top_p=0.9, seed=0)

Shapes are padded to buckets (batch to a power of two; prompt length and new tokens to powers
of two, at least 16) so that new prompts rarely recompile; each bucket compiles two executables,
`prefill` and `decode`, once. The loop's state is the decode rows (rows.py), the server's too:
each prompt sits in the KV cache from position 0 and each row ends where it has got to, so a
row never sees another's padding and generates exactly what it would generate alone. The
decode loop takes `rows.step` (or `rows.speculative_round`) and exits early once every row has
stopped; it runs in chunks of steps (`stream`) so a caller can print text as it comes at the
cost of one host round trip per chunk.

Sampling: see sampling.py. Row b's key is `rows.row_key(seed, b)` and its key for step s is
`fold_in` of that by s, so results do not depend on the chunking, nor a row's tokens on the
others. Log-probabilities are those of the model's distribution (before temperature and
filters) for the chosen tokens. Which decoder runs (scan or unrolled) and whether its copy and
cache fit: decoder.py.
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
from flax import struct

from llama_jax.parallel import sharding, target
from llama_jax.config import MeshConfig, ModelConfig, cache_dtype_name
from llama_jax.errors import ConfigError, GenerateError
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply
from llama_jax.nn.attention.dot_product import chosen_attention
from llama_jax.nn.heads import is_task_head, lm_head
from llama_jax.model.params import Params
from llama_jax.data.tokenizer import Tokenizer
from llama_jax.decode.decoder import (cache_bytes_per_device, decoder_params, is_unstacked,
                                      resolve_decode_impl)
from llama_jax.decode.grammar import Constrained, row_grammars
from llama_jax.decode.sampling import SamplingParams, Strategy, check_settings
from llama_jax.decode.rows import (Emitted, Lookup, Proposal, Rows, advance, choose,
                                   forward_drawing, pick, propose, row_key, speculative_round,
                                   step)
from llama_jax.decode.speculate import (Speculation, put_rows, speculation, worth_a_pass,
                                        worth_verifying)
from llama_jax.decode.step import NO_TOKEN, check_prompt, stop_table
from llama_jax.parallel.sharding import placed
from llama_jax.shapes import bucket

# Speculative rounds per decode program when the caller does not stream: between programs the
# host chooses whether the next program's rounds verify (`speculate.worth_a_pass`).
SPECULATIVE_CHUNK = 16


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


@struct.dataclass
class Output:
    """Each row's generated tokens `[B, N]` from column 0 (NO_TOKEN after them) and their
    log-probabilities."""

    tokens_BN: jax.Array
    logprobs_BN: jax.Array

    def written(self, at_B: jax.Array, emitted: Emitted, n_B: jax.Array) -> "Output":
        """The first `n_B` of each row's emitted tokens written from its column `at_B`."""
        return Output(put_rows(self.tokens_BN, at_B, emitted.tokens_BK, n_B),
                      put_rows(self.logprobs_BN, at_B, emitted.logprobs_BK, n_B))


@struct.dataclass
class Decoding:
    """What the decode loop carries: the rows, and what they have generated."""

    rows: Rows
    out: Output


@functools.partial(jax.jit, static_argnames=("config", "cache_len", "n_out", "cache_dtype",
                                             "strategy", "spec", "placement"))
def _prefill(config: ModelConfig, params: Params, prompts_BT: jax.Array, length_B: jax.Array,
             active_B: jax.Array, stop_S: jax.Array, sampling: SamplingParams,
             max_new: jax.Array, key_B: jax.Array, draft_params: Params | None = None,
             mask_BW: jax.Array | None = None, *, cache_len: int, n_out: int,
             cache_dtype: str, strategy: Strategy, spec: Speculation | None = None,
             placement: tuple | None) -> Decoding:
    """The rows after their prompts (`prompts_BT`, each row's first `length_B` tokens; the
    rest padding, written past the row's end and never seen) and each row's first token
    (among those `mask_BW` allows: constrained rows); speculating, their token ids and the
    draft model's cache of the prompts."""
    with placed(placement):
        B = prompts_BT.shape[0]
        cache, h_BTD = _prompted(config, params, prompts_BT, length_B, cache_len, cache_dtype)
        h_B1D = jnp.take_along_axis(h_BTD, (length_B - 1)[:, None, None], axis=1)
        logits_BV = lm_head(config, params, h_B1D)[:, 0]
        zeros_B = jnp.zeros((B,), jnp.int32)
        token_B, logprob_B, _, _ = choose(logits_BV, key_B, zeros_B, sampling, strategy, 0,
                                          mask_BW)
        lookup = draft_cache = None
        if spec is not None:
            tokens_BS = jnp.pad(prompts_BT, ((0, 0), (0, cache_len - prompts_BT.shape[1])))
            lookup = Lookup.fresh(tokens_BS.at[jnp.arange(B), length_B].set(token_B))
        if spec is not None and spec.method == "draft":
            draft_cache = _prompted(spec.draft_config, draft_params, prompts_BT, length_B,
                                    cache_len, cache_dtype)[0]
        rows = Rows(cache=cache, last_B=zeros_B, step_B=zeros_B,
                    max_new_B=jnp.broadcast_to(max_new, (B,)), done_B=~active_B,
                    sampling=sampling, key_B=key_B, stop_S=stop_S, lookup=lookup,
                    draft_cache=draft_cache, mask_BW=mask_BW)
        out = Output(jnp.full((B, n_out), NO_TOKEN, jnp.int32), jnp.zeros((B, n_out), jnp.float32))
        first = Emitted(token_B[:, None], logprob_B[:, None], None, None)
        return Decoding(advance(rows, token_B, active_B),
                        out.written(zeros_B, first, active_B.astype(jnp.int32)))


def _prompted(config, params, prompts_BT, length_B, cache_len, cache_dtype):
    """The cache of the prompts from position 0, each row ending after its own, and the
    hidden states."""
    cache = init_cache(config, prompts_BT.shape[0], cache_len, cache_dtype,
                       layout=_layout(params)).with_row_ends()
    h_BTD, cache, _ = apply(config, params, prompts_BT, cache=cache)
    return cache.replace(end=length_B.astype(jnp.int32)), h_BTD


def _layout(params: Params) -> str:
    """The cache layout of the decoder that runs `params`."""
    return "per_layer" if is_unstacked(params) else "stacked"


@functools.partial(jax.jit, static_argnames=("config", "strategy", "spec", "verify",
                                             "placement"), donate_argnames=("state",))
def _decode(config: ModelConfig, params: Params, state: Decoding, n_steps: jax.Array,
            draft_params: Params | None = None, *, strategy: Strategy,
            spec: Speculation | None = None, verify: bool = False,
            placement: tuple | None) -> Decoding:
    """Up to `n_steps` decode steps (`rows.step`), or speculative rounds with `spec`
    (`rows.speculative_round`: with `verify`, the rows worth it by their rates now verify);
    stops early when every row is done."""
    with placed(placement):
        worth_B = None if spec is None else worth_verifying(
            state.rows.lookup.hit_rate_B, ~state.rows.done_B, spec)

        def keep_going(carry):
            i, st = carry
            return (i < n_steps) & ~jnp.all(st.rows.done_B)

        def one(carry):
            i, st = carry
            if spec is None:
                return i + 1, _stepped(st, *step(config, params, st.rows, strategy, 0))
            return i + 1, _round(config, params, draft_params, st, spec, verify, worth_B,
                                 strategy)

        _, state = jax.lax.while_loop(keep_going, one, (jnp.zeros((), jnp.int32), state))
        return state


def _stepped(state: Decoding, rows: Rows, emitted: Emitted) -> Decoding:
    """The decoding after a step to `rows` that emitted `emitted` (a token of each row that
    was not done)."""
    n_B = (~state.rows.done_B).astype(jnp.int32)
    return Decoding(rows, state.out.written(state.rows.step_B, emitted, n_B))


@functools.partial(jax.jit, static_argnames=("config", "draw", "placement"),
                   donate_argnames=("cache",))
def _forward(config: ModelConfig, params: Params, cache, last_B: jax.Array, done_B: jax.Array,
             key_B: jax.Array, step_B: jax.Array, *, draw: bool, placement: tuple | None):
    """`rows.forward`: the cache after the rows' last tokens, their next logits, and where
    rows draw, the noise of that draw (`rows.step_noise`; else None)."""
    with placed(placement):
        return forward_drawing(config, params, cache, last_B, done_B, key_B, step_B, draw)


@functools.partial(jax.jit, static_argnames=("strategy", "placement"),
                   donate_argnames=("state",))
def _pick(state: Decoding, logits_BV: jax.Array, noise_BV: jax.Array | None, *,
          strategy: Strategy, placement: tuple | None) -> Decoding:
    """`rows.pick`: the rows' tokens from `_forward`'s logits and noise, among what their
    masks allow."""
    with placed(placement):
        return _stepped(state, *pick(state.rows, logits_BV, strategy, 0, noise_BV))


def _round(config, params, draft_params, state: Decoding, spec, verify, worth_B, strategy,
           proposal: Proposal | None = None, mask_BTW: jax.Array | None = None) -> Decoding:
    """The decoding after one speculative round (`rows.speculative_round`)."""
    rows, emitted, n_B = speculative_round(config, params, draft_params, state.rows, spec,
                                           verify, worth_B, strategy, 0, proposal, mask_BTW)
    return Decoding(rows, state.out.written(state.rows.step_B, emitted, n_B))


@functools.partial(jax.jit, static_argnames=("spec", "verify", "strategy", "placement"))
def _propose(state: Decoding, draft_params: Params | None, *, spec: Speculation, verify: bool,
             strategy: Strategy, placement: tuple | None) -> Proposal:
    """The next round's guesses (`rows.propose`), for the host to mask: constrained rows."""
    with placed(placement):
        return propose(draft_params, state.rows, spec, verify, strategy)


@functools.partial(jax.jit, static_argnames=("config", "strategy", "spec", "verify",
                                             "placement"), donate_argnames=("state",))
def _masked_round(config: ModelConfig, params: Params, state: Decoding, proposal: Proposal,
                  mask_BTW: jax.Array, draft_params: Params | None = None, *,
                  strategy: Strategy, spec: Speculation, verify: bool,
                  placement: tuple | None) -> Decoding:
    """One speculative round over `proposal`'s guesses, each position's token among those
    `mask_BTW` allows (`Constrained.guessed_masks`)."""
    with placed(placement):
        worth_B = worth_verifying(state.rows.lookup.hit_rate_B, ~state.rows.done_B, spec)
        return _round(config, params, draft_params, state, spec, verify, worth_B, strategy,
                      proposal, mask_BTW)


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
    # Each array by its own dtype (not `jnp.result_type`'s canonical one, which costs ~10 µs a
    # leaf: a model's hundred leaves made this lookup a third of a streamed step's host time).
    # Two dtypes that canonicalize alike only compile twice.
    signature = tuple((np.shape(x), x.dtype, getattr(x, "sharding", None))
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
           draft: tuple[ModelConfig, Params] | None = None, grammar=None, json_schema=None,
           regex=None, tokenizer: Tokenizer | None = None,
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
    `speculate.verify_cost`; 0: always verify); a draft's, always unless `min_accepted` is
    given. The host chooses between rounds that verify and plain ones per program of
    `chunk_steps` rounds (`SPECULATIVE_CHUNK` when None), by the rows' rates then.
    Constrained decoding (grammar.py `row_grammars`, with `tokenizer`): `json_schema`,
    `regex` or `grammar`; such a batch yields after every token or speculative round (the
    host writes the masks; speculating, of each position of the round's guesses)."""
    _validate(config, prompts, max_new_tokens, temperature, top_k, top_p, min_p)
    try:
        cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)
    except ConfigError as e:
        raise GenerateError(str(e)) from None
    stats = stats if stats is not None else GenerationStats()
    longest = max(len(p) for p in prompts)
    max_new = _fitting(config, longest, max_new_tokens, stats)
    stops = stop_table(config, stop_tokens)

    B, T, N = bucket(len(prompts), 1), bucket(longest), bucket(max_new)
    constrained, stops = _constrained(config, row_grammars(len(prompts), grammar, json_schema,
                                                           regex), tokenizer, stops, B)
    if draft is not None and min_accepted is None:
        min_accepted = 0.0  # a draft model's guesses are verified every round
    spec = speculation(config, speculate, num_speculative_tokens, ngram, draft, B,
                       min_accepted, target.platform_of_tree(params))
    prompts_BT, length_B, active_B = _batch(prompts, B, T)
    sampling = SamplingParams.broadcast(B, temperature, top_k, top_p, min_p)
    strategy = Strategy.of(temperature, top_k, top_p)
    # A verify pass writes k + 1 positions past a row's end, the last of them for a row about
    # to finish.
    cache_len = T + N + (0 if spec is None else spec.k + 1)
    impl = resolve_decode_impl(decode_impl, params, cache_bytes_per_device(
        config, params, B, cache_len, cache_dtype, mesh_config))
    params = decoder_params(params, impl)
    draft_params = None if draft is None else decoder_params(draft[1], impl)
    key_B = jax.vmap(functools.partial(row_key, seed))(jnp.arange(B))
    args = (config, params, prompts_BT, length_B, active_B, np.asarray(stops, np.int32),
            sampling, np.int32(max_new), key_B, draft_params,
            None if constrained is None else constrained.mask())
    prefill = _compiled(_prefill, stats, mesh_config, *args, cache_len=cache_len, n_out=N,
                        cache_dtype=cache_dtype, strategy=strategy, spec=spec)
    decoder = _Decoder(config, params, draft_params, spec, strategy, stats, mesh_config)
    start = time.perf_counter()
    state = decoder.started(prefill(*args[1:]), constrained)
    rows = len(prompts)  # rows past len(prompts) are batch padding
    emitted_B = np.zeros(rows, np.int64)
    while True:
        count_B = np.asarray(state.rows.step_B)[:rows]  # waits for the device
        tokens_BN, logprobs_BN = np.asarray(state.out.tokens_BN), np.asarray(state.out.logprobs_BN)
        new = _new_tokens(tokens_BN[:rows], logprobs_BN[:rows], emitted_B, count_B, stops)
        stats.new_tokens += sum(len(t) for t in new[0])
        if spec is not None:
            lookup = state.rows.lookup
            stats.drafted_tokens = int(np.sum(lookup.drafted_B))
            stats.accepted_tokens = int(np.sum(lookup.accepted_B))
        elapsed = time.perf_counter() - start
        if not emitted_B.any():
            stats.time_to_first_token_s = elapsed
        else:
            stats.decode_s += elapsed
        emitted_B = count_B
        yield new
        done_B = np.asarray(state.rows.done_B)
        if bool(np.all(done_B)):
            return
        if constrained is not None:  # after the tokens just taken
            constrained.follow(new[0])
        start = time.perf_counter()
        state = decoder.after(state, done_B, constrained,
                              chunk_steps or (N if spec is None else SPECULATIVE_CHUNK))


class _Decoder:
    """A stream's decode programs, each compiled (or found compiled) once: a stream's shapes
    do not change, so its per-token programs skip the executable lookup (`_compiled`: a
    signature of every argument, most of a millisecond a step).

    A constrained batch (without speculation) runs a step as two programs, `rows.forward` and
    `rows.pick`, and the forward of the next step is dispatched as soon as its pick is: the
    device runs the model while the host reads the tokens and computes the next masks."""

    def __init__(self, config: ModelConfig, params: Params, draft_params: Params | None,
                 spec: Speculation | None, strategy: Strategy, stats: GenerationStats,
                 mesh_config: MeshConfig | None):
        self.config, self.params, self.draft_params = config, params, draft_params
        self.spec, self.strategy, self.stats, self.mesh_config = spec, strategy, stats, \
            mesh_config
        self._programs: dict = {}
        # the dispatched forward's logits and noise
        self._forwarded: tuple[jax.Array, jax.Array | None] | None = None

    def _run(self, fn, *args, configured: bool = True, **static):
        """`fn` over `args` (after the model config, a static argument, when `configured`)."""
        key = (fn, tuple(sorted(static.items())))
        if key not in self._programs:
            config = (self.config,) * configured
            self._programs[key] = _compiled(fn, self.stats, self.mesh_config, *config, *args,
                                            **static)
        return self._programs[key](*args)

    def started(self, state: Decoding, constrained: Constrained | None) -> Decoding:
        """The decoding after prefill; a constrained batch's first forward dispatched."""
        return state if constrained is None or self.spec is not None else self._forward(state)

    def _forward(self, state: Decoding) -> Decoding:
        rows = state.rows
        cache, logits_BV, noise_BV = self._run(_forward, self.params, rows.cache, rows.last_B,
                                               rows.done_B, rows.key_B, rows.step_B,
                                               draw=self.strategy.draw)
        self._forwarded = logits_BV, noise_BV
        return state.replace(rows=rows.replace(cache=cache))

    def after(self, state: Decoding, done_B: np.ndarray, constrained: Constrained | None,
              steps: int) -> Decoding:
        """The decoding after the next program: `steps` steps (or speculative rounds), one for
        a constrained batch after the host wrote its masks (the pick after the forward that
        ran meanwhile; speculating: the guesses first, then the round over them and the masks
        they lead to). A round verifies when its rows' rates say so (the host's choice, as a
        server's)."""
        spec, params, draft_params = self.spec, self.params, self.draft_params
        if constrained is not None and spec is None:
            state = state.replace(rows=state.rows.replace(mask_BW=constrained.mask()))
            state = self._run(_pick, state, *self._forwarded, configured=False,
                              strategy=self.strategy)
            return self._forward(state)
        verify = spec is not None and worth_a_pass(np.asarray(state.rows.lookup.hit_rate_B),
                                                   ~done_B, spec)
        static = dict(strategy=self.strategy, spec=spec, verify=verify)
        if constrained is not None:
            proposal = self._run(_propose, state, draft_params, configured=False, **static)
            mask_BTW = constrained.guessed_masks(np.asarray(proposal.guess_BK),
                                                 np.asarray(proposal.n_guess_B))
            return self._run(_masked_round, params, state, proposal, mask_BTW, draft_params,
                             **static)
        return self._run(_decode, params, state, np.int32(steps), draft_params, **static)


def _constrained(config: ModelConfig, grammars: list, tokenizer: Tokenizer | None,
                 stops: list[int], B: int) -> tuple[Constrained | None, list[int]]:
    """The batch's grammars (None without any) and its stop ids: a model without stop ids
    stops constrained rows at the tokenizer's end of sequence, where a grammar ends."""
    if any(g is not None for g in grammars) and stops == [NO_TOKEN] and tokenizer is not None:
        stops = stop_table(config, tokenizer.eos_ids)
    return Constrained.of(grammars, tokenizer, config.vocab_size, stops, B), stops


def _fitting(config: ModelConfig, longest: int, max_new_tokens: int,
             stats: GenerationStats) -> int:
    """The new tokens the context leaves room for after the longest prompt (a warning, and
    `stats.truncated`, when fewer than asked)."""
    max_new = min(max_new_tokens, config.max_seq_len - longest)
    if max_new < max_new_tokens:
        stats.truncated = True
        warnings.warn(f"the context is full: generating at most {max_new} of {max_new_tokens} "
                      f"new tokens (longest prompt {longest}, max_seq_len {config.max_seq_len})",
                      stacklevel=3)
    return max_new


def _batch(prompts: Sequence[Sequence[int]], B: int, T: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompts as a batch of B rows: each from column 0 (`[B, T]`), their lengths and
    which rows are prompts (padding rows: one token, inactive)."""
    prompts_BT = np.zeros((B, T), np.int32)
    length_B = np.ones((B,), np.int32)
    for b, prompt in enumerate(prompts):
        prompts_BT[b, :len(prompt)] = prompt
        length_B[b] = len(prompt)
    return prompts_BT, length_B, np.arange(B) < len(prompts)


def lower_programs(config: ModelConfig, params: Params, *, batch: int, prompt_len: int,
                   new_tokens: int, cache_dtype: str,
                   ) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """The greedy prefill program `stream` would run for `batch` prompts of `prompt_len` tokens
    and `new_tokens` more, and one step of its decode loop (`rows.step`, whose cost is the
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
        np.zeros((B, T), np.int32), np.ones((B,), np.int32), np.ones((B,), bool),
        np.zeros((1,), np.int32), SamplingParams.broadcast(B), np.int32(N)))
    key_B = jax.ShapeDtypeStruct((B,), jax.random.key(0).dtype, sharding=here)
    strategy = Strategy.of(0.0, 0, 1.0)
    prefill = _prefill.lower(config, params, *inputs, key_B, cache_len=T + N, n_out=N,
                             cache_dtype=cache_dtype, strategy=strategy, placement=None)
    rows = placed_like(prefill.out_info.rows)  # the decode loop's rows, as prefill leaves them
    one_step = jax.jit(lambda params, rows: step(config, params, rows, strategy, 0),
                       donate_argnums=1)
    return prefill, one_step.lower(params, rows)


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
             draft: tuple[ModelConfig, Params] | None = None, grammar=None, json_schema=None,
             regex=None, tokenizer: Tokenizer | None = None):
    """New tokens for each prompt (a list of token-id lists), stop token excluded.

    `stop_tokens=None` stops on the model's EOS ids (`config.stop_ids`); `[]` generates exactly
    `max_new_tokens`; ids outside the vocabulary are ignored, with a warning.
    `cache_dtype` defaults to the model's compute dtype (an fp32 model decodes with an fp32
    cache); "int8" stores int8 values with a scale per cached vector. `decode_impl`: "auto"
    (`resolve_decode_impl`: unrolled on CPU and GPU when its weight copy fits, scan on TPU),
    "scan" or "unrolled": the same function either way. Parameters on a mesh decode under
    `mesh_config`'s sharding rules (default rules when None). With `return_logprobs`, returns
    `(tokens, logprobs)`. Speculative decoding (`speculate="ngram"`, or a `draft` model;
    `num_speculative_tokens`, `ngram`, `min_accepted`): see `stream`. Constrained decoding
    (`json_schema`, `regex` or `grammar`, with the `tokenizer`): see `stream`.
    """
    tokens = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    for new_tokens, new_logprobs in stream(
            config, params, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, seed=seed, stop_tokens=stop_tokens,
            cache_dtype=cache_dtype, decode_impl=decode_impl, mesh_config=mesh_config,
            chunk_steps=None, stats=stats, speculate=speculate,
            num_speculative_tokens=num_speculative_tokens, ngram=ngram,
            min_accepted=min_accepted, draft=draft, grammar=grammar, json_schema=json_schema,
            regex=regex, tokenizer=tokenizer):
        for row, (t, lp) in enumerate(zip(new_tokens, new_logprobs)):
            tokens[row] += t
            logprobs[row] += lp
    return (tokens, logprobs) if return_logprobs else tokens
