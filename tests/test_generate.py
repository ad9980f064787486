"""Generation: cached decode equals the full forward, ragged batches equal single rows, greedy
equals transformers, the sampling filters, seeds, stop tokens, the cache layout and bad input."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.parallel import target
from llama_jax.plan import costs
from llama_jax.decode.generate import GenerationStats, generate, stream
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.attention import gqa
from llama_jax.nn.heads import lm_head
from llama_jax.decode.sampling import SamplingParams, Strategy, argmax, filter_logits, sample
from models import BY_KV_HEADS, MLA_TINY, TINY, prompts, random_params
from reference import assert_close, relative_error

CONFIGS = BY_KV_HEADS
forward = jax.jit(llama_jax.forward, static_argnums=0)
cached = jax.jit(lambda c, p, tokens, cache: apply(c, p, tokens, cache=cache)[:2],
                 static_argnums=0)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_equals_full_forward(name, params):
    config, p = CONFIGS[name], params[name]
    tokens = np.asarray(prompts([24, 24], seed=1))
    full = forward(config, p, tokens)
    cache = init_cache(config, 2, 32, "float32")
    h, cache = cached(config, p, tokens[:, :10], cache)  # prefill 10 tokens in one pass
    logits = [lm_head(config, p, h)]
    for t in range(10, 24):  # then one token per step
        h, cache = cached(config, p, tokens[:, t:t + 1], cache)
        logits.append(lm_head(config, p, h))
    assert relative_error(jnp.concatenate(logits, axis=1), full) < 1e-5


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "float16"])
def test_unstacked_layers_compute_the_same(params, cache_dtype):
    """Per-layer caches (16-bit ones stored as uint16 bits) hold exactly what the stacked one
    holds."""
    config, p = CONFIGS["gqa"], params["gqa"]
    tokens = np.asarray(prompts([2, 9], seed=12)[1:] * 2)
    outs = []
    for layers in (p, unstack_layers(p)):
        cache = init_cache(config, 2, 16, cache_dtype,
                           layout="stacked" if layers is p else "per_layer")
        h, cache = cached(config, layers, tokens[:, :6], cache)
        h2, _ = cached(config, layers, tokens[:, 6:7], cache)
        outs.append(np.concatenate([h, h2], axis=1))
    assert isinstance(unstack_layers(p)["groups"][0], tuple)
    assert_close(outs[1], outs[0], 1e-5)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_the_grouped_decode_step_computes_the_block_diagonal_one(params, cache_dtype,
                                                                 monkeypatch):
    """Per-layer caches attended in the grouped form (a GPU's, from 8,192 row-slots on:
    gqa.grouped_decode) give the block-diagonal form's states (the CPU's), step after step,
    an int8 cache and a left-padded row included."""
    config, layers = CONFIGS["gqa"], unstack_layers(params["gqa"])
    tokens = np.asarray(prompts([12, 12], seed=5))
    outs = []
    for grouped in (False, True):
        monkeypatch.setattr(gqa, "grouped_decode", lambda batch, slots, grouped=grouped: grouped)
        step = jax.jit(lambda c, p, t, cache: apply(c, p, t, cache=cache)[:2],
                       static_argnums=0)  # traced anew for each form
        cache = init_cache(config, 2, 16, cache_dtype, jnp.array([3, 0]), layout="per_layer")
        h, cache = step(config, layers, tokens[:, :8], cache)
        states = [h]
        for t in range(8, 12):
            h, cache = step(config, layers, tokens[:, t:t + 1], cache)
            states.append(h)
        states = np.concatenate(states, axis=1)
        outs.append(np.concatenate([states[0, 3:], states[1]]))  # row 0's padding left out
    assert_close(outs[1], outs[0], 1e-5)


def test_left_padded_rows_compute_what_they_compute_alone(params):
    config, p = CONFIGS["gqa"], params["gqa"]
    short, long = prompts([5, 12], seed=2)
    padded = np.zeros((2, 12), np.int32)
    padded[0, 7:], padded[1] = short, long
    cache = init_cache(config, 2, 16, "float32", jnp.array([7, 0]))
    h, cache = cached(config, p, padded, cache)
    np.testing.assert_allclose(lm_head(config, p, h)[0, 7:], forward(config, p, np.array([short]))[0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lm_head(config, p, h)[1], forward(config, p, np.array([long]))[0],
                               rtol=1e-5, atol=1e-5)


def test_ragged_batch_equals_each_row_alone(params):
    batch = prompts([3, 17, 9, 1, 30], seed=3)
    together = generate(TINY, params["gqa"], batch, 20, stop_tokens=[])
    for prompt, out in zip(batch, together):
        assert generate(TINY, params["gqa"], [prompt], 20, stop_tokens=[])[0] == out
    assert all(len(out) == 20 for out in together)


def test_greedy_equals_step_by_step_argmax_and_logprobs_match(params):
    prompt = prompts([7], seed=4)[0]
    tokens, logprobs = generate(TINY, params["gqa"], [prompt], 12, stop_tokens=[],
                                cache_dtype="float32", return_logprobs=True)
    assert len(tokens[0]) == 12
    sequence = list(prompt) + tokens[0]
    # causal: one forward pass over the whole sequence gives every step's logits
    logits = forward(TINY, params["gqa"], np.array([sequence[:-1]]))[0]
    assert np.argmax(logits[len(prompt) - 1:], axis=-1).tolist() == tokens[0]
    full = jax.nn.log_softmax(logits)
    expected = [float(full[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens[0])]
    np.testing.assert_allclose(logprobs[0], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["mha", "gqa", "mqa", "llama3.1-tied"])
def test_greedy_equals_transformers_generate(case, tmp_path):
    pytest.importorskip("transformers")
    import torch
    from checkpoints import hf_model

    model = hf_model(case)
    model.save_pretrained(tmp_path)
    config, p = llama_jax.load_checkpoint(tmp_path)
    batch = prompts([6, 11], seed=5, vocab=config.vocab_size)
    ours = generate(config, p, batch, 40, stop_tokens=[], cache_dtype="float32")
    for prompt, out in zip(batch, ours):
        ids = torch.tensor([prompt])  # explicit mask: token 0 must not be taken for padding
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out == hf[0, len(prompt):].tolist()


def test_top_k_1_and_tiny_top_p_equal_greedy(params):
    batch = prompts([4, 9], seed=6)
    greedy = generate(TINY, params["gqa"], batch, 16, stop_tokens=[])
    assert generate(TINY, params["gqa"], batch, 16, stop_tokens=[], temperature=1.0, top_k=1,
                    seed=3) == greedy
    assert generate(TINY, params["gqa"], batch, 16, stop_tokens=[], temperature=1.0, top_p=1e-6,
                    seed=4) == greedy


def test_sampled_tokens_lie_inside_the_filtered_sets():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.standard_normal((4, 64)) * 3, jnp.float32)
    settings = [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=8, top_p=0.7,
                                                                       min_p=0.05)]
    for setting in settings:
        params = SamplingParams.broadcast(4, temperature=0.8, **setting)
        allowed = _reference_allowed(np.asarray(logits) / 0.8, **setting)
        draw = jax.jit(lambda k: sample(logits, k, params, Strategy(draw=True, truncate=True)))
        seen = np.stack([np.asarray(draw(jax.random.key(i))) for i in range(300)])  # [300, 4]
        for b in range(4):
            assert set(seen[:, b]) <= allowed[b], setting
            assert len(set(seen[:, b])) > 1 or len(allowed[b]) == 1  # it does sample


def _reference_allowed(scaled, top_k=0, top_p=1.0, min_p=0.0):
    """The HF-order filters in float64 numpy, one row at a time."""
    out = []
    for row in scaled.astype(np.float64):
        order = np.argsort(-row)
        keep = order[:top_k] if top_k else order
        probs = np.exp(row[keep] - row[keep].max())
        probs /= probs.sum()
        n = np.searchsorted(np.cumsum(probs) - probs, top_p, side="left") if top_p < 1 else len(keep)
        keep = keep[:max(n, 1)]
        keep = [t for t in keep if np.exp(row[t] - row.max()) >= min_p]
        out.append(set(int(t) for t in keep))
    return out


def test_the_filters_keep_the_reference_sets_row_by_row():
    """Every row its own top-k, top-p and min-p, in one filter of the batch: the tokens kept are
    the float64 reference's, and ties at a threshold all stay."""
    rng = np.random.default_rng(9)
    settings = [dict(top_k=k, top_p=p, min_p=m) for k, p, m in
                itertools.product((0, 1, 7, 300), (1.0, 0.9, 0.3, 0.01), (0.0, 0.05))]
    logits = (rng.standard_normal((len(settings), 300))
              * rng.uniform(0.5, 4, (len(settings), 1))).astype(np.float32)
    params = SamplingParams(temperature=jnp.full(len(settings), 0.7),
                            **{name: jnp.asarray([s[name] for s in settings], dtype)
                               for name, dtype in (("top_k", jnp.int32), ("top_p", jnp.float32),
                                                   ("min_p", jnp.float32))})
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), params, truncate=True)))
    for b, setting in enumerate(settings):
        assert set(np.flatnonzero(kept[b])) == _reference_allowed(logits[b:b + 1] / 0.7,
                                                                  **setting)[0], setting
    ties = jnp.asarray([[3.0, 1.0, 3.0, 0.0, 3.0, 2.0]])
    for setting, expected in ((dict(top_k=2), [0, 2, 4]), (dict(top_p=0.5), [0, 2, 4])):
        out = filter_logits(ties, SamplingParams.broadcast(1, temperature=1.0, **setting), True)
        assert np.flatnonzero(np.isfinite(np.asarray(out[0]))).tolist() == expected, setting


