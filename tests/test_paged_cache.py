"""The paged KV cache: rows whose slots live in pages of a pool, through a table per row,
compute what the dense cache of as many slots computes, bit for bit, for every cache kind;
writes go only to a row's own pages; and Pallas's paged attention kernel (run by its
interpreter) computes what the gather reference does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.model.kv_cache import init_cache, init_paged_cache, with_pages
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.attention import kv_storage
from llama_jax.quant import is_int8
from models import MLA_TINY, TINY, prompts, random_params

B, PAGE, N, POOL = 3, 4, 4, 13  # rows, a page's slots, pages per row, pages in the pool
S = N * PAGE
# Each row's ends after its prompt of 7 tokens is cut (rows at lengths of their own), then
# three steps and a verify pass of three tokens: row 1 writes up to slot 12, in its 4th page;
# rows 0 and 2 never reach theirs, which their tables leave out (-1).
ENDS = [3, 7, 5]
KINDS = {"gqa float32 stacked": (TINY, "float32", "stacked"),
         "gqa bfloat16 per_layer": (TINY, "bfloat16", "per_layer"),
         "gqa int8 per_layer": (TINY, "int8", "per_layer"),
         "gqa int8 stacked": (TINY, "int8", "stacked"),
         "mla float32 stacked": (MLA_TINY, "float32", "stacked"),
         "mla bfloat16 per_layer": (MLA_TINY, "bfloat16", "per_layer")}

@pytest.fixture(scope="module")
def params():
    return random_params({"gqa": TINY, "mla": MLA_TINY})

def _tables() -> np.ndarray:
    """Each row's pages, drawn at random from the pool (page order is not slot order)."""
    drawn = np.random.default_rng(0).permutation(POOL)[:B * N].reshape(B, N)
    drawn[[0, 2], 3] = -1
    return drawn.astype(np.int32)

def _run(config_and_layout, p, cache, tokens_BT):
    """A prompt, the rows cut to `ENDS`, three decode steps and a verify pass: each pass's
    hidden states, and the cache."""
    config, _ = config_and_layout
    hidden = []
    for T in (7, 1, 1, 1, 3):
        out = apply(config, p, tokens_BT[:, :T], cache=cache)
        hidden.append(out.hidden_BTD)
        cache = out.cache
        if T == 7:
            cache = cache.replace(end=jnp.asarray(ENDS, jnp.int32))
        tokens_BT = jnp.roll(tokens_BT, 1, axis=1)
    return hidden, cache

_run = jax.jit(_run, static_argnums=0)

def _stored(x):
    return np.asarray((x.values if is_int8(x) else x).astype(np.float32))

@pytest.mark.parametrize("kind", list(KINDS))
def test_a_paged_cache_computes_what_a_dense_one_does(kind, params):
    config, dtype, layout = KINDS[kind]
    p = params["mla" if config is MLA_TINY else "gqa"]
    if layout == "per_layer":
        p = unstack_layers(p)
    tokens_BT = jnp.asarray(prompts([7] * B, seed=2))
    dense = init_cache(config, B, S, dtype, layout=layout).with_row_ends()
    pages_BN = _tables()
    paged = init_paged_cache(config, POOL, PAGE, jnp.asarray(pages_BN), dtype, layout=layout)
    dense_h, dense = _run((config, layout), p, dense, tokens_BT)
    paged_h, paged = _run((config, layout), p, paged, tokens_BT)
    for d, q in zip(dense_h, paged_h):
        np.testing.assert_array_equal(np.asarray(d, np.float32), np.asarray(q, np.float32))
    np.testing.assert_array_equal(dense.end, paged.end)
    # Every row's slots are in its pages; pages no table lists were never written.
    unused = sorted(set(range(POOL)) - set(pages_BN.ravel().tolist()))
    for dense_x, pool_x in zip(jax.tree.leaves(dense.groups), jax.tree.leaves(paged.groups)):
        dense_x, pool_x = _stored(dense_x), _stored(pool_x)
        page_axis = 1 if layout == "stacked" else 0
        assert np.all(np.take(pool_x, unused, axis=page_axis) == 0)
        assert np.any(pool_x != 0)
        if layout == "per_layer" and config is TINY:  # merged heads: compared in the model
            continue
        for b in range(B):
            for n, page in enumerate(pages_BN[b]):
                if page < 0:
                    continue
                seq_axis = page_axis + (2 if config is TINY else 1)
                want = np.take(np.take(dense_x, b, axis=page_axis),
                               range(n * PAGE, n * PAGE + PAGE), axis=seq_axis - 1)
                got = np.take(pool_x, page, axis=page_axis)
                np.testing.assert_array_equal(got, want)

