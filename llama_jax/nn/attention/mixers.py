"""The attention mixers a block can use, registered in `MIXERS` and chosen by
`config.attention`: each describes its parameters, computes the block's attention (training,
prefill and decode alike), lays out its KV cache (stacked for a scanned layer group or per layer
for the unrolled decoder), tells the memory planner what it keeps for the backward pass, and
checks the config fields it constrains.

- gqa: multi-head attention with n_kv_heads key/value heads (MHA, GQA, MQA): gqa.py.
- mla: Multi-head Latent Attention, a latent KV cache: mla.py.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from llama_jax.nn.attention import gqa, mla
from llama_jax.nn.registry import Registry

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Mixer:
    specs: Callable  # (config, residual_scale) -> the block's "attn" TensorSpecs
    apply: Callable  # (config, p, x_BTD, context, kv) -> (y_BTD, kv)
    stacked_cache: Callable  # (config, n_layers, batch, max_len, dtype) -> a group's cache
    layer_cache: Callable  # (config, batch, max_len, dtype) -> one layer's cache
    # (config) -> (logical axis, size) of the cache dimension the cache rules may split besides
    # the rows; and (vectors, width): one token caches `vectors` vectors of `width` values
    # per layer (an int8 cache adds a scale per vector)
    cache_split: Callable
    cache_vectors: Callable
    # (config, heads, kv_heads) -> elements per token kept for the backward pass, by remat
    # policy (config.REMAT_POLICIES but full), for the heads a device holds
    saved_activations: Callable
    check_config: Callable  # (config) -> None; a ConfigError names the field


MIXERS: Registry[Mixer] = Registry("attention")
MIXERS.register("gqa", Mixer(gqa.attention_specs, gqa.apply_attention, gqa.StackedKV.zeros,
                             gqa.MergedKV.zeros, gqa.kv_cache_split, gqa.kv_cache_vectors,
                             gqa.saved_activations, gqa.check_config))
MIXERS.register("mla", Mixer(mla.mla_specs, mla.apply_mla, mla.StackedLatentKV.zeros,
                             mla.LatentKV.zeros, mla.latent_cache_split, mla.cache_vectors,
                             mla.saved_activations, mla.check_config))


def mixer_of(config: ModelConfig) -> Mixer:
    return MIXERS[config.attention]
