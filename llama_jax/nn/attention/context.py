"""What every attention mixer shares, kept apart from the mixers so that each of them (gqa.py,
mla.py, one of your own) imports this module and none imports another: the interface a mixer
implements (`Mixer`) and the registry it joins (`MIXERS`, chosen by `config.attention`), the
`Context` a forward pass hands to every layer's mixer, and `attention_of`, the dot-product
kernel under the configured implementation and softmax scale.

A mixer registers itself at the bottom of its module; mixers.py imports the built-in ones, so
read the registry through it (`mixers.MIXERS`, `mixers.mixer_of`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

import jax
from flax import struct

from llama_jax.nn.attention.dot_product import Mask, dot_product_attention
from llama_jax.nn.positions import Rotation
from llama_jax.nn.registry import Registry
from llama_jax.nn.rope import softmax_scale

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig


@struct.dataclass
class Context:
    """What the attention layers of one forward pass share: which keys each query may see (of
    the T new tokens in training, of the S cache slots when decoding), RoPE's rotation (None
    without rotary positions), the cache slot of each row's first new token (`[B]`: every
    decoder's rows end where each has got to), the index of the layer running within its
    group (set by the layer scan, for stacked caches), and with a paged cache each row's
    pages (`[B, N]`: row b's position p is in page `pages[b, p // page]`)."""

    mask: Mask
    rotation: Rotation | None = None
    end: jax.Array | None = None
    layer: jax.Array | int = 0
    pages: jax.Array | None = None


def attention_of(config: ModelConfig):
    """`dot_product_attention` under the configured implementation, blocks and softmax scale
    (1/√H, times YaRN's mscale²: rope.softmax_scale)."""
    return functools.partial(dot_product_attention, impl=config.attention_impl,
                             block_q=config.attention_block_q,
                             block_kv=config.attention_block_kv, scale=softmax_scale(config))


@dataclasses.dataclass(frozen=True)
class Mixer:
    """An attention mixer kind. Its caches are pytrees (flax struct dataclasses) whose arrays
    have the batch rows first (after the layers' axis of a stacked cache) and the S slots on
    another axis; `apply` writes each row's T new tokens at its own slot `context.end[b]` (of
    layer `context.layer` in a stacked cache; `kv_storage.write` takes such per-row starts).
    A paged cache is the same cache made for P pages of `page` slots (the rows' axis holds
    pages): with `context.pages` set, `apply` writes through the rows' tables
    (`kv_storage.write`'s `pages_BN`) and attends over the rows' pages
    (`kv_storage.gather_pages`)."""

    specs: Callable  # (config, residual_scale) -> the block's "attn" TensorSpecs
    apply: Callable  # (config, p, x_BTD, context, cache or None) -> (y_BTD, cache)
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
    # (config, seq_len) -> forward FLOPs per token of one layer besides its weights' matmuls:
    # the work against the other tokens of a sequence (the planner's and the MFU's FLOPs)
    context_flops: Callable


def causal_attention_flops(config: ModelConfig, seq_len: int) -> int:
    """Dot-product attention's `context_flops`: a token's scores over H and weighted sum over
    Hv against the T/2 keys a causal query sees on average, for N heads: 2·(T/2)·N·(H + Hv)."""
    return seq_len * config.n_heads * (config.H + config.v_head_dim)


MIXERS: Registry[Mixer] = Registry("attention")