def test_argmax_is_the_first_index_of_the_maximum():
    rng = np.random.default_rng(12)
    ties = jnp.asarray(rng.integers(-3, 4, (16, 257)), jnp.float32)  # many tied maxima
    wide = jnp.asarray(rng.standard_normal((3, 8192)), jnp.float32)
    for x in (ties, wide, -jnp.abs(wide)):
        np.testing.assert_array_equal(argmax(x), np.argmax(np.asarray(x), axis=-1))


def test_a_draw_is_jax_categorical_and_greedy_rows_stay_greedy():
    logits = jnp.asarray(np.random.default_rng(13).standard_normal((4, 300)) * 2, jnp.float32)
    params = SamplingParams.broadcast(4, temperature=1.0)
    params = params.replace(temperature=jnp.asarray([1.0, 0.0, 1.0, 0.0]))
    for i in range(20):
        key = jax.random.key(i)
        drawn = np.asarray(sample(logits, key, params, Strategy(draw=True, truncate=False)))
        expected = np.asarray(jax.random.categorical(key, logits))
        np.testing.assert_array_equal(drawn[[0, 2]], expected[[0, 2]])
        np.testing.assert_array_equal(drawn[[1, 3]], np.argmax(np.asarray(logits), -1)[[1, 3]])


def test_filter_keeps_everything_when_off():
    logits = jnp.asarray(np.random.default_rng(8).standard_normal((2, 50)), jnp.float32)
    out = filter_logits(logits, SamplingParams.broadcast(2, temperature=1.0), truncate=True)
    assert np.isfinite(np.asarray(out)).all()


