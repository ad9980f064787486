"""The attention mixers a block can use, by `config.attention`: importing this module imports
the built-in ones, which register themselves in `MIXERS` (context.py). Each describes its
parameters, computes the block's attention (training, prefill and decode alike), lays out its
KV cache (stacked for a scanned layer group or per layer for the unrolled decoder), tells the
memory planner what it keeps for the backward pass, and checks the config fields it
constrains.

- gqa: multi-head attention with n_kv_heads key/value heads (MHA, GQA, MQA): gqa.py.
- mla: Multi-head Latent Attention, a latent KV cache: mla.py.

A new mixer is one module of the same shape (its hooks, then `MIXERS.register(name,
Mixer(...))`), imported here, or registered from your own code before building a config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_jax.nn.attention import gqa, mla  # noqa: F401 (they register themselves)
from llama_jax.nn.attention.context import MIXERS, Mixer

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig

__all__ = ["MIXERS", "Mixer", "mixer_of"]


def mixer_of(config: ModelConfig) -> Mixer:
    return MIXERS[config.attention]
