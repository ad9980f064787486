"""An attention mixer added from outside the package, the way a user adds one: this file
registers a toy kind, `mean`, in `MIXERS` and nothing in llama_jax names it. The toy trains
(the library's train step), decodes from its own cache under both decode implementations
(equal to the full forward, and from a paged cache as from a dense one), is planned
(parameter counts and cache bytes from its hooks equal to the real leaves and cache) and has
its config checked: what the trainer, the decoder and the planner ask of a mixer is the
`Mixer` interface and nothing more.

The toy, a causal mean: each token's output is W_O applied to the mean of W_V·x over the
tokens it may see (itself and those before it in its document, by the context's mask) — a
mixer without a softmax, caching one vector of H values per token and layer.

The checks run in a fresh process (`python tests/test_mixer_extension.py`): a kind registered
here stays registered, and would otherwise be a choice in the other tests' configs (the
generated config reference lists the registered kinds)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import llama_jax
from llama_jax.config import MeshConfig, ModelConfig, TrainConfig
from llama_jax.errors import ConfigError, require
from llama_jax.model.kv_cache import init_cache, init_paged_cache
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.attention.context import Context
from llama_jax.nn.attention import kv_storage
from llama_jax.nn.attention.mixers import MIXERS, Mixer
from llama_jax.nn.ops import dense
from llama_jax.plan import costs, info, memory
from llama_jax.spec import weight
from llama_jax.training.optim import make_optimizer
from llama_jax.training.step import init_state, loss_sums, train_step
from fresh_process import passes_alone


@struct.dataclass
class MeanCache:
    """The values `[L, B, S, H]` of a layer group, read and written at `context.layer`, or
    `[B, S, H]` of one layer (the unrolled decoder's); with `context.pages`, a pool of pages
    (B is then the pages) read and written through the rows' tables."""

    v: jax.Array

    @classmethod
    def zeros(cls, config: ModelConfig, n_layers: int | None, batch: int, max_len: int,
              dtype: str) -> "MeanCache":
        layers = () if n_layers is None else (n_layers,)
        return cls(jnp.zeros((*layers, batch, max_len, config.H), dtype))

    def write(self, v_BTH: jax.Array, context: Context) -> "MeanCache":
        lead = self.v.ndim - 3  # the layers' axis, if any
        return self.replace(v=kv_storage.write(
            self.v, v_BTH[(None,) * lead], (context.layer,) * lead + (0, context.end, 0),
            self.v.dtype, row_axis=lead, pages_BN=context.pages))

    def read(self, context: Context) -> jax.Array:
        v = self.v[context.layer] if self.v.ndim == 4 else self.v
        return v if context.pages is None else kv_storage.gather_pages(v, context.pages, 0, 1)


def mean_specs(config: ModelConfig, residual_scale: float) -> dict:
    return {"wv": weight(config.dims, "DH", ("embed", "head_dim"), contract="D"),
            "wo": weight(config.dims, "HD", ("head_dim", "embed"), residual_scale,
                         contract="H")}


def mean_apply(config: ModelConfig, p: dict, x_BTD: jax.Array, context: Context,
               cache: MeanCache | None = None):
    v_BTH = dense("BTD,DH->BTH", x_BTD, p["wv"])
    v_BSH = v_BTH
    if cache is not None:
        cache = cache.write(v_BTH, context)
        v_BSH = cache.read(context).astype(v_BTH.dtype)
    seen_BTS = context.mask.dense().astype(jnp.float32)
    # A left-padding slot sees nothing: its output is zero, not 0/0 (which would reach the
    # cache and, times a zero weight, every row's output).
    weights_BTS = seen_BTS / jnp.maximum(seen_BTS.sum(-1, keepdims=True), 1.0)
    mean_BTH = jnp.einsum("BTS,BSH->BTH", weights_BTS, v_BSH.astype(jnp.float32))
    return dense("BTH,HD->BTD", mean_BTH.astype(x_BTD.dtype), p["wo"]), cache


def mean_check_config(config: ModelConfig) -> None:
    require(not config.bias, "bias", config.bias, "is not supported with attention 'mean'")


def register_mean():
    MIXERS.register("mean", Mixer(
        specs=mean_specs, apply=mean_apply, stacked_cache=MeanCache.zeros,
        layer_cache=lambda config, batch, max_len, dtype: MeanCache.zeros(
            config, None, batch, max_len, dtype),
        cache_split=lambda config: ("head_dim", config.H),
        cache_vectors=lambda config: (1, config.H),
        saved_activations=lambda config, heads, kv_heads: dict.fromkeys(
            ("none", "dots", "dots_no_batch", "attention", "dots_with_attention"), 2 * config.H),
        check_config=mean_check_config,
        context_flops=lambda config, seq_len: seq_len * config.H))  # sums T/2 vectors of H


VOCAB = 64


def mean_config() -> ModelConfig:
    """A small model of the toy kind (a config choice only once it is registered)."""
    return ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, multiple_of=16,
                       max_seq_len=32, attention="mean")


def tokens(batch, length, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length), dtype=np.int32)


