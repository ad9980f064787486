"""The decode loop's state and one step of it: what `generate` carries through its
`lax.while_loop` (`DecodeState`), the step (`decode_step`: the model over each row's last token,
`next_logits`, then the next token drawn and recorded, `emit`). The server's slots
(slots.py) and speculative decoding (speculate.py) take the same `next_logits` step.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from llama_jax.config import ModelConfig
from llama_jax.decode.sampling import SamplingParams, Strategy, sample
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import KVCache
from llama_jax.model.params import Params
from llama_jax.model.transformer import apply
from llama_jax.nn.heads import lm_head

NO_TOKEN = -1  # an empty slot in the output buffer and the padding of the stop-id table


def check_prompt(prompt, vocab_size: int, name: str = "the prompt") -> None:
    """Raises GenerateError when a prompt cannot be decoded from: empty, or holding ids
    outside the vocabulary (`name` says which prompt)."""
    if len(prompt) == 0:
        raise GenerateError(f"{name} is empty: it needs at least one token (e.g. BOS)")
    bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
    if bad:
        raise GenerateError(f"{name} has token id(s) {bad[:5]} outside the vocabulary "
                            f"[0, {vocab_size})")


def stop_table(config: ModelConfig, stop_ids: Sequence[int] | None) -> list[int]:
    """A decoder's stop ids: `stop_ids`, or None for the model's (`config.stop_ids`), less
    those the model cannot emit (a tokenizer's special ids past a small model's vocabulary),
    ignored with a warning as `ModelConfig` ignores such EOS ids; [NO_TOKEN] when none is
    left (nothing stops a row early)."""
    if stop_ids is None:
        return list(config.stop_ids) or [NO_TOKEN]
    outside = [int(t) for t in stop_ids if not 0 <= int(t) < config.vocab_size]
    if outside:
        warnings.warn(f"stop ids {outside} are outside the vocabulary [0, {config.vocab_size})"
                      ": ignored", stacklevel=3)
    return [int(t) for t in stop_ids if 0 <= int(t) < config.vocab_size] or [NO_TOKEN]


@struct.dataclass
class DecodeState:
    cache: KVCache
    tokens_BN: jax.Array  # [B, N] int32 generated tokens, NO_TOKEN after a row stopped
    logprobs_BN: jax.Array  # [B, N] float32
    last_B: jax.Array  # [B] int32: the token to feed next
    done_B: jax.Array  # [B] bool
    step: jax.Array  # [] int32: tokens generated so far
    max_new: jax.Array  # [] int32
    stop_BS: jax.Array  # [B, n_stop] int32, NO_TOKEN-padded
    sampling: SamplingParams
    key: jax.Array


def emit(state: DecodeState, logits_BV: jax.Array, strategy: Strategy) -> DecodeState:
    """Samples the token of step `state.step` for every row, records it and updates `done`."""
    token_B = sample(logits_BV, jax.random.fold_in(state.key, state.step), state.sampling, strategy)
    logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV), token_B[:, None], -1)[:, 0]
    active_B = ~state.done_B
    column = (0, state.step)
    tokens_BN = jax.lax.dynamic_update_slice(
        state.tokens_BN, jnp.where(active_B, token_B, NO_TOKEN)[:, None], column)
    logprobs_BN = jax.lax.dynamic_update_slice(
        state.logprobs_BN, jnp.where(active_B, logprob_B, 0.0)[:, None], column)
    stopped_B = jnp.any(token_B[:, None] == state.stop_BS, axis=-1)
    done_B = state.done_B | stopped_B | (state.step + 1 >= state.max_new)
    return state.replace(tokens_BN=tokens_BN, logprobs_BN=logprobs_BN, last_B=token_B,
                         done_B=done_B, step=state.step + 1)


def decode_step(config: ModelConfig, params: Params, state: DecodeState,
                strategy: Strategy) -> DecodeState:
    """One token for every row: the model over each row's last token against its cache, the
    LM head, and the next token drawn and recorded."""
    logits_BV, cache = next_logits(config, params, state.last_B, state.cache)
    return emit(state.replace(cache=cache), logits_BV, strategy)


def next_logits(config: ModelConfig, params: Params, last_B: jax.Array, cache: KVCache
                ) -> tuple[jax.Array, KVCache]:
    """The step every decoder takes (this loop, the server's slots, speculation's draft):
    the model over each row's last token against its cache, and the LM head's logits
    [B, V] for the next token."""
    h_B1D, cache, _ = apply(config, params, last_B[:, None], cache=cache)
    return lm_head(config, params, h_B1D)[:, 0], cache