def test_rows_read_only_their_own_pages(params):
    """A row's table decides what it sees: the same pool read through two tables that swap
    the rows' pages gives the rows' results swapped."""
    config, p = TINY, params["gqa"]
    tokens_BT = jnp.asarray(prompts([7] * B, seed=3))
    pages_BN = _tables()
    pool = init_paged_cache(config, POOL, PAGE, jnp.asarray(pages_BN), "float32")
    out = apply(config, p, tokens_BT, cache=pool)
    swapped = with_pages(out.cache, jnp.asarray(pages_BN[::-1]))
    step = jnp.asarray(prompts([1] * B, seed=4))
    straight = apply(config, p, step, cache=out.cache).hidden_BTD
    crossed = apply(config, p, step[::-1], cache=swapped).hidden_BTD
    np.testing.assert_array_equal(np.asarray(straight), np.asarray(crossed[::-1]))

def test_writes_past_a_table_are_dropped():
    """`page_index` sends a position past a row's table, or on an entry that is no page, to
    a page past the pool, a different one per position; the others to their page and offset."""
    pages_BN = jnp.asarray([[5, 2], [7, -1]], jnp.int32)
    page_BT, offset_BT = kv_storage.page_index(jnp.asarray([3, 2]), 3, pages_BN, 4, 10)
    np.testing.assert_array_equal(offset_BT, [[3, 0, 1], [2, 3, 0]])
    assert page_BT[0].tolist()[:3] == [5, 2, 2]
    assert page_BT[1].tolist()[:2] == [7, 7] and page_BT[1, 2] >= 10
    beyond = kv_storage.page_index(jnp.asarray([7, 8]), 2, pages_BN, 4, 10)[0]
    assert beyond[0, 0] == 2 and np.all(beyond.ravel()[1:] >= 10)
    assert len(set(beyond.ravel().tolist())) == 4

def test_pallas_paged_attention_computes_what_the_gather_does():
    """Pallas's TPU paged attention kernel, run by its interpreter on this CPU, against the
    gather reference (`gather_pages`, then dense attention over each row's length) on one
    layer's pool of bf16 pages; the kernel reads the pool as [K, P, page, H]."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from llama_jax.nn.attention.dot_product import dense_attention

    rng = np.random.default_rng(5)
    K, G, H, page, pool, n = 2, 2, 128, 16, 12, 3
    # bf16 pages: the kernel reads keys and values as bf16 whatever they are stored as
    k_PKpH, v_PKpH = (jnp.asarray(rng.standard_normal((pool, K, page, H)), jnp.bfloat16)
                      for _ in range(2))
    q_BNH = jnp.asarray(rng.standard_normal((B, K * G, H)), jnp.float32)
    pages_BN = jnp.asarray(rng.permutation(pool)[:B * n].reshape(B, n), jnp.int32)
    lengths_B = jnp.asarray([5, 48, 30], jnp.int32)
    with pltpu.force_tpu_interpret_mode():
        kernel_BNH = paged_attention(q_BNH * H ** -0.5, jnp.swapaxes(k_PKpH, 0, 1),
                                     jnp.swapaxes(v_PKpH, 0, 1), lengths_B, pages_BN,
                                     pages_per_compute_block=1)
    k_BKSH, v_BKSH = (kv_storage.gather_pages(x, pages_BN, 0, 2).astype(jnp.float32)
                      for x in (k_PKpH, v_PKpH))
    S_ = n * page
    visible_BTS = (jnp.arange(S_) < lengths_B[:, None])[:, None, :]
    reference_BTNH = dense_attention(q_BNH[:, None], k_BKSH, v_BKSH, visible_BTS,
                                     kv_layout="BKSH", scale=H ** -0.5)
    np.testing.assert_allclose(np.asarray(kernel_BNH), np.asarray(reference_BTNH[:, 0]),
                               rtol=2e-5, atol=2e-5)
