"""Per-device memory and step time of a training run on a mesh, without allocating anything.

State (from the parameter descriptions and the weight rules, so it is exactly what `trainer`
creates): parameters in `param_dtype`, gradients like them, AdamW's two moments like them too
(the first in `mu_dtype` when given: `train.mu_dtype`).

Activations saved for the backward pass, per layer and per token held by the device, in
`compute_dtype` bytes b (fp32 where the code computes in fp32), under each remat policy:
- none: block input, both norm outputs, q, k, v, attention output, residual, gate, up and
  their product: b·(4D + 2·N·H + 2·K·H + 3F) (an MoE MLP: see `_mlp_memory`; the attention
  projections are the mixer's `saved_activations`, nn/attention/), plus
  attention's own: the dense (`xla`) path
  keeps the fp32 softmax probabilities and scores for all T keys, 2·4·N·T; the blockwise ones
  (chunked, cuDNN, splash) their output again and one fp32 log-sum-exp per head,
  b·N·Hv + 4·N; a plain MLP keeps 2F (up, activation);
- dots: the outputs of every matmul (q, k, v, attention output, o, gate, up, down):
  b·(2·N·H + 2·K·H + 2D + 2F) (1F for a plain MLP), plus the dense path's fp32 scores, 4·N·T,
  or the blockwise paths' log-sum-exp, 4·N;
- dots_no_batch: the weight matmuls only (attention is recomputed): b·(N·H + 2·K·H + 2D + 2F);
- full: the block input only, b·D (the block is recomputed), over the tensor axis where the
  rules split the residual stream's sequence (`residual_seq`: sequence parallelism);
- attention: the block input and attention's q, k, v and output, b·(D + N·H + 2·K·H + N·Hv),
  plus the blockwise paths' fp32 log-sum-exp, 4·N (the dense path recomputes its scores);
- dots_with_attention: dots_no_batch's matmul outputs and attention's output and log-sum-exp.
cuDNN with packed documents (as training is) also keeps its `[T, S]` document mask as a b-byte
bias per layer, b·T per token, except under the recomputing policies.
Heads and the FFN width are divided by the tensor axis when the activation rules shard them.
Kept besides: the embedded input, b·D per token (split as the block input); with the dropless
MoE dispatch on a mesh and no remat, each layer's experts, gathered in the compute dtype.
Working set on top, two parts: the loss's — the shifted logits kept in the compute dtype and the
logits' gradient, 2·b·V per token, one run's fp32 logits, 4·V per position of a run of
`nn.heads.LOSS_RUN`, and the head's weight in the compute dtype and its fp32 gradient,
(b + 4)·D·V, unsharded over fsdp (all over tensor when the vocabulary is sharded; under
`loss_chunk` C, for C positions of each row: the fp32 logits, their softmax and its gradient,
3·4·V, plus the head's fp32 gradient 4·D·V, which the pieces add to) — and the backward pass
of one layer: its activations (recomputed under remat), for the blockwise paths a few fp32 tiles
of scores (3·4·N·block_q·block_kv per row), the dropless path's gathered experts and their
gradient. XLA:TPU computed the logits' gradient inside the head's matmuls for LLaMA-3 8B at 8K
tokens a chip, but wrote it at 32K: the plan counts it. On TPUs (`LOGIT_BYTES`,
`SHARED_WORKING_SETS`) a chunk's softmax is fused into its gradient (2·4·V), the two parts share
memory (the larger counts), and the layer FSDP gathers (weights in the compute dtype, their fp32
gradient) counts with the layer's part; on CPUs the parts add, as XLA:CPU's buffers do. The
figures are estimates; `python -m llama_jax.plan.info` prints them, tests/test_memory.py
checks them against XLA's `compiled.memory_analysis()` on CPU, and bench/pods.py against
XLA:TPU's peak per chip for pod-scale runs (docs/scale-out.md).
"""

from __future__ import annotations

import dataclasses
import math

from llama_jax.plan import costs
from llama_jax.parallel import sharding
from llama_jax.config import MeshConfig, ModelConfig
from llama_jax.parallel.sharding import MESH_AXES
from llama_jax.nn.attention.dot_product import chosen_attention, one_block
from llama_jax.nn.attention.mixers import mixer_of
from llama_jax.nn.heads import LOSS_RUN
from llama_jax.nn.mlp import MLPS
from llama_jax.nn.moe import dispatch_of
from llama_jax.spec import count, spec_leaves
from llama_jax.model.params import layer_groups, param_specs


