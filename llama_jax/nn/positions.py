"""Position information, selected by `config.positions`.

- rope (Su et al. 2021; LLaMA): q and k are rotated inside attention (`rotation` gives the
  angles; see rope.py); nothing is added to the embedding.
- sinusoidal (Vaswani et al. 2017): `PE[p, 2i] = sin(p / 10000^(2i/D))`, `PE[p, 2i+1] =
  cos(p / 10000^(2i/D))`, added to the token embedding; no parameters.
- learned (GPT-2): a `[max_seq_len, D]` table, added to the token embedding.
- none (NoPE): causal attention alone carries order (Haviv et al. 2022).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from llama_jax.config import ModelConfig
from llama_jax.nn.rope import apply_rope, cos_sin, rope_cos_sin
from llama_jax.nn.spec import weight

SINUSOID_BASE = 10000.0


def position_specs(config: ModelConfig) -> dict:
    if config.positions == "learned":
        return {"table": weight(config.dims, "PD", ("positions", "embed"))}
    return {}


def add_positions(config: ModelConfig, p: dict, x_BTD: jax.Array,
                  positions_BT: jax.Array) -> jax.Array:
    """The token embedding plus its absolute position embedding (unchanged for rope / none)."""
    if config.positions == "sinusoidal":
        return x_BTD + sinusoids(config.dim, positions_BT).astype(x_BTD.dtype)
    if config.positions == "learned":
        return x_BTD + jnp.take(p["table"], positions_BT, axis=0).astype(x_BTD.dtype)
    return x_BTD


def sinusoids(dim: int, positions_BT: jax.Array) -> jax.Array:
    """fp32 `[B, T, D]`: sin at even features, cos at odd ones, frequency 10000^(-2i/D)."""
    inv_freq = SINUSOID_BASE ** -(np.arange(0, dim, 2, dtype=np.float64) / dim)
    cos_BTh, sin_BTh = cos_sin(inv_freq, positions_BT)
    return jnp.stack([sin_BTh, cos_BTh], axis=-1).reshape(*positions_BT.shape, -1)[..., :dim]


@struct.dataclass
class Rotation:
    """RoPE angles of the queries' (and new keys') positions, fp32 `[B, T, H/2]`."""

    cos_BTh: jax.Array
    sin_BTh: jax.Array

    def apply(self, x_BTNH: jax.Array) -> jax.Array:
        return apply_rope(x_BTNH, self.cos_BTh, self.sin_BTh)


def rotation(config: ModelConfig, positions_BT: jax.Array) -> Rotation | None:
    """RoPE's rotation for these positions, or None when positions are not rotary."""
    if config.positions != "rope":
        return None
    return Rotation(*rope_cos_sin(config, positions_BT))
