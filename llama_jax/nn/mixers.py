"""The attention mixers a block can use, by `config.attention`: each describes its parameters,
computes the block's attention (training, prefill and decode alike) and lays out its KV cache,
stacked for a scanned layer group or per layer for the unrolled decoder.

- gqa: multi-head attention with n_kv_heads key/value heads (MHA, GQA, MQA): attention.py.
- mla: Multi-head Latent Attention, a latent KV cache: mla.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from llama_jax.config import ModelConfig
from llama_jax.nn.attention import (MergedKV, StackedKV, apply_attention, attention_specs,
                                    kv_cache_elements, kv_cache_split)
from llama_jax.nn.mla import (LatentKV, StackedLatentKV, apply_mla, cache_width,
                              latent_cache_split, mla_specs)


@dataclasses.dataclass(frozen=True)
class Mixer:
    specs: Callable  # (config, residual_scale) -> the block's "attn" TensorSpecs
    apply: Callable  # (config, p, x_BTD, context, kv) -> (y_BTD, kv)
    stacked_cache: Callable  # (config, n_layers, batch, max_len, dtype) -> a group's cache
    layer_cache: Callable  # (config, batch, max_len, dtype) -> one layer's cache
    # (config) -> (logical axis, size) of the cache dimension the cache rules may split besides
    # the rows, and the values one token caches per layer
    cache_split: Callable
    cache_elements: Callable


MIXERS = {"gqa": Mixer(attention_specs, apply_attention, StackedKV.zeros, MergedKV.zeros,
                       kv_cache_split, kv_cache_elements),
          "mla": Mixer(mla_specs, apply_mla, StackedLatentKV.zeros, LatentKV.zeros,
                       latent_cache_split, cache_width)}


def mixer_of(config: ModelConfig) -> Mixer:
    return MIXERS[config.attention]