def test_same_seed_same_output_and_chunking_does_not_matter(params):
    batch = prompts([5, 8], seed=9)
    kw = dict(temperature=1.0, top_p=0.95, stop_tokens=[])
    a = generate(TINY, params["gqa"], batch, 24, seed=11, **kw)
    assert generate(TINY, params["gqa"], batch, 24, seed=11, **kw) == a
    assert generate(TINY, params["gqa"], batch, 24, seed=12, **kw) != a
    chunks = list(stream(TINY, params["gqa"], batch, 24, seed=11, chunk_steps=5, **kw))
    assert len(chunks) == 1 + 5  # the first token, then ceil(23 / 5) chunks
    assert [sum((c[0][row] for c in chunks), []) for row in range(2)] == a


def test_stop_tokens(params):
    prompt = prompts([6], seed=10)[0]
    free = generate(TINY, params["gqa"], [prompt], 12, stop_tokens=[])[0]
    stop = free[4]
    first = free.index(stop)
    assert generate(TINY, params["gqa"], [prompt], 12, stop_tokens=[stop])[0] == free[:first]
    eos_config = dataclasses.replace(TINY, eos_ids=(stop,))
    assert generate(eos_config, params["gqa"], [prompt], 12)[0] == free[:first]  # None = EOS
    assert len(generate(eos_config, params["gqa"], [prompt], 12, stop_tokens=[])[0]) == 12
    # Ids past the vocabulary (a tokenizer's EOS beside a small model) are ignored, with a
    # warning, whether they come as stop_tokens or as the model's eos_ids.
    outside = TINY.vocab_size + 7
    with pytest.warns(UserWarning, match=rf"stop ids \[{outside}\] are outside"):
        assert generate(TINY, params["gqa"], [prompt], 12,
                        stop_tokens=[outside, stop])[0] == free[:first]
    with pytest.warns(UserWarning, match=rf"eos_ids \[{outside}\] are outside"):
        wide_config = dataclasses.replace(TINY, eos_ids=(outside, stop))
    assert wide_config.stop_ids == (stop,)
    assert generate(wide_config, params["gqa"], [prompt], 12)[0] == free[:first]


