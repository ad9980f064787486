"""Position information, registered in `POSITIONS` and chosen by `config.positions`.

- rope (Su et al. 2021; LLaMA): q and k are rotated inside attention (`rotation` gives the
  angles; see rope.py); nothing is added to the embedding.
- sinusoidal (Vaswani et al. 2017): `PE[p, 2i] = sin(p / 10000^(2i/D))`, `PE[p, 2i+1] =
  cos(p / 10000^(2i/D))`, added to the token embedding; no parameters.
- learned (GPT-2): a `[max_seq_len, D]` table, added to the token embedding.
- none (NoPE): causal attention alone carries order (Haviv et al. 2022).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from llama_jax.nn.registry import Registry
from llama_jax.nn.rope import ROTATED_NAME, apply_rope, cos_sin, rope_cos_sin
from llama_jax.spec import weight

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig

SINUSOID_BASE = 10000.0


@dataclasses.dataclass(frozen=True)
class Positions:
    """A position encoding: its tensors (`specs(config)`, the tree's "positions" entry; a
    table is only gathered, so the planner reads B rows of it per decode step), what it adds
    to the token embeddings (`add(config, p, x_BTD, positions_BT)`), and whether attention
    rotates queries and keys instead (`rotary`: the RoPE fields of the config apply)."""

    specs: Callable[[ModelConfig], dict]
    add: Callable[[ModelConfig, dict, jax.Array, jax.Array], jax.Array]
    rotary: bool = False


POSITIONS: Registry[Positions] = Registry("positions")


def position_specs(config: ModelConfig) -> dict:
    return POSITIONS[config.positions].specs(config)


def add_positions(config: ModelConfig, p: dict, x_BTD: jax.Array,
                  positions_BT: jax.Array) -> jax.Array:
    """The token embedding plus its absolute position embedding (unchanged for rope / none)."""
    return POSITIONS[config.positions].add(config, p, x_BTD, positions_BT)


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
        return checkpoint_name(apply_rope(x_BTNH, self.cos_BTh, self.sin_BTh), ROTATED_NAME)


def rotation(config: ModelConfig, positions_BT: jax.Array) -> Rotation | None:
    """RoPE's rotation for these positions, or None when positions are not rotary."""
    if not POSITIONS[config.positions].rotary:
        return None
    return Rotation(*rope_cos_sin(config, positions_BT))


def _no_tensors(config: ModelConfig) -> dict:
    return {}


def _nothing_added(config: ModelConfig, p: dict, x_BTD: jax.Array,
                   positions_BT: jax.Array) -> jax.Array:
    return x_BTD


POSITIONS.register("rope", Positions(_no_tensors, _nothing_added, rotary=True))
POSITIONS.register("sinusoidal", Positions(
    _no_tensors,
    lambda config, p, x_BTD, positions_BT: x_BTD + sinusoids(
        config.dim, positions_BT).astype(x_BTD.dtype)))
POSITIONS.register("learned", Positions(
    lambda config: {"table": weight(config.dims, "PD", ("positions", "embed"))},
    lambda config, p, x_BTD, positions_BT: x_BTD + jnp.take(
        p["table"], positions_BT, axis=0).astype(x_BTD.dtype)))
POSITIONS.register("none", Positions(_no_tensors, _nothing_added))