def check_it_trains(config: ModelConfig):
    """Ten AdamW steps of the library's train step on one batch: the loss falls, and the toy's
    own tensors are the ones the mixer slot holds."""
    train = TrainConfig(learning_rate=1e-2, warmup_steps=1, steps=10)
    optimizer = make_optimizer(config, train)
    state = init_state(config, optimizer, jax.random.key(0))
    assert set(state.params["groups"][0]["attn"]) == {"wv", "wo"}
    loss_fn = functools.partial(loss_sums, config, bos_id=-1, z_loss=0.0)
    step = jax.jit(functools.partial(train_step, config, train, optimizer, loss_fn))
    batch = tokens(4, 17, seed=1)
    losses = []
    for _ in range(10):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] > np.log(config.vocab_size) - 0.5 and losses[-1] < 0.8 * losses[0], losses
    return state.params


def check_it_decodes(config: ModelConfig, params):
    """Greedy decoding of a ragged batch from the toy's cache, stacked (scan) and per layer
    (unrolled): the tokens and log-probabilities the full forward gives the whole sequences.
    Then the rows of a paged cache (the server's: pages of a pool through a table per row)
    compute what the dense cache computes, stacked and per layer."""
    prompts = [tokens(1, n, seed=n)[0].tolist() for n in (3, 7, 5)]
    new = 6
    for impl in ("scan", "unrolled"):
        got, logprobs = llama_jax.generate(config, params, prompts, new, stop_tokens=[],
                                           decode_impl=impl, return_logprobs=True)
        rows = [prompt + out for prompt, out in zip(prompts, got)]
        width = max(map(len, rows))
        padded = np.array([row + [0] * (width - len(row)) for row in rows], np.int32)
        full = jax.nn.log_softmax(llama_jax.forward(config, params, padded), axis=-1)
        for b, (prompt, out) in enumerate(zip(prompts, got)):
            want = np.asarray(full[b, len(prompt) - 1:len(prompt) - 1 + new])
            assert out == want.argmax(-1).tolist(), (impl, b, out)
            np.testing.assert_allclose(logprobs[b], want.max(-1), rtol=1e-5, atol=1e-5)

    prompt, step = tokens(2, 5, seed=3), tokens(2, 1, seed=4)
    pages_BN = jnp.asarray([[3, 0], [4, 1]])  # two pages of 4 positions per row, in a pool of 5
    for layout, p in (("stacked", params), ("per_layer", unstack_layers(params))):
        hidden = []
        for cache in (init_cache(config, 2, 8, layout=layout).with_row_ends(),
                      init_paged_cache(config, 5, 4, pages_BN, layout=layout)):
            cache = apply(config, p, prompt, cache=cache).cache
            hidden.append(np.asarray(apply(config, p, step, cache=cache).hidden_BTD))
        np.testing.assert_array_equal(*hidden)


def check_it_is_planned(config: ModelConfig, params):
    """The planner's figures come from the toy's hooks: parameters from its specs (equal to
    the leaves), cache bytes from `cache_vectors` (equal to the cache `stacked_cache`
    builds), both in the memory plan and `plan.info`, and the training FLOPs from its
    `context_flops` (no softmax attention's)."""
    leaves = sum(x.size for x in jax.tree.leaves(params))
    assert costs.param_counts(config).total == leaves
    D, H, F, L = config.D, config.H, config.F, config.n_layers  # W_V, W_O; SwiGLU; the head
    matmul = L * (2 * D * H + 3 * D * F) + D * VOCAB
    assert costs.param_counts(config).matmul == matmul
    assert costs.train_flops_per_token(config, 8) == 6 * matmul + 3 * L * 8 * H
    cache = init_cache(config, 3, 8, "float32")
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache.groups))
    assert cache_bytes == 3 * 8 * config.n_layers * config.H * 4
    assert costs.kv_cache_bytes_per_token(config, "float32") * 3 * 8 == cache_bytes
    plan = info.plan(config, batch=3, seq=8, dtype="float32", bandwidth_gbps=100.0)
    assert (plan["n_params"], plan["kv_cache_bytes"]) == (leaves, cache_bytes)
    mem = memory.plan_memory(config, MeshConfig(), 1, batch=3, seq=8, remat="none",
                             kv_batch=3, kv_seq=8, kv_dtype="float32")
    assert (mem.weights, mem.kv_cache) == (4 * leaves, cache_bytes)


def check_its_config_is_checked(config: ModelConfig):
    try:
        dataclasses.replace(config, bias=True)
    except ConfigError as e:
        assert "bias=True is not supported with attention 'mean'" in str(e), e
    else:
        raise AssertionError("bias=True was accepted")


def main():
    register_mean()
    config = mean_config()
    params = check_it_trains(config)
    check_it_decodes(config, params)
    check_it_is_planned(config, params)
    check_its_config_is_checked(config)
    print("ok")


def test_a_mixer_registered_from_outside_trains_decodes_and_is_planned():
    passes_alone(__file__)


if __name__ == "__main__":
    main()