# Bytes per logit (token x vocabulary entry) a `loss_chunk` piece holds at once: the fp32
# logits, their softmax and its gradient, as XLA:CPU keeps them; XLA:TPU fuses the softmax into
# the gradient (8 fitted over the LLaMA-3 8B and 70B steps compiled for v5p slices,
# docs/scale-out.md). GPUs are planned as CPUs until measured.
LOGIT_BYTES = {"cpu": 12, "gpu": 12, "tpu": 8}
# Where XLA's peak is planned from the working sets as they live: the loss's logits and the
# layers' backward pass share memory (the peak has the larger, not the sum), and the layer an
# FSDP step gathers counts with the latter (LLaMA-3.1 405B on a v5p slice: 0.95x of XLA:TPU's
# peak with it, 1.25x without). XLA:CPU's buffers (tests/test_memory.py) take the sum, with
# the gathered layer inside the other terms.
SHARED_WORKING_SETS = ("tpu",)
# Under tensor parallelism a matmul that contracts a split axis (W_O over the heads, W_down
# over the FFN width; in the backward pass the input projections' dX) writes its rows' whole
# width in fp32, partial sums to be reduced over tensor. A layer's backward pass on XLA:TPU
# holds this many such [tokens, D] fp32 buffers (LLaMA-3 70B and LLaMA-3.1 70B at 8K and 32K
# tokens over tensor=8, with and without sequence parallelism: 0.89-1.03x of XLA's peak with
# them, 1.13-1.32x without). XLA:CPU computes them in the compute dtype, within the terms.
TENSOR_PARTIAL_SUMS = {"tpu": 2}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    mesh: dict[str, int]
    weights: int  # bytes per device
    gradients: int
    optimizer: int
    activations: int
    kv_cache: int  # for decoding B rows of S tokens (not part of training)

    @property
    def training(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def _elements_per_device(specs, rules: tuple, shape: dict[str, int]) -> int:
    """Elements one device holds of the tensors `specs` describes, laid out by `rules`."""
    return sum(s.size // sharding.shard_ways(sharding.spec(s.axes, s.shape, rules, shape), shape)
               for s in spec_leaves(specs))


def _ways(rules: tuple, mesh_shape: dict[str, int], axis: str, size: int) -> int:
    """How many ways an activation dimension named `axis` of `size` is split."""
    return sharding.shard_ways(sharding.spec((axis,), (size,), rules, mesh_shape), mesh_shape)


def plan_memory(config: ModelConfig, mesh: MeshConfig, n_devices: int, *, batch: int,
                seq: int, remat: str, micro_batches: int = 1, kv_batch: int = 1,
                kv_seq: int | None = None, kv_dtype: str = "bfloat16",
                backend: str = "cpu", mu_dtype: str | None = None,
                adapters=None) -> MemoryPlan:
    """Per-device bytes of training `config` (attention as it would run on `backend`). With
    `adapters` (a LoRA run's TensorSpecs, nn/lora.py) only they train, in fp32: the model's
    weights are held frozen (int8 where quantized), without gradients or moments."""
    shape = dict(zip(MESH_AXES, mesh.shape_for(n_devices)))
    param_bytes = costs.dtype_bytes(config.param_dtype)
    specs = param_specs(config)
    state_elems = _elements_per_device(specs, mesh.weight_rules, shape)
    frozen = 0
    if adapters is not None:
        frozen = sum(costs.stored_bytes(s, config.param_dtype)
                     // sharding.shard_ways(sharding.spec(s.axes, s.shape, mesh.weight_rules,
                                                          shape), shape)
                     for s in spec_leaves(specs))
        state_elems, param_bytes = _elements_per_device(adapters, mesh.weight_rules, shape), 4
    rules = mesh.activation_rules
    rows = batch // micro_batches // _ways(rules, shape, "batch", batch // micro_batches)
    tokens = rows * seq
    b = costs.dtype_bytes(config.compute_dtype)
    D, V, T = config.D, config.V, seq
    heads = config.N // _ways(rules, shape, "heads", config.N)
    attn = _attention_memory(config, backend, T, b, heads)
    mixer = mixer_of(config).saved_activations(config, heads,
                                                config.K // _ways(rules, shape, "kv_heads", config.K))
    # The residual stream between blocks (each block's input; `residual_seq`), split over the
    # sequence when the rules say so (sequence parallelism): what full remat keeps, and every
    # policy keeps beside what it saves inside the block.
    residual = b * D // _ways(rules, shape, "residual_seq", seq)
    split = heads < config.N or _ways(rules, shape, "mlp", config.F) > 1
    partial_sums = 4 * D * TENSOR_PARTIAL_SUMS.get(backend, 0) if split else 0
    per_token = whole_layer = gathered_kept = gathered_working = gathered_layer = 0
    for group, group_specs in zip(layer_groups(config), specs["groups"]):
        mlp = _mlp_memory(config, group.moe, b, lambda width: width // _ways(
            rules, shape, "mlp", width), exchanged=shape["expert"] > 1)
        if group.moe and dispatch_of(config, drop=True) == "dropless" and \
                math.prod(shape.values()) > 1:
            # Each device runs its rows' grouped matmuls on every expert's weights of a layer,
            # gathered in the compute dtype (XLA casts before it gathers), and their gradient
            # before it is reduce-scattered; without remat every layer's gathered weights are
            # kept for the backward pass, with any policy they are gathered again there.
            layer_experts = b * count(group_specs["mlp"]["experts"]) // group.n_layers
            gathered_kept += layer_experts * (group.n_layers if remat == "none" else 0)
            gathered_working = max(gathered_working, 2 * layer_experts)
        layer = {
            "none": residual + b * (3 * D + mixer["none"]) + mlp["none"] + attn.saved,
            "dots": residual + b * (D + mixer["dots"]) + mlp["dots"] + attn.saved_by_dots,
            "dots_no_batch": residual + b * (D + mixer["dots_no_batch"])
            + mlp["dots_no_batch"],
            "full": residual,
            "attention": residual + b * mixer["attention"] + attn.residuals,
            "dots_with_attention": residual + b * (D + mixer["dots_with_attention"])
            + mlp["dots_no_batch"] + attn.residuals,
        }
        per_token += group.n_layers * layer[remat]
        # a layer's backward pass works on its input gathered whole
        whole_layer = max(whole_layer, layer["none"] - residual + b * D + partial_sums)
        # FSDP gathers the layer being computed: its weights in the compute dtype and, in the
        # backward pass, their fp32 gradient before it is reduce-scattered (the experts of the
        # dropless path are counted above).
        dense_part = {k: v for k, v in group_specs.items() if k != "mlp"} | {
            "mlp": {k: v for k, v in group_specs["mlp"].items() if k != "experts"}}
        gathered_layer = max(gathered_layer, (b + 4) * _elements_per_device(
            dense_part, mesh.weight_rules, shape | {"fsdp": 1}) // group.n_layers)
    # Working set on top of what is kept: the loss's logits (live while the head's backward
    # runs) and the backward of one layer (its activations, recomputed under remat;
    # attention's tiles; gathered experts): the larger of the two where XLA's buffers for one
    # are reused for the other (SHARED_WORKING_SETS), else both.
    vocab_ways = _ways(rules, shape, "vocab", V)
    if config.loss_chunk is not None and config.loss_chunk < seq:
        logits = rows * config.loss_chunk * LOGIT_BYTES.get(backend, LOGIT_BYTES["cpu"]) * V
        logits += 4 * D * V  # the head's gradient, summed over the pieces
    else:  # the shifted logits kept and the logits' gradient, one run's fp32 logits; the head's
        # weight in the compute dtype and its fp32 gradient, whole over fsdp
        logits = rows * (seq * 2 * b + min(seq, LOSS_RUN) * 4) * V + (b + 4) * D * V
    logits //= vocab_ways
    layer_backward = tokens * whole_layer + rows * attn.tiles + gathered_working + (
        gathered_layer if shape["fsdp"] > 1 and backend in SHARED_WORKING_SETS else 0)
    kv_seq = seq if kv_seq is None else kv_seq
    kv = kv_cache_bytes_per_device(config, kv_batch, kv_seq, kv_dtype, mesh.cache_rules, shape)
    return MemoryPlan(mesh=shape, weights=frozen + state_elems * param_bytes,
                      gradients=state_elems * param_bytes,
                      optimizer=(costs.dtype_bytes(mu_dtype or config.param_dtype)
                                 + param_bytes) * state_elems,
                      activations=tokens * (per_token + residual) + gathered_kept
                      + (max if backend in SHARED_WORKING_SETS else sum)(
                          (logits, layer_backward)),
                      kv_cache=kv)


def kv_cache_bytes_per_device(config: ModelConfig, batch: int, seq: int, dtype: str,
                              cache_rules: tuple, mesh_shape: dict[str, int]) -> int:
    """Bytes one device holds of a KV cache of `batch` rows of `seq` tokens laid out by
    `cache_rules` on a mesh of `mesh_shape` (every mesh axis named, 1 where unused; rows and
    heads split only where the mesh axes divide them)."""
    return (costs.kv_cache_bytes_per_token(config, dtype) * batch * seq
            // _ways(cache_rules, mesh_shape, "batch", batch)
            // _ways(cache_rules, mesh_shape, *mixer_of(config).cache_split(config)))


def _mlp_memory(config: ModelConfig, moe: bool, b: int, local,
                exchanged: bool = False) -> dict[str, int]:
    """Bytes per token an MLP keeps under each remat policy (`local(width)`: the part of a
    hidden width a device holds): its kind's `saved_widths` (nn/mlp.py) of the hidden width.

    MoE, per token and layer, with R = top_k and s = the slots per assignment (the capacity
    factor on capacity buffers, whose padding is computed too; 1 dropless): R·s expert MLPs'
    hidden values, input rows (b·D) and fp32 output rows (4·D) — in both layouts around the
    all-to-alls when the expert axis splits them — plus, per assignment, the row copied into
    the buffers (b·D) and the fp32 output gathered back (4·D); the router's fp32 logits and
    scores (2·4·E); shared experts as a dense MLP. dots keeps the matmul outputs only; under
    dots_no_batch the experts' matmuls (batched over E, or grouped) are recomputed."""
    widths = MLPS[config.dense_mlp].saved_widths()
    saved, dots = widths["none"], widths["dots"]
    if not moe:
        F = local(config.F)
        return {"none": b * saved * F, "dots": b * dots * F, "dots_no_batch": b * dots * F}
    m, D = config.moe, config.D
    capacity_path = dispatch_of(config, drop=True) == "capacity"
    R, slots = m.top_k, (m.capacity_factor or 1.0) if capacity_path else 1.0
    M, U, E = local(config.expert_ffn_dim), local(m.n_shared_experts * config.expert_ffn_dim), \
        m.n_experts
    copies = 2 if exchanged and capacity_path else 1
    experts_none = R * slots * (b * saved * M + copies * (b + 4) * D) + R * (b + 4) * D
    experts_dots = R * slots * (b * dots * M + 4 * D) + R * 4 * D
    router = 2 * 4 * E
    return {"none": int(experts_none) + router + b * saved * U,
            "dots": int(experts_dots) + router + b * dots * U,
            "dots_no_batch": 4 * E + b * dots * U}


@dataclasses.dataclass(frozen=True)
class _AttentionMemory:
    saved: int  # bytes per token per layer kept with no remat
    saved_by_dots: int  # of them, those the "dots" policy keeps
    residuals: int  # those the attention policies keep besides q, k, v and the output
    tiles: int  # working set per row


def _attention_memory(config: ModelConfig, backend: str, T: int, b: int,
                      N: int) -> _AttentionMemory:
    """What attention adds to the activations under the implementation `config` picks on
    `backend` (N: the heads a device holds)."""
    impl = chosen_attention(config, backend)
    block_q, block_kv = min(config.attention_block_q, T), min(config.attention_block_kv, T)
    if impl == "xla" or (impl == "chunked" and one_block(T, T, config.attention_block_q,
                                                         config.attention_block_kv)):
        return _AttentionMemory(saved=2 * 4 * N * T, saved_by_dots=4 * N * T, residuals=0,
                                tiles=0)
    mask = b * T if impl == "cudnn" else 0
    return _AttentionMemory(saved=b * N * config.v_head_dim + 4 * N + mask,
                            saved_by_dots=4 * N + mask, residuals=4 * N + mask,
                            tiles=3 * 4 * N * block_q * block_kv)
