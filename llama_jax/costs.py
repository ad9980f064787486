"""Model accounting without allocating a model: parameters, bytes, FLOPs, decode floors.

Shapes come from `jax.eval_shape(init_params)`, so the counts are those of the real
initialiser, not of a parallel formula that could drift from it.

FLOPs (DESIGN.md §5): training FLOPs per token = 6·P_mm + 6·L·T·N·H, where P_mm counts every
weight used in a matmul (all but the input-embedding table and the norm gains; the LM head counts
even when tied) and 6·L·T·N·H is causal attention (half of PaLM's non-causal 12·L·T·D; N·H = D for
every LLaMA preset).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from llama_jax.config import ModelConfig
from llama_jax.params import Params, init_params

TRAIN_FLOPS_FORMULA = "6*P_mm + 6*L*T*N*H (P_mm: matmul weights incl. LM head; causal attention)"
DECODE_BYTES_FORMULA = ("weights read per step (all but the input-embedding table, which is "
                        "gathered, unless tied) + KV cache read for B x S tokens")


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # the input token-embedding table, V·D
    lm_head: int  # the untied LM head, D·V; 0 when tied to the embedding
    norms: int  # RMSNorm gains
    head_matmul: int  # V·D: the LM head's matmul, tied or not

    @property
    def non_embedding(self) -> int:
        """Everything but the embedding table and an untied LM head."""
        return self.total - self.embedding - self.lm_head

    @property
    def matmul(self) -> int:
        """P_mm: weights that enter a matmul (a tied LM head reuses the embedding as one)."""
        return self.total - self.embedding - self.lm_head - self.norms + self.head_matmul


def abstract_params(config: ModelConfig) -> Params:
    """`jax.ShapeDtypeStruct`s of the parameters, traced from `init_params`."""
    return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


@functools.lru_cache(maxsize=64)  # the planner asks several times per config; tracing is not free
def param_counts(config: ModelConfig) -> ParamCounts:
    abstract = abstract_params(config)
    size = lambda x: math.prod(x.shape)  # noqa: E731
    norms = size(abstract.final_norm) + size(abstract.layers.attn_norm) + size(
        abstract.layers.ffn_norm)
    return ParamCounts(
        total=sum(size(x) for x in jax.tree.leaves(abstract)),
        embedding=size(abstract.embed),
        lm_head=0 if abstract.lm_head is None else size(abstract.lm_head),
        norms=norms,
        head_matmul=config.vocab_size * config.dim,
    )


def dtype_bytes(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


def kv_cache_bytes_per_token(config: ModelConfig, dtype: str = "bfloat16") -> int:
    """2 (K and V) · L · K · H · bytes: the cache holds KV heads only, never repeated ones."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype_bytes(dtype)


def train_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    attention = 6 * config.n_layers * seq_len * config.n_heads * config.head_dim
    return 6 * param_counts(config).matmul + attention


def decode_bytes_per_step(config: ModelConfig, batch: int, context: int,
                          dtype: str = "bfloat16") -> int:
    """Bytes one decode step must read: weights (the untied input embedding is only gathered,
    B rows) plus the KV cache of every row at `context` tokens."""
    counts = param_counts(config)
    gathered = 0 if config.tie_embeddings else counts.embedding - batch * config.dim
    weights = (counts.total - gathered) * dtype_bytes(dtype)
    return weights + batch * context * kv_cache_bytes_per_token(config, dtype)
