"""Rotary position embeddings (Su et al. 2021) with LLaMA-3.1 "llama3" frequency scaling.

Layout: llama_jax uses the half-split ("rotate_half") layout of Hugging Face: feature i of a head
is paired with feature i + H/2 and both rotate by angle m·θ_i, θ_i = base^(-2i/H). Meta's
checkpoints pair adjacent features (2i, 2i+1) instead; the checkpoint converters permute the q/k
projection rows between the two layouts, so the model code has exactly one RoPE.

Precision: a plain fp32 angle m·θ_i is off by up to ulp(m)/2 — 0.004 rad at m = 131072, which is
what fp32 implementations get at long context. Here the frequencies are split on the host
(float64) into chunks of 6 bits each, so that m·chunk is exact in fp32 for m < 2^18 and its
fractional number of turns can be taken without rounding; the remainder term is tiny. The
resulting angle, reduced to [-π, π], is accurate to ~1e-7 rad at any position below 2^18.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.config import ModelConfig, RopeScaling

_CHUNK_BITS = 6
_N_CHUNKS = 4  # 4 exact chunks + remainder: remainder < 2^-24 turns per position


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """θ_i = base^(-2i/H) for i < H/2, in float64, rescaled for rope_type "llama3"."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = config.rope_theta ** -exponents
    if config.rope_type == "llama3":
        inv_freq = llama3_scaled(inv_freq, config.rope_scaling)
    return inv_freq


def llama3_scaled(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Meta's `apply_scaling`: keep short wavelengths, divide long ones by `factor`, and
    interpolate smoothly in between (wavelength measured against the original context)."""
    context = scaling.original_max_position_embeddings
    low_freq_wavelen = context / scaling.low_freq_factor
    high_freq_wavelen = context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((context / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return np.where(wavelen < high_freq_wavelen, inv_freq,
                    np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, interpolated))


def _turn_chunks(inv_freq: np.ndarray) -> np.ndarray:
    """Splits θ/2π (turns per position) into `_N_CHUNKS` fixed-point chunks of `_CHUNK_BITS`
    bits plus a remainder: [_N_CHUNKS + 1, H/2], each row exactly representable in fp32."""
    rest = inv_freq / (2 * math.pi)
    rows = []
    for j in range(1, _N_CHUNKS + 1):
        scale = 2.0 ** (_CHUNK_BITS * j)
        chunk = np.floor(rest * scale) / scale
        rows.append(chunk)
        rest = rest - chunk
    rows.append(rest)
    return np.stack(rows).astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles, fp32 `[B, T, H/2]`, for integer positions."""
    return cos_sin(inverse_frequencies(config), positions_BT)


def cos_sin(inv_freq: np.ndarray, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the angles `position · inv_freq`, fp32 `[B, T, len(inv_freq)]`, accurate
    to ~1e-7 rad for integer positions below 2^18 (see the module docstring)."""
    chunks = jnp.asarray(_turn_chunks(inv_freq))
    pos_BT1 = positions_BT.astype(jnp.float32)[..., None]  # exact below 2^24
    turns_BTh = jnp.zeros(positions_BT.shape + (len(inv_freq),), jnp.float32)
    for chunk in chunks:
        part = pos_BT1 * chunk  # exact for the fixed-point chunks (positions < 2^18)
        turns_BTh = turns_BTh + (part - jnp.round(part))
        turns_BTh = turns_BTh - jnp.round(turns_BTh)  # keep |turns| <= 1/2
    angle_BTh = (2 * math.pi) * turns_BTh
    return jnp.cos(angle_BTh), jnp.sin(angle_BTh)


def apply_rope(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
    """Rotates each (i, i + H/2) feature pair of every head; math in fp32, result in x's dtype."""
    half = x_BTNH.shape[-1] // 2
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTNH.dtype)