def test_full_context_stops_cleanly_with_a_message(params):
    config = dataclasses.replace(TINY, max_seq_len=40)
    stats = GenerationStats()
    with pytest.warns(UserWarning, match="context is full: generating at most 5 of 20"):
        out = generate(config, params["gqa"], prompts([35, 3], seed=11), 20, stop_tokens=[],
                       stats=stats)
    assert [len(o) for o in out] == [5, 5] and stats.truncated


def test_kv_cache_bytes_equal_the_formula():
    config = TINY
    cache = init_cache(config, batch=3, max_len=48, dtype=jnp.bfloat16).groups[0]
    L, K, H = config.n_layers, config.n_kv_heads, config.head_dim
    assert cache.k.shape == (L, 3, K, 48, H) and cache.k.dtype == jnp.bfloat16
    assert cache.k.nbytes + cache.v.nbytes == 2 * L * 3 * 48 * K * H * 2
    assert cache.k.nbytes + cache.v.nbytes == costs.kv_cache_bytes_per_token(config) * 3 * 48
    per_layer = init_cache(config, batch=3, max_len=48, dtype="bfloat16",
                           layout="per_layer").groups[0]
    assert [a.k.shape for a in per_layer] == [(3, K * 48, H)] * L
    assert sum(a.k.nbytes + a.v.nbytes for a in per_layer) == cache.k.nbytes + cache.v.nbytes


def test_mla_cache_bytes_equal_the_formula():
    """L·(kv_lora_rank + qk_rope_head_dim) values per token, in both layouts (the per-layer one
    stores bf16 as its bits, the same bytes)."""
    L, W = MLA_TINY.n_layers, 24 + 8
    stacked = init_cache(MLA_TINY, batch=3, max_len=48, dtype=jnp.bfloat16).groups[0]
    assert stacked.latent.shape == (L, 3, 48, W) and stacked.latent.dtype == jnp.bfloat16
    assert stacked.latent.nbytes == L * W * 2 * 3 * 48 == costs.kv_cache_bytes_per_token(
        MLA_TINY) * 3 * 48
    per_layer = init_cache(MLA_TINY, batch=3, max_len=48, dtype="bfloat16",
                           layout="per_layer").groups[0]
    assert [a.latent.shape for a in per_layer] == [(3, 48, W)] * L
    assert sum(a.latent.nbytes for a in per_layer) == stacked.latent.nbytes


