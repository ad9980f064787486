"""Rotary position embeddings (Su et al. 2021) with LLaMA-3.1 "llama3" and YaRN frequency scaling.

Layout: llama_jax uses the half-split ("rotate_half") layout of Hugging Face: feature i of a head
is paired with feature i + H/2 and both rotate by angle m·θ_i, θ_i = base^(-2i/H). Meta's
checkpoints pair adjacent features (2i, 2i+1) instead; the checkpoint converters permute the q/k
projection rows between the two layouts, so the model code has exactly one RoPE.

Precision: a plain fp32 angle m·θ_i is off by up to ulp(m)/2 — 0.004 rad at m = 131072, which is
what fp32 implementations get at long context. Here the frequencies are split on the host
(float64) into chunks of 6 bits each, so that m·chunk is exact in fp32 for m < 2^18 and its
fractional number of turns can be taken without rounding; the remainder term is tiny. The
resulting angle, reduced to [-π, π], is accurate to ~1e-7 rad at any position below 2^18.

RoPE rotates a head's `config.rope_dim` features — all of them, or with MLA the
decoupled qk_rope_head_dim part (nn/attention/mla.py) — so H below is that width.

YaRN (Peng et al. 2023; `rope_type: yarn`, as DeepSeek-V2/V3 and transformers compute it):
frequencies that turn more than beta_fast times over the original context keep their value,
those that turn fewer than beta_slow times are divided by `factor`, with a linear ramp over
the dimensions in between; cos and sin are multiplied by an attention temperature
(`rotation_scale`), and the softmax scale by mscale(mscale_all_dim)² (`softmax_scale`), where
mscale(m) = 0.1·m·ln(factor) + 1. DeepSeek sets mscale = mscale_all_dim, so that all of the
temperature goes into the softmax scale, of every feature of the head.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.parallel import target

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig, RopeScaling


_CHUNK_BITS = 6
_N_CHUNKS = 4  # 4 exact chunks + remainder: remainder < 2^-24 turns per position


def base_frequencies(config: ModelConfig) -> np.ndarray:
    """θ_i = base^(-2i/H) for i < H/2, in float64."""
    H = config.rope_dim
    return config.rope_theta ** -(np.arange(0, H, 2, dtype=np.float64) / H)


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """θ_i (`base_frequencies`) rescaled for rope_type "llama3" or "yarn"."""
    inv_freq = base_frequencies(config)
    if config.rope_type == "llama3":
        inv_freq = llama3_scaled(inv_freq, config.rope_scaling)
    if config.rope_type == "yarn":
        inv_freq = yarn_scaled(inv_freq, config.rope_scaling, config.rope_theta)
    return inv_freq


def frequency_divisors(config: ModelConfig) -> np.ndarray:
    """What rope scaling divides each θ_i by (1 where it keeps it): the per-frequency factors
    llama.cpp stores as a `rope_freqs` tensor."""
    return base_frequencies(config) / inverse_frequencies(config)


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


def yarn_scaled(inv_freq: np.ndarray, scaling: RopeScaling, base: float) -> np.ndarray:
    """YaRN's "NTK-by-parts" frequencies: θ_i kept for i below the dimension where θ turns
    beta_fast times over the original context, θ_i / factor above the one where it turns
    beta_slow times (both rounded outwards), linear in i between."""
    H = 2 * len(inv_freq)
    context = scaling.original_max_position_embeddings

    def dimension(turns: float) -> float:  # where θ_i turns `turns` times over the context
        return H * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dimension(scaling.beta_fast)), 0)
    high = min(math.ceil(dimension(scaling.beta_slow)), H - 1)
    ramp = np.clip((np.arange(H // 2) - low) / ((high - low) or 0.001), 0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rotation_scale(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature, mscale(mscale) /
    mscale(mscale_all_dim) when both are non-zero (1 for DeepSeek), else mscale(1), as
    transformers computes it; 1 without YaRN."""
    s = config.rope_scaling
    if config.rope_type != "yarn":
        return 1.0
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def softmax_scale(config: ModelConfig) -> float:
    """The attention logits' scale: 1/√H of the query-key head dim (MLA's qk_nope +
    qk_rope), times mscale(mscale_all_dim)² under YaRN when mscale_all_dim is non-zero. An
    attention concern that lives here because only the RoPE scaling changes it."""
    scale = config.head_dim ** -0.5
    if config.rope_type == "yarn" and config.rope_scaling.mscale_all_dim:
        s = config.rope_scaling
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


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
    """cos and sin of the rotation angles, fp32 `[B, T, H/2]`, for integer positions (times
    YaRN's `rotation_scale`)."""
    cos_BTh, sin_BTh = cos_sin(inverse_frequencies(config), positions_BT)
    scale = rotation_scale(config)
    return (cos_BTh, sin_BTh) if scale == 1.0 else (cos_BTh * scale, sin_BTh * scale)


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


# Remat name of RoPE's outputs (`Rotation.apply`): the policies that save the projections keep
# the rotated queries and keys in their place, so that the backward pass does not rotate again
ROTATED_NAME = "rotated"


@jax.custom_vjp
def apply_rope(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
    """Rotates each (i, i + H/2) feature pair of every head; math in fp32, result in x's dtype.
    Its backward pass is the rotation back (by -angle) of the cotangent, the same fused
    elementwise pass as the forward one (autodiff's transpose of it writes fp32 halves, and
    XLA:TPU prices it at twice the forward). No gradient reaches the angles."""
    return _rotated(x_BTNH, cos_BTh, sin_BTh)


def _rotated(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
    """`x·cos + partner·(∓sin)`, each feature's partner being the other of its pair."""
    cos_BT1H = jnp.concatenate([cos_BTh, cos_BTh], axis=-1)[:, :, None, :]
    sin_BT1H = jnp.concatenate([-sin_BTh, sin_BTh], axis=-1)[:, :, None, :]
    partner_BTNH = swapped_halves(x_BTNH, by_matmul=target.platform() == "tpu")
    rotated = x_BTNH.astype(jnp.float32) * cos_BT1H + partner_BTNH * sin_BT1H
    return rotated.astype(x_BTNH.dtype)


def swapped_halves(x_BTNH: jax.Array, by_matmul: bool) -> jax.Array:
    """fp32 `[x[..., H/2:], x[..., :H/2]]`: sliced, or `by_matmul` with the permutation matrix
    (exact: one product by 1 per output, accumulated in fp32). On TPUs the matmul keeps the
    rotation one fusion, where XLA:TPU splits the halves into fusions and arrays of their own
    and has the projection before it write fp32: LLaMA-3 8B at 8K tokens a chip, 41 ms a
    step on XLA:TPU's clock, for 2·H FLOPs a feature on the matrix units."""
    H = x_BTNH.shape[-1]
    if not by_matmul:
        x = x_BTNH.astype(jnp.float32)
        return jnp.concatenate([x[..., H // 2:], x[..., :H // 2]], axis=-1)
    swap_HH = np.roll(np.eye(H, dtype=np.float32), H // 2, axis=1)
    return jnp.matmul(x_BTNH, jnp.asarray(swap_HH, x_BTNH.dtype),
                      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


apply_rope.defvjp(lambda x, cos, sin: (_rotated(x, cos, sin), (cos, sin)),
                  lambda angles, ct: (_rotated(ct, angles[0], -angles[1]), None, None))
