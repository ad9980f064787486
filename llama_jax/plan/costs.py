"""Model accounting without allocating a model: parameters, bytes, FLOPs, decode floors.

Every count comes from the parameter descriptions (`params.param_specs`), the same ones
`init_params` builds arrays from, so a new component is counted without touching this module.

FLOPs: training FLOPs per token = 6·P_mm + 3·L·T·N·(H + Hv), where P_mm counts every weight used in
a matmul — the blocks' projection matrices (their decayed tensors; gains and biases are not
matrices) and the LM head, which counts even when tied — but not the gathered input-embedding or
position tables; 3·L·T·N·(H + Hv) is causal attention, scores over query/key head dims H and the
weighted sum over value head dims Hv (6·L·T·N·H when they are equal: half of PaLM's non-causal
12·L·T·D; N·H = D for every LLaMA preset); a mixer of another kind brings its own term (three
times its `context_flops`). MLA's up-projections of the latents are weights in P_mm
(its training runs the expanded form). With MoE, P_mm counts *active* weights: each routed expert
matrix times top_k/E (a token runs top_k of the E experts; `TensorSpec.used`), the router and shared
experts whole. Capacity padding and dropped tokens are not counted (model FLOPs).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp

from llama_jax import quant
from llama_jax.config import ModelConfig, RunConfig
from llama_jax.nn.heads import head_matmul_size
from llama_jax.nn.attention import kv_storage
from llama_jax.nn.attention.mixers import mixer_of
from llama_jax.spec import TensorSpec, count, spec_leaves
from llama_jax.model.params import abstract_params, param_specs
from llama_jax.nn.lora import adapter_specs

TRAIN_FLOPS_FORMULA = ("6*P_mm + 3*L*T*N*(H+Hv) (P_mm: active matmul weights incl. LM head; "
                       "causal attention)")
DECODE_BYTES_FORMULA = ("weights read per step (all but the input-embedding table, which is "
                        "gathered, unless tied; of MoE experts, those B tokens are expected to "
                        "hit) + KV cache read for B x S tokens")


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # the input token-embedding table, V·D
    lm_head: int  # the untied LM head, D·V; 0 when tied to the embedding
    matmul: int  # P_mm: active block matrices + the head's (the LM head's V·D even when tied)
    active: int  # what one token uses: total less the routed experts it skips (= total dense)

    @property
    def non_embedding(self) -> int:
        """Everything but the embedding table and an untied LM head."""
        return self.total - self.embedding - self.lm_head


@functools.lru_cache(maxsize=64)  # the planner asks several times per config
def param_counts(config: ModelConfig) -> ParamCounts:
    specs = param_specs(config)
    block_matrices = sum(_active(s) for s in spec_leaves(specs["groups"]) if s.decay)
    return ParamCounts(
        total=count(specs),
        embedding=count(specs["embed"]),
        lm_head=count(specs.get("lm_head", {})),
        matmul=block_matrices + head_matmul_size(config),
        active=sum(_active(s) for s in spec_leaves(specs)),
    )


def _active(spec: TensorSpec) -> int:
    """The elements of a tensor one token's forward pass uses."""
    return round(spec.size * spec.used)