def test_cache_dtype_defaults_to_the_compute_dtype():
    assert init_cache(TINY, 1, 8).groups[0].k.dtype == jnp.float32
    bf16 = TINY.with_execution(compute_dtype="bfloat16")
    assert init_cache(bf16, 1, 8).groups[0].k.dtype == jnp.bfloat16
    assert init_cache(bf16, 1, 8, np.float32).groups[0].k.dtype == jnp.float32


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
@pytest.mark.parametrize("model, cache_dtype", [(TINY, "float32"), (TINY, "int8"),
                                                (MLA_TINY, "bfloat16")], ids=["gqa", "int8", "mla"])
def test_an_end_per_row_computes_what_one_shared_end_does(model, cache_dtype, layout):
    """Rows that all end at the same position compute the same, bit for bit, whether the
    cache holds that end once (one `dynamic_update_slice` a write) or once per row (the
    decoders' rows: one scatter a write): a prompt, then two steps."""
    p = llama_jax.init_params(model, jax.random.key(3))
    if layout == "per_layer":
        p = unstack_layers(p)
    tokens = np.asarray(prompts([9, 9, 9], seed=14, vocab=model.vocab_size))
    shared = init_cache(model, 3, 16, cache_dtype, layout=layout)
    outs = {}
    for name, cache in (("shared", shared), ("rows", shared.with_row_ends())):
        h_BTD, cache = cached(model, p, tokens[:, :7], cache)
        hs = [h_BTD]
        for t in (7, 8):
            h_BTD, cache = cached(model, p, tokens[:, t:t + 1], cache)
            hs.append(h_BTD)
        outs[name] = (np.concatenate(hs, axis=1), jax.tree.leaves(cache.groups))
    np.testing.assert_array_equal(outs["rows"][0], outs["shared"][0])
    for a, b in zip(outs["rows"][1], outs["shared"][1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", ["float32", "int8", "bfloat16"])
def test_rows_write_at_their_own_positions(dtype):
    """A write with a position per row (`kv_storage.write`, a stacked cache `[L, B, K, S, H]`
    at layer 1; and a merged per-layer GQA cache, every head in one scatter) equals each row
    written alone at its position; positions past the cache are dropped."""
    from llama_jax.nn.attention import gqa, kv_storage
    from llama_jax.nn.attention.context import Context
    from llama_jax.quant import is_int8

    rng = np.random.default_rng(0)
    B, K, S, H, T = 4, 2, 16, 8, 3
    end_B = np.array([0, 5, 13, 15])  # row 2 ends at the last position, row 3 past it
    x_BTKH = rng.standard_normal((B, T, K, H)).astype(np.float32)
    stored = lambda c: np.asarray(c.values if is_int8(c) else c, np.float32)  # noqa: E731
    cache = kv_storage.zeros((3, B, K, S, H), dtype)
    put_LBKSH = np.swapaxes(x_BTKH, 1, 2)[None]
    together = kv_storage.write(cache, put_LBKSH, (1, 0, 0, end_B, 0), dtype, row_axis=1)
    for b in range(B):
        kept = min(T, S - end_B[b])
        alone = kv_storage.write(cache, put_LBKSH[:, b:b + 1, :, :kept],
                                 (1, b, 0, int(end_B[b]), 0), dtype)
        np.testing.assert_array_equal(stored(together)[:, b], stored(alone)[:, b])
    np.testing.assert_array_equal(stored(together)[[0, 2]], 0)

    x_BTKH = rng.standard_normal((B, T, TINY.K, TINY.H)).astype(np.float32)
    together = gqa.LayerCache.zeros(TINY, B, S, dtype).write(
        x_BTKH, x_BTKH, Context(None, end=jnp.asarray(end_B)))
    for b in range(B):
        kept = min(T, S - end_B[b])
        alone = gqa.LayerCache.zeros(TINY, 1, S, dtype).write(
            x_BTKH[b:b + 1, :kept], x_BTKH[b:b + 1, :kept], Context(None, end=jnp.int32(end_B[b])))
        np.testing.assert_array_equal(stored(together.v)[b], stored(alone.v)[0])


@pytest.mark.parametrize("model", [TINY, MLA_TINY], ids=["gqa", "mla"])
def test_decode_step_updates_the_cache_in_place(model):
    config = dataclasses.replace(model, n_layers=8, max_seq_len=4096)
    p = llama_jax.init_params(config, jax.random.key(0))
    cache = init_cache(config, 4, 2048, "float32")
    step = jax.jit(lambda c, p, tokens, cache: apply(c, p, tokens, cache=cache).cache,
                   static_argnums=0, donate_argnums=3)
    memory = step.lower(config, p, np.zeros((4, 1), np.int32), cache).compile().memory_analysis()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache.groups[0]))
    assert memory.alias_size_in_bytes >= cache_bytes  # the donated cache is the output buffer
    assert memory.temp_size_in_bytes < cache_bytes / 2  # no copy of the stacked cache


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1, 99999]]), r"token id\(s\) \[99999\] outside the vocabulary"),
    (dict(prompts=[[-1]]), "outside the vocabulary"),
    (dict(prompts=[[1] * 256]), "context .* is 256"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(min_p=1.0), "min_p=1.0"),
    (dict(decode_impl="fast"), "decode_impl='fast' is not one of auto, scan, unrolled"),
    (dict(speculate="medusa"), "speculate='medusa' is not one of ngram, draft"),
    (dict(speculate="ngram", num_speculative_tokens=0), r"num_speculative_tokens=0 .*\[1, 15\]"),
    (dict(speculate="ngram", num_speculative_tokens=16), "num_speculative_tokens=16"),
    (dict(speculate="ngram", ngram=(3, 2)), r"ngram=\(3, 2\) must be \(min, max\)"),
    (dict(speculate="ngram", draft=(TINY, None)), "prompt lookup: give no draft"),
    (dict(speculate="draft"), r"needs draft=\(draft_config, draft_params\)"),
    (dict(draft=(dataclasses.replace(TINY, vocab_size=256), None)),
     r"draft model's vocabulary \(256 tokens\) is not the model's \(512\)"),
    (dict(draft=(dataclasses.replace(TINY, head="regression", n_labels=1), None)),
     "draft model has a task head"),
])
def test_bad_requests_fail_before_compiling(kwargs, message, params, monkeypatch):
    from llama_jax.decode import generate as decoder

    def compiled(*args, **kwargs):
        raise AssertionError("compiled before checking the request")

    monkeypatch.setattr(decoder, "_compiled", compiled)
    request = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(GenerateError, match=message):
        generate(TINY, params["gqa"], **request)


