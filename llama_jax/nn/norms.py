"""Normalisation layers, selected by `config.norm`; statistics always in fp32.

- rmsnorm (Zhang & Sennrich 2019; LLaMA): `x / sqrt(mean(x²) + eps) · g` — no mean, no bias.
- layernorm (Ba et al. 2016; the original Transformer, GPT-2):
  `(x − mean) / sqrt(var + eps) · g + b`.

As in Meta's reference code, the normalised activations are cast back to the compute dtype
before the gain (and bias) are applied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.config import ModelConfig
from llama_jax.nn.spec import bias, gain


def norm_specs(config: ModelConfig) -> dict:
    dims = config.dims
    specs = {"scale": gain(dims, "D", ("norm",))}
    if config.norm == "layernorm":
        specs["bias"] = bias(dims, "D", ("norm",))
    return specs


def apply_norm(config: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    if config.norm == "layernorm":
        return layer_norm(x, p["scale"], p["bias"], config.norm_eps)
    return rms_norm(x, p["scale"], config.norm_eps)


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
