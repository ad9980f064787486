"""The device programs of continuous batching (`serve/engine.py` drives them from the host):
a fixed set of decode rows that requests enter and leave, over a paged KV cache.

The rows (rows.py) are one batch of B, kept on the device and donated to every program that
updates them. Their cache is a pool of pages (model/kv_cache.py's `init_paged_cache`; a
draft model's beside it, the same pages of its own pool): the host owns the pages
(serve/pages.py) and hands every program each row's table (`pages_BN`, or a prompt's
`pages_1N`), whose width sets the positions the program attends over. A row's sequence sits
at its positions from 0 and ends where the row has got to, so rows are never moved: a
prompt is written into its pages once, and a row that ends gives its pages back.
- `empty_rows`: B idle rows over an empty pool, laid out by the cache rules on a mesh;
- `prefill_chunk`: one chunk of a prompt written into its pages (`chunk_plan` cuts a prompt
  into chunks), and the logits after its last token;
- `insert`: a row holding a prefilled prompt, with its first token sampled from those
  logits;
- `copy_pages`: pages copied into others (a prompt's last page, for each further choice of
  it, which writes its own tokens there);
- `decode`: K decode steps of every row (`rows.step`, the step `generate` takes);
- `forward` and `pick`: a step in two programs (`rows.forward`, `rows.pick`), for a
  constrained server: the host computes the masks while the forward runs;
- `speculate`: K speculative rounds of every row instead (`rows.speculative_round`, the
  round `generate` takes), for a server that speculates: each row guesses from its own
  tokens (prompt lookup) or by a draft model (whose cache the rows hold beside the model's),
  one pass verifies, and each row advances by what it kept (1 to k + 1 tokens a round);
- `guesses`: a round's guesses alone, for constrained rows: the host writes each guessed
  position's mask before `speculate` runs that round.

A request's tokens do not depend on its companions (rows.py). `lower_programs` lowers the
largest of these programs without running anything, for `llama_jax.aot` to compile for
another target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.config import MeshConfig, ModelConfig
from llama_jax.decode.rows import (Emitted, Lookup, Proposal, Rows, advance, choose, propose,
                                   speculative_round, step)
from llama_jax.decode.rows import forward_drawing, pick as rows_pick
from llama_jax.decode.sampling import SamplingParams, Strategy
from llama_jax.decode.speculate import HIT_RATE_START, Speculation, put_rows, worth_verifying
from llama_jax.decode.step import NO_TOKEN
from llama_jax.model.kv_cache import (NO_PAGE, copied_pages, init_paged_cache, paged_rows,
                                      pages_for, with_pages)
from llama_jax.model.params import Params
from llama_jax.model.transformer import apply
from llama_jax.nn.heads import lm_head
from llama_jax.parallel import sharding
from llama_jax.parallel.sharding import placed
from llama_jax.shapes import bucket

TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit)
# The strategy of a prefill: it samples one token per request, so it always takes every path
# and compiles once per shape.
PREFILL_STRATEGY = Strategy(draw=True, truncate=True)
# The decode strategy that takes every path (a batch with a row using top-k or top-p), with
# top log-probabilities: the largest decode program.
WIDEST_STRATEGY = Strategy(draw=True, truncate=True)


@functools.partial(jax.jit, static_argnames=("config", "batch", "n_pages", "page_size",
                                             "max_len", "cache_dtype", "layout", "spec",
                                             "placement"))
def empty_rows(stop_S: jax.Array, *, config: ModelConfig, batch: int, n_pages: int,
               page_size: int, max_len: int, cache_dtype: str, layout: str,
               spec: Speculation | None = None, placement: tuple | None) -> Rows:
    """`batch` idle rows over an empty pool of `n_pages` pages of `page_size` positions, that
    stop on the ids `stop_S` (rows that speculate as `spec` says: their tokens too, `max_len`
    of each, and a draft model's pool of as many pages)."""
    with placed(placement):
        B = batch
        no_pages_B1 = jnp.full((B, 1), NO_PAGE, jnp.int32)
        cache = init_paged_cache(config, n_pages, page_size, no_pages_B1, cache_dtype, layout)
        lookup = draft_cache = None
        if spec is not None and spec.method == "draft":
            draft_cache = init_paged_cache(spec.draft_config, n_pages, page_size, no_pages_B1,
                                           cache_dtype, layout)
        if spec is not None:
            lookup = Lookup.fresh(jnp.zeros((B, max_len), jnp.int32))
        return Rows(
            cache=cache, last_B=jnp.zeros((B,), jnp.int32), step_B=jnp.zeros((B,), jnp.int32),
            max_new_B=jnp.ones((B,), jnp.int32), done_B=jnp.ones((B,), bool),
            sampling=SamplingParams.broadcast(B), key_B=jax.random.split(jax.random.key(0), B),
            stop_S=stop_S, lookup=lookup, draft_cache=draft_cache)


def _with_tables(rows: Rows, pages_BN: jax.Array) -> Rows:
    """The rows reading and writing their caches (and a draft's) through `pages_BN`."""
    draft = None if rows.draft_cache is None else with_pages(rows.draft_cache, pages_BN)
    return rows.replace(cache=with_pages(rows.cache, pages_BN), draft_cache=draft)


def _between_programs(rows: Rows) -> Rows:
    """The rows as they rest between programs: tables of no pages (each program gets the
    host's), so that every program takes and returns rows of one structure."""
    B = rows.last_B.shape[0]
    return _with_tables(rows, jnp.full((B, 1), NO_PAGE, jnp.int32))


def _scan_steps(config, params, rows: Rows, n_steps: int, strategy, top):
    def one(rows: Rows, _):
        rows, emitted = step(config, params, rows, strategy, top)
        return rows, jax.tree.map(lambda x: x[:, 0], emitted)

    rows, emitted_K = jax.lax.scan(one, rows, length=n_steps)
    return rows, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), emitted_K)