def test_compiled_programs_are_kept_least_recently_used_first(params, monkeypatch):
    """A long-lived process decoding many shapes keeps a bounded number of programs, and the
    one in use stays compiled."""
    from llama_jax.decode import generate as decoder

    monkeypatch.setattr(decoder, "_MAX_EXECUTABLES", 2)
    decoder._EXECUTABLES.clear()
    for n in (3, 40, 3):  # two prompt buckets, then the first again
        stats = GenerationStats()
        generate(TINY, params["gqa"], prompts([n]), 2, stop_tokens=[], stats=stats)
    assert len(decoder._EXECUTABLES) == 2
    again = GenerationStats()
    generate(TINY, params["gqa"], prompts([3]), 2, stop_tokens=[], stats=again)
    assert again.compile_s == 0  # still compiled: used last


def test_bf16_model_decodes_batches(params):
    """bf16 weights and compute: batched decode runs (XLA:CPU lacks some bf16 dot kernels) and
    each row still matches its single-row run."""
    config = dataclasses.replace(TINY, param_dtype="bfloat16", compute_dtype="bfloat16")
    p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params["gqa"])
    batch = prompts([5, 9, 3, 12, 7, 8, 2, 10], seed=13)
    together = generate(config, p, batch, 6, stop_tokens=[])
    assert [generate(config, p, [row], 6, stop_tokens=[])[0] for row in batch[:3]] == together[:3]


def test_cpu_decoder_copy_lives_only_as_long_as_the_params():
    import gc

    from llama_jax.decode import decoder

    decoder.release_decoder_copy()  # copies other tests' parameters hold
    p = llama_jax.init_params(TINY, jax.random.key(5))
    first = generate(TINY, p, [[1, 2, 3]], 4, stop_tokens=[])
    assert generate(TINY, p, [[1, 2, 3]], 4, stop_tokens=[]) == first  # reuses the copy
    assert len(decoder._UNSTACKED) == 1
    del p
    gc.collect()
    assert len(decoder._UNSTACKED) == 0


