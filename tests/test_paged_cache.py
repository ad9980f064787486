"""The paged KV cache: rows whose slots live in pages of a pool, through a table per row,
compute what the dense cache of as many slots computes, bit for bit, for every cache kind;
writes go only to a row's own pages; and Pallas's paged attention kernel (run by its
interpreter) computes in the model what the gather reference does."""

import dataclasses

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

@pytest.mark.parametrize("kv_heads", ["gqa", "mqa"])
def test_pallas_paged_attention_in_the_model_computes_what_the_gather_does(
        kv_heads, params, monkeypatch):
    """A model's decode steps over a bf16 per-layer pool with Pallas's TPU paged attention
    kernel (run by its interpreter on this CPU, made to apply here) against the same steps
    gathering each row's pages: the same hidden states up to bf16 rounding, for GQA and MQA
    pools read through random tables with rows at lengths of their own. The kernel reads the
    pool in place as one KV head's pages (page p·K + k), which a wrong table would not."""
    from jax.experimental.pallas import tpu as pltpu
    from llama_jax.nn.attention import paged_kernel
    from models import BY_KV_HEADS

    config = dataclasses.replace(BY_KV_HEADS[kv_heads], compute_dtype="bfloat16")
    p = unstack_layers(random_params({"m": config})["m"])
    tokens_BT = jnp.asarray(prompts([7] * B, seed=6))
    pages_BN = jnp.asarray(_tables())

    def steps():
        pool = init_paged_cache(config, POOL, PAGE, pages_BN, "bfloat16", layout="per_layer")
        cache = apply(config, p, tokens_BT, cache=pool).cache
        cache = cache.replace(end=jnp.asarray(ENDS, jnp.int32))
        hidden = []
        for step in range(3):
            out = apply(config, p, jnp.asarray(prompts([1] * B, seed=10 + step)), cache=cache)
            hidden.append(np.asarray(out.hidden_BTD, np.float32))
            cache = out.cache
        return hidden

    gathered = steps()
    ran = []
    def run_kernel(*args, **kwargs):
        ran.append(args[0].shape)
        return kernel(*args, **kwargs)
    kernel = paged_kernel.paged_decode_attention
    monkeypatch.setattr(paged_kernel, "applies", lambda T, dtype, head_dim: T == 1)
    monkeypatch.setattr(paged_kernel, "paged_decode_attention", run_kernel)
    with pltpu.force_tpu_interpret_mode():
        kernels = steps()
    assert len(ran) == 3 * config.n_layers
    for want, got in zip(gathered, kernels):
        np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
        assert np.abs(got - want).mean() < 0.01


def test_the_paged_kernel_applies_to_bf16_decode_steps_on_one_tpu(monkeypatch):
    """Where the kernel runs: a TPU's decode steps over bf16 pools of 128-feature heads; not
    verify passes or prefill chunks, fp32 or int8 pools, narrower heads, other platforms or a
    mesh; its block of pages divides the table."""
    from llama_jax.nn.attention import paged_kernel
    from llama_jax.parallel import target

    monkeypatch.setattr(target, "platform", lambda: "tpu")
    assert paged_kernel.applies(1, "bfloat16", 128)
    assert not any(paged_kernel.applies(T, d, H) for T, d, H in
                   [(4, "bfloat16", 128), (1, "float32", 128), (1, "int8", 128),
                    (1, "bfloat16", 64)])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1] * 2).reshape(2), ("data",))
    monkeypatch.setattr(paged_kernel.sharding, "active_mesh", lambda: mesh)
    assert not paged_kernel.applies(1, "bfloat16", 128)
    monkeypatch.setattr(target, "platform", lambda: "cpu")
    monkeypatch.setattr(paged_kernel.sharding, "active_mesh", lambda: None)
    assert not paged_kernel.applies(1, "bfloat16", 128)
    assert [paged_kernel.compute_block(n, 16) for n in (1, 6, 64, 96)] == [1, 2, 32, 32]