@functools.partial(jax.jit, static_argnames=("config", "draw", "placement"),
                   donate_argnames=("rows",))
def forward(rows: Rows, params: Params, pages_BN: jax.Array, *, config: ModelConfig,
            draw: bool, placement: tuple | None
            ) -> tuple[Rows, jax.Array, jax.Array | None]:
    """The first half of a decode step of every row over its pages (`rows.forward`): the
    rows with their last tokens in the cache, their next logits `[B, V]` and, where rows
    `draw`, the noise of that draw (`rows.step_noise`; else None), which `pick` takes. Apart,
    a constrained server runs it while the host computes the masks."""
    with placed(placement):
        rows = _with_tables(rows, pages_BN)
        cache, logits_BV, noise_BV = forward_drawing(config, params, rows.cache, rows.last_B,
                                                     rows.done_B, rows.key_B, rows.step_B, draw)
        return _between_programs(rows.replace(cache=cache)), logits_BV, noise_BV


@functools.partial(jax.jit, static_argnames=("strategy", "top", "placement"),
                   donate_argnames=("rows",))
def pick(rows: Rows, logits_BV: jax.Array, noise_BV: jax.Array | None, skip_B: jax.Array,
         mask_BW: jax.Array, *, strategy: Strategy, top: int, placement: tuple | None
         ) -> tuple[Rows, Emitted]:
    """The second half of a decode step (`rows.pick`): each row's token from `forward`'s
    logits and noise (None: drawn here), among those `mask_BW` allows. The rows `skip_B`
    (inserted since that forward: its logits are not of their tokens) take none this time."""
    with placed(placement):
        held = rows.replace(done_B=rows.done_B | skip_B, mask_BW=mask_BW)
        picked, emitted = rows_pick(held, logits_BV, strategy, top, noise_BV)
        return picked.replace(done_B=jnp.where(skip_B, rows.done_B, picked.done_B),
                              mask_BW=None), emitted


@functools.partial(jax.jit, static_argnames=("config", "n_steps", "strategy", "top",
                                             "placement"), donate_argnames=("rows",))
def decode(rows: Rows, params: Params, pages_BN: jax.Array, *, config: ModelConfig,
           n_steps: int, strategy: Strategy, top: int, placement: tuple | None
           ) -> tuple[Rows, Emitted]:
    """`n_steps` decode steps of every row (`rows.step`) over its pages `pages_BN`."""
    with placed(placement):
        rows, emitted = _scan_steps(config, params, _with_tables(rows, pages_BN), n_steps,
                                    strategy, top)
        return _between_programs(rows), emitted