@pytest.mark.parametrize("backend, impl", [("cpu", "unrolled"), ("gpu", "unrolled"),
                                           ("tpu", "unrolled"), ("metal", "scan")])
def test_auto_decoder_is_the_one_measured_faster_on_the_backend(backend, impl, params,
                                                                  monkeypatch):
    """The unrolled decoder where it is the faster (CPU, GPU measured; TPU by XLA:TPU's
    clock), the scan on a platform not priced. Unstacked parameters (or stacked ones whose
    copy exists) decode unrolled anywhere: the scan cannot read them, and the copy is already
    paid for."""
    from llama_jax.decode import decoder

    # the parameters' devices are of that platform (parallel/target.py)
    monkeypatch.setattr(target, "platform_of_tree", lambda tree: backend)
    p = llama_jax.init_params(TINY, jax.random.key(6))  # no copy of it made yet
    assert decoder.resolve_decode_impl("auto", p) == impl
    assert decoder.resolve_decode_impl("auto", unstack_layers(p)) == "unrolled"
    assert decoder.resolve_decode_impl("scan", p) == "scan"
    decoder.decoder_params(p, "unrolled")
    assert decoder.resolve_decode_impl("auto", p) == "unrolled"


def test_auto_decoder_scans_when_the_layer_copy_and_cache_do_not_fit(params, monkeypatch,
                                                                     caplog):
    from llama_jax.decode import decoder

    p = llama_jax.init_params(TINY, jax.random.key(7))
    copy = sum(w.nbytes for w in jax.tree.leaves(p["groups"]))
    for free, impl in ((copy + 100, "unrolled"), (copy + 99, "scan")):
        monkeypatch.setattr(decoder, "free_memory_bytes", lambda: free)
        assert decoder.resolve_decode_impl("auto", p, reserve_bytes=100) == impl
    # generate reserves its cache: B=1 row of 16 + 16 slots.
    cache = 32 * costs.kv_cache_bytes_per_token(TINY, "float32")
    monkeypatch.setattr(decoder, "free_memory_bytes", lambda: copy + cache - 1)
    with caplog.at_level("INFO", logger=decoder.__name__):
        tokens = generate(TINY, p, [[1, 2, 3]], 4, stop_tokens=[])
    assert "decoding with 'scan'" in caplog.text
    assert decoder._cached_copy(p) is None  # no copy was made
    monkeypatch.setattr(decoder, "free_memory_bytes", lambda: copy + cache)
    assert generate(TINY, p, [[1, 2, 3]], 4, stop_tokens=[]) == tokens
    assert decoder._cached_copy(p) is not None  # unrolled this time
    # With the copy made, only the cache must fit; where it does not, the copy goes.
    for free, impl in ((cache, "unrolled"), (cache - 1, "scan")):
        monkeypatch.setattr(decoder, "free_memory_bytes", lambda: free)
        assert decoder.resolve_decode_impl("auto", p, reserve_bytes=cache) == impl
    assert decoder._cached_copy(p) is None


def test_a_caller_that_owns_the_params_holds_one_copy():
    """A CLI or server drops the stacked arrays once the decoder's copy is made."""
    import gc
    import weakref

    from llama_jax.decode.decoder import owned_decoder_params

    p = llama_jax.init_params(TINY, jax.random.key(8))
    expected = generate(TINY, p, [[4, 5, 6]], 4, stop_tokens=[], decode_impl="scan")
    stacked = [weakref.ref(w) for w in jax.tree.leaves(p["groups"])]
    p, impl = owned_decoder_params(p, "auto")
    gc.collect()
    assert all(ref() is None for ref in stacked)
    assert isinstance(p["groups"][0], tuple) and impl == "unrolled"
    assert generate(TINY, p, [[4, 5, 6]], 4, stop_tokens=[], decode_impl=impl) == expected
