"""What every decoder shares before its rows (rows.py): the model's step over each row's last
token (`next_logits`: `rows.step`'s, and a draft model's), prompt checks, and the stop-id
table.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import jax

from llama_jax.config import ModelConfig
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


def next_logits(config: ModelConfig, params: Params, last_B: jax.Array, cache: KVCache
                ) -> tuple[jax.Array, KVCache]:
    """The step every decoder takes (`rows.step`, speculation's draft): the model over each
    row's last token against its cache, and the LM head's logits [B, V] for the next
    token."""
    h_B1D, cache, _ = apply(config, params, last_B[:, None], cache=cache)
    return lm_head(config, params, h_B1D)[:, 0], cache