def _scan_rounds(config, params, draft_params, rows: Rows, n_rounds: int, spec: Speculation,
                 verify: bool, strategy, top, proposal: Proposal | None = None,
                 mask_BTW: jax.Array | None = None):
    T = spec.k + 1
    B = rows.last_B.shape[0]
    # Which rows verify their guesses is decided for the whole program by their own rates as
    # the host saw them (`deciding_rate_B`), so that a row's tokens never depend on which
    # program its neighbours made the host choose: a row worth verifying makes it choose
    # `verify`.
    worth_B = worth_verifying(rows.lookup.deciding_rate_B, ~rows.done_B, spec)
    rate_before_B = rows.lookup.hit_rate_B

    def one(carry, _):
        rows, count_B, out = carry
        rows, emitted, n_B = speculative_round(config, params, draft_params, rows, spec,
                                               verify, worth_B, strategy, top, proposal,
                                               mask_BTW)
        out = jax.tree.map(lambda buffer, values: put_rows(buffer, count_B, values, n_B),
                           out, emitted)
        return (rows, count_B + n_B, out), None

    W = n_rounds * T  # each row's tokens from column 0, NO_TOKEN after them
    out = Emitted(jnp.full((B, W), NO_TOKEN, jnp.int32), jnp.zeros((B, W), jnp.float32),
                  jnp.zeros((B, W, top), jnp.int32), jnp.zeros((B, W, top), jnp.float32))
    (rows, _, out), _ = jax.lax.scan(one, (rows, jnp.zeros((B,), jnp.int32), out),
                                     length=n_rounds)
    lookup = rows.lookup
    return (rows.replace(lookup=lookup.replace(deciding_rate_B=rate_before_B)),
            out.replace(drafted_B=lookup.drafted_B, accepted_B=lookup.accepted_B,
                        hit_rate_B=lookup.hit_rate_B))


@functools.partial(jax.jit, static_argnames=("config", "n_steps", "spec", "verify", "strategy",
                                             "top", "placement"), donate_argnames=("rows",))
def speculate(rows: Rows, params: Params, draft_params: Params | None,
              pages_BN: jax.Array, proposal: Proposal | None = None,
              mask_BTW: jax.Array | None = None, *, config: ModelConfig, n_steps: int,
              spec: Speculation, verify: bool, strategy: Strategy, top: int,
              placement: tuple | None) -> tuple[Rows, Emitted]:
    """`n_steps` speculative rounds of every row (`rows.speculative_round`; rows with
    `lookup`) over its pages `pages_BN`: each row's tokens of the rounds, from column 0, and
    its guesses verified and kept so far. With `verify`, every round runs a verify pass, in
    which the rows worth it (`speculate.worth_verifying` of their deciding rates) verify
    their guesses; without, every round is a plain step (the host chooses, by
    `speculate.worth_a_pass` of the rates the program before the last returned). The
    guesses are prompt lookup's, or a draft model's (`draft_params`, its cache in the rows;
    without `verify`, one step of it a round keeps its cache in step). Constrained rows: one
    round (`n_steps` 1) over `proposal`'s guesses (`guesses`'s), each position's token among
    those `mask_BTW` allows (decode/grammar.py `Constrained.guessed_masks`)."""
    with placed(placement):
        rows, emitted = _scan_rounds(config, params, draft_params,
                                     _with_tables(rows, pages_BN), n_steps, spec, verify,
                                     strategy, top, proposal, mask_BTW)
        return _between_programs(rows), emitted


@functools.partial(jax.jit, static_argnames=("spec", "verify", "strategy", "placement"))
def guesses(rows: Rows, draft_params: Params | None, pages_BN: jax.Array, *,
            spec: Speculation, verify: bool, strategy: Strategy, placement: tuple | None
            ) -> Proposal:
    """The next round's guesses of every row over its pages (`rows.propose`), for the host
    to write the masks of constrained rows' positions before `speculate` runs the round."""
    with placed(placement):
        return propose(draft_params, _with_tables(rows, pages_BN), spec, verify, strategy)


def chunk_plan(n: int, start: int, chunk: int, max_len: int) -> list[tuple[int, int]]:
    """The chunks `(start, L)` that prefill a prompt of n tokens from token `start` (after
    the chunks a prefix cache restored): full chunks of `chunk` tokens, the last padded to a
    power of two (at least MIN_BUCKET), no chunk past `max_len` positions. A prompt always runs
    the same chunks from the same start."""
    chunks = []
    while start < n:
        L = min(bucket(n - start), chunk, max_len - start)
        chunks.append((start, L))
        start += L
    return chunks


def chunk_capacity(start: int, L: int) -> int:
    """The positions of a prompt's cache after its chunk `(start, L)`: the next power of two of the
    chunk's end (at least MIN_BUCKET), so that the chunks compile a program per capacity."""
    return bucket(start + L)


def chunk_shapes(chunk: int, max_len: int) -> list[tuple[int, int]]:
    """Every `(start, L)` the prompts of a server of `max_len` tokens prefill (a prompt leaves
    at least one token for the output)."""
    return sorted(set().union(*(chunk_plan(n, 0, chunk, max_len) for n in range(1, max_len))))


