"""Normalisation layers, registered in `NORMS` and chosen by `config.norm`; statistics always
in fp32.

- rmsnorm (Zhang & Sennrich 2019; LLaMA): `x / sqrt(mean(x²) + eps) · g` — no mean, no bias.
- layernorm (Ba et al. 2016; the original Transformer, GPT-2):
  `(x − mean) / sqrt(var + eps) · g + b`.

As in Meta's reference code, the normalised activations are cast back to the compute dtype
before the gain (and bias) are applied.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp

from llama_jax.nn.ops import fenced_cotangent
from llama_jax.nn.registry import Registry
from llama_jax.spec import bias, gain

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Norm:
    """A norm kind: its tensors (`specs(dims)`, over the model width D) and its function
    (`apply(p, x, eps)`). Its output is counted by the memory planner as one D-wide
    activation, whatever the kind."""

    specs: Callable[[dict[str, int]], dict]
    apply: Callable[[dict, jax.Array, float], jax.Array]


NORMS: Registry[Norm] = Registry("norm")


def norm_specs(config: ModelConfig) -> dict:
    return NORMS[config.norm].specs(config.dims)


def apply_norm(config: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    """A block's norm. Its backward pass (a reduction over D per token) runs on its own, after
    the gradient reaching it is whole: XLA:TPU otherwise fuses it into the epilogue of the
    matmul making that gradient, which its clock prices at ~0.6 ms a layer more than the pass
    (LLaMA-3 8B, 8K tokens a chip; `ops.fenced_cotangent`)."""
    return fenced_cotangent(NORMS[config.norm].apply(p, x, config.norm_eps))


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """`x / sqrt(mean(x²) + eps) * gain` over the last axis; statistics in fp32, no mean or bias."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * gain.astype(x.dtype)


def layer_norm(x: jax.Array, gain: jax.Array, offset: jax.Array, eps: float) -> jax.Array:
    """`(x - mean) / sqrt(var + eps) * gain + offset` over the last axis; statistics in fp32."""
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * gain.astype(x.dtype) + offset.astype(x.dtype)


NORMS.register("rmsnorm", Norm(
    specs=lambda dims: {"scale": gain(dims, "D", ("norm",))},
    apply=lambda p, x, eps: rms_norm(x, p["scale"], eps)))
NORMS.register("layernorm", Norm(
    specs=lambda dims: {"scale": gain(dims, "D", ("norm",)), "bias": bias(dims, "D", ("norm",))},
    apply=lambda p, x, eps: layer_norm(x, p["scale"], p["bias"], eps)))