def dtype_bytes(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


def kv_cache_bytes_per_token(config: ModelConfig, dtype: str = "bfloat16") -> int:
    """GQA: 2 (K and V) · L · K · H · bytes: the cache holds KV heads only, never repeated
    ones. MLA: L · (kv_lora_rank + qk_rope_head_dim) · bytes, the latent and the shared RoPE
    key. An int8 cache (`dtype="int8"`) stores a byte per value plus a float32 scale per
    vector (per token and KV head, twice for K and V; per token's latent)."""
    vectors, width = mixer_of(config).cache_vectors(config)
    return config.n_layers * vectors * kv_storage.bytes_per_vector(width, dtype)


# The server's default --steps-per-dispatch: on the 2-core CPU, 4 served mixed-length
# requests 4.5% faster than 8 (a row that finishes waits out the rest of its dispatch and the
# next one: BENCHMARKS.md, serving).
SERVING_STEPS_PER_DISPATCH = 4
# Prompt tokens a server prefills per chunk (and per prefix cache block), by default.
SERVING_PREFILL_CHUNK = 128
# The positions of a page of a server's KV cache, by default (vLLM's block size).
SERVING_PAGE_SIZE = 16
# A server's prefix cache by default: this share of the memory free after the weights and
# the rows' cache, and at most this multiple of the rows' cache.
PREFIX_CACHE_SHARE = 0.5
PREFIX_CACHE_ROWS_MULTIPLE = 4


def prefix_cache_blocks(cache_bytes: int, block_bytes: int, chunk: int, max_seq_len: int) -> int:
    """The whole blocks of one prefill chunk that `cache_bytes` hold: none where every prompt
    is one chunk or less (a full chunk always holds the prompt's last token, never cached)."""
    return cache_bytes // block_bytes if chunk < max_seq_len else 0


def default_prefix_cache_bytes(free_after: int | None, rows_cache: int) -> int:
    """The prefix cache a server keeps when not told (bytes per device), given the memory
    free after its weights and rows (None: unknown) and the rows' cache."""
    most = PREFIX_CACHE_ROWS_MULTIPLE * rows_cache
    return most if free_after is None else max(0, min(most, int(free_after * PREFIX_CACHE_SHARE)))


def serving_cache_len(max_seq_len: int, speculative_tokens: int | None = None) -> int:
    """The cache positions a server's row holds at its largest: `max_seq_len` (a row that
    stopped stays at its end); speculating with k `speculative_tokens`, k more (a row's last
    verify pass writes them past its end)."""
    return max_seq_len + (speculative_tokens or 0)


def train_flops_per_token(config: ModelConfig, seq_len: int, frozen_backbone: bool = False,
                          adapters: int = 0) -> int:
    """6·P_mm + attention (module docstring). With a frozen backbone (a task head trained
    alone) only the head has a backward pass: 2·P_mm + 4·(the head's matmul weights) + the
    attention's forward third. With LoRA `adapters` (their element count, P_lora) on a frozen
    base, the base's backward computes input gradients only: 4·P_mm + attention + 6·P_lora."""
    attention = 3 * config.n_layers * mixer_of(config).context_flops(config, seq_len)
    if frozen_backbone:
        return 2 * param_counts(config).matmul + 4 * head_matmul_size(config) + attention // 3
    if adapters:
        return 4 * param_counts(config).matmul + attention + 6 * adapters
    return 6 * param_counts(config).matmul + attention


def run_adapter_specs(run: RunConfig) -> dict:
    """A LoRA run's adapters' TensorSpecs (`lora.adapter_specs` of its model and section)."""
    return adapter_specs(abstract_params(run.model), param_specs(run.model), run.lora.targets,
                         run.lora.rank)


def train_flops_per_step(run: RunConfig) -> float:
    """A run's model FLOPs per optimizer step, all devices together (`train_flops_per_token`
    over its batch; a frozen backbone's forward only; a LoRA run's base without weight
    gradients)."""
    adapters = 0 if run.lora is None else count(run_adapter_specs(run))
    return run.train.batch_size * run.train.seq_len * train_flops_per_token(
        run.model, run.train.seq_len, frozen_backbone=run.train.freeze == "backbone",
        adapters=adapters)


def decode_bytes_per_step(config: ModelConfig, batch: int, context: int,
                          dtype: str = "bfloat16", cache_dtype: str | None = None) -> int:
    """Bytes one decode step must read: weights as stored (`dtype`, or int8 values and their
    scales where the config quantizes them; the untied input embedding and a learned position
    table are only gathered, B rows each; of a routed expert tensor, the experts B tokens are
    expected to hit when each picks top_k of E uniformly: a fraction 1 - (1 - top_k/E)^B)
    plus the KV cache (`cache_dtype`, default `dtype`) of every row at `context` tokens."""
    specs = param_specs(config)
    gathered = [] if config.tie_embeddings else spec_leaves(specs["embed"])
    gathered += spec_leaves(specs.get("positions", {}))
    weights = sum(stored_bytes(s, dtype) * min(batch, s.shape[0]) / s.shape[0] for s in gathered)
    weights += sum(stored_bytes(s, dtype) * (1 - (1 - s.used) ** batch)
                   for s in spec_leaves(specs) if not any(s is g for g in gathered))
    kv = batch * context * kv_cache_bytes_per_token(config, cache_dtype or dtype)
    return round(weights) + kv


def weight_bytes(config: ModelConfig, dtype: str) -> int:
    """The parameters' bytes as stored: `dtype`, or int8 and scales where `config` quantizes."""
    return sum(stored_bytes(s, dtype) for s in spec_leaves(param_specs(config)))


def stored_bytes(spec: TensorSpec, dtype: str) -> int:
    """A tensor's bytes as stored: `dtype` values, or (an int8 weight) a byte per value plus
    its float32 scales."""
    if spec.dtype == "int8":
        return spec.size + quant.SCALE_BYTES * math.prod(spec.scale_shape)
    return spec.size * dtype_bytes(dtype)


def format_bytes(n: float) -> str:
    """A byte count for people: B, KiB, MiB, GiB or TiB, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