def chunk_pages(start: int, L: int, page_size: int) -> int:
    """The table width (pages) of a prompt's chunk `(start, L)`: those of its capacity."""
    return pages_for(chunk_capacity(start, L), page_size)


@functools.partial(jax.jit, static_argnames=("config", "draft", "placement"),
                   donate_argnames=("rows",))
def prefill_chunk(rows: Rows, params: Params, pages_1N: jax.Array, tokens_1L: jax.Array,
                  start: jax.Array, last: jax.Array, next_1L: jax.Array | None = None, *,
                  config: ModelConfig, draft: bool = False, placement: tuple | None
                  ) -> tuple[Rows, jax.Array, Emitted | None]:
    """One chunk of a prompt written into its pages `pages_1N` (the prompt's, from position
    0; the chunk attends over their positions: `chunk_pages` of them): the L tokens
    `tokens_1L` at positions `start ..`, those after index `last` padding (written into the
    prompt's last page or dropped past its pages; unseen). Returns the rows with their pool
    written (with `draft`, the draft model's: `config` and `params` are then the draft's),
    the logits `[1, V]` after token `last` and, given `next_1L` (each token's successor in
    the prompt), their log-probabilities and top alternatives.

    Where the chunk starts is an input, not part of the program, so that prompts compile one
    program per table width and length; a chunk's values depend only on the prompt up to its
    end, so a prompt runs the same programs on the same inputs whatever was cached."""
    with placed(placement):
        pool = rows.draft_cache if draft else rows.cache
        one = paged_rows(pool, pages_1N, start[None])
        h_1LD, one, _ = apply(config, params, tokens_1L, cache=one)
        pool = pool.replace(groups=one.groups)
        rows = rows.replace(draft_cache=pool) if draft else rows.replace(cache=pool)
        h_1D = jax.lax.dynamic_index_in_dim(h_1LD, last, axis=1, keepdims=False)
        logits_1V = lm_head(config, params, h_1D[:, None])[:, 0]
        if next_1L is None:
            return rows, logits_1V, None
        logprobs_1LV = jax.nn.log_softmax(lm_head(config, params, h_1LD).astype(jnp.float32))
        top_logprobs_1Ln, top_ids_1Ln = jax.lax.top_k(logprobs_1LV, TOP_LOGPROBS)
        return rows, logits_1V, Emitted(next_1L, jnp.take_along_axis(
            logprobs_1LV, next_1L[..., None], -1)[..., 0], top_ids_1Ln, top_logprobs_1Ln)


@functools.partial(jax.jit, donate_argnames=("rows",))
def insert(rows: Rows, logits_1V: jax.Array, row: jax.Array, end: jax.Array,
           max_new: jax.Array, sampling: SamplingParams, key_1: jax.Array,
           prompt_1S: jax.Array | None = None, mask_1W: jax.Array | None = None
           ) -> tuple[Rows, Emitted]:
    """Row `row` holding a prefilled prompt of `end` tokens (in the pages the host lists for
    it; with `lookup`, its tokens `prompt_1S` beside them): its settings, and its first
    token, sampled from the prompt's last `logits_1V` with the request's key (its step 0;
    among the tokens `mask_1W` allows, a constrained request), which it also returns."""
    token_1, logprob_1, top_ids, top_logprobs = choose(
        logits_1V, key_1, jnp.zeros((1,), jnp.int32), sampling, PREFILL_STRATEGY, TOP_LOGPROBS,
        mask_1W)
    first = Emitted(token_1[:, None], logprob_1[:, None], top_ids[:, None],
                    top_logprobs[:, None])
    put = lambda values_B, value_1: values_B.at[row].set(value_1[0])  # noqa: E731
    if rows.lookup is not None:
        zero = jnp.zeros((), jnp.int32)
        rows = rows.replace(lookup=rows.lookup.replace(
            tokens_BS=put(rows.lookup.tokens_BS, prompt_1S.at[0, end].set(token_1[0])),
            hit_rate_B=rows.lookup.hit_rate_B.at[row].set(HIT_RATE_START),
            deciding_rate_B=rows.lookup.deciding_rate_B.at[row].set(HIT_RATE_START),
            drafted_B=rows.lookup.drafted_B.at[row].set(zero),
            accepted_B=rows.lookup.accepted_B.at[row].set(zero)))
    if rows.draft_cache is not None:
        rows = rows.replace(draft_cache=rows.draft_cache.replace(
            end=rows.draft_cache.end.at[row].set(end)))
    rows = rows.replace(
        cache=rows.cache.replace(end=rows.cache.end.at[row].set(end)),
        step_B=rows.step_B.at[row].set(0), max_new_B=rows.max_new_B.at[row].set(max_new),
        done_B=rows.done_B.at[row].set(False), key_B=put(rows.key_B, key_1),
        sampling=jax.tree.map(put, rows.sampling, sampling))
    token_B = jnp.full_like(rows.last_B, token_1[0])
    return advance(rows, token_B, jnp.arange(token_B.shape[0]) == row), first


@functools.partial(jax.jit, donate_argnames=("rows",))
def copy_pages(rows: Rows, from_N: jax.Array, to_N: jax.Array) -> Rows:
    """The rows with pages `to_N` of their pool (and a draft's) holding what pages `from_N`
    hold."""
    draft = None if rows.draft_cache is None else copied_pages(rows.draft_cache, from_N, to_N)
    return rows.replace(cache=copied_pages(rows.cache, from_N, to_N), draft_cache=draft)


def lower_programs(config: ModelConfig, params: Params, *, max_batch: int, n_pages: int,
                   page_size: int, prompt_len: int, chunk: int, max_len: int, steps: int,
                   cache_dtype: str, layout: str, mesh_config: MeshConfig | None = None,
                   spec: Speculation | None = None, draft_params: Params | None = None,
                   ) -> tuple[dict[str, jax.stages.Lowered], Rows]:
    """The largest programs a server of `max_batch` rows over `n_pages` pages of `page_size`
    positions runs, lowered without running anything: the last prefill chunk of a
    `prompt_len`-token prompt (in chunks of `chunk`), its insertion, and `steps` decode steps
    with every sampling path and top log-probabilities, every row attending over `max_len`
    positions. A server that speculates as `spec` says runs `steps` rounds that verify
    instead of the decode steps, and with a draft model (`draft_params`) the draft's last
    prefill chunk too.
    `params` may be abstract (`jax.ShapeDtypeStruct`s placed on the devices of any platform;
    on a mesh, laid out by `mesh_config`'s rules). Returns them by name, and the rows they
    run over (abstract, laid out as `empty_rows` lays them out there)."""
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

    def empty(pages: int) -> jax.stages.Lowered:
        return empty_rows.lower(stop_S, config=config, batch=max_batch, n_pages=pages,
                                page_size=page_size, max_len=max_len, cache_dtype=cache_dtype,
                                layout=layout, spec=spec, placement=placement)

    # The cache rules lay the pool out alike at any size that splits evenly: a pool of a page
    # per device is compiled to learn the layout (the full one might not fit, and that is for
    # the decode to say).
    layout_of = jax.tree.leaves(empty(1 if mesh is None else mesh.size).compile()
                                .output_shardings)
    full = empty(n_pages).out_info
    rows = placed_like(full, jax.tree.unflatten(jax.tree.structure(full), layout_of))
    start, L = chunk_plan(prompt_len, 0, chunk, prompt_len)[-1]
    chunk_args = placed_like((np.zeros((1, chunk_pages(start, L, page_size)), np.int32),
                              np.zeros((1, L), np.int32), np.int32(start), np.int32(L - 1)))
    lowered = {"prefill": prefill_chunk.lower(rows, params, *chunk_args, config=config,
                                              placement=placement)}
    if draft_params is not None:
        lowered["draft prefill"] = prefill_chunk.lower(
            rows, draft_params, *chunk_args, config=spec.draft_config, draft=True,
            placement=placement)
    logits = placed_like(lowered["prefill"].out_info[1])
    sampling = placed_like(SamplingParams.broadcast(1))
    key_1 = jax.ShapeDtypeStruct((1,), jax.random.key(0).dtype, sharding=beside)
    prompt_1S = None if spec is None else placed_like(np.zeros((1, max_len), np.int32))
    lowered["insert"] = insert.lower(rows, logits, *placed_like((np.int32(0), np.int32(1),
                                                                 np.int32(1))),
                                     sampling, key_1, prompt_1S)
    pages_BN = placed_like(np.zeros((max_batch, pages_for(max_len, page_size)), np.int32))
    if spec is None:
        lowered["decode"] = decode.lower(rows, params, pages_BN, config=config, n_steps=steps,
                                         strategy=WIDEST_STRATEGY, top=TOP_LOGPROBS,
                                         placement=placement)
    else:
        lowered["speculate"] = speculate.lower(rows, params, draft_params, pages_BN,
                                               config=config, n_steps=steps, spec=spec,
                                               verify=True, strategy=WIDEST_STRATEGY,
                                               top=TOP_LOGPROBS, placement=placement)
    return lowered, rows
