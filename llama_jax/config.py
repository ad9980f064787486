"""Model configuration: a frozen, hashable dataclass validated on construction, and YAML files.

A config is static under `jax.jit` (it is hashable), so shapes and code paths may depend on it.
Field names follow Meta's `params.json` where one exists (dim, n_layers, n_heads, n_kv_heads,
multiple_of, ffn_dim_multiplier, norm_eps, rope_theta); the dimension letters of the rest of the
code are exposed as read-only properties (D, L, N, K, G, H, F, V).

Config files are YAML. A file may name a `base:` (a preset name or a path relative to the file)
whose content it overrides key by key, so an ablation is a few lines of difference. Every error
names the file and the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import yaml

from llama_jax.sharding import MESH_AXES, RULE_TABLES

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
ROPE_TYPES = ("default", "llama3", "yarn")
ATTENTIONS = ("gqa", "mla")  # see nn/attention.py and nn/mla.py
MLA_DECODES = ("absorbed", "expanded")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")
NORMS = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
POSITIONS = ("rope", "sinusoidal", "learned", "none")
DENSE_MLPS = ("swiglu", "geglu", "gelu", "gelu_tanh", "relu")
MLPS = (*DENSE_MLPS, "moe")
GATED_MLPS = ("swiglu", "geglu")
ROUTERS = ("softmax", "sigmoid")
MOE_DISPATCHES = ("auto", "capacity", "dropless")  # see nn/moe.py
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")  # see nn/dot_product.py
HEADS = ("lm", "sequence_classification", "token_classification", "regression")  # nn/heads.py
POOLED_HEADS = ("sequence_classification", "regression")  # one output row per sequence
POOLINGS = ("last", "mean")
# Field roles: "architecture" fields change the function the model computes; "execution" fields
# only change how it runs (a run may resume, a checkpoint may load, under other values);
# "generation" fields are defaults for sampling.
# "init" fields only size or initialise the parameters (ffn_dim is resolved from them), so a
# checkpoint does not carry them; "names" fields only name the head's outputs.
EXECUTION, GENERATION, INIT = {"role": "execution"}, {"role": "generation"}, {"role": "init"}
NAMES = {"role": "names"}


class ConfigError(ValueError):
    """An invalid configuration; the message names the file (when there is one) and the field."""


# The fields of each rope_type's scaling, with their defaults (factor and
# original_max_position_embeddings are common to both).
ROPE_SCALING_FIELDS = {
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
    # yarn: an mscale of 0 counts as unset (transformers' reading): see nn/rope.py
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0},
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency rescaling for contexts past the original one (nn/rope.py), by rope_type:
    "llama3" (Meta's LLaMA-3.1 `apply_scaling`) or "yarn" (Peng et al. 2023, as DeepSeek-V2/V3
    and transformers define it). The fields of the other type stay None (giving one is an
    error); those of the model's type are defaulted by the model (`for_type`)."""

    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn: rotations per context above which nothing changes
    beta_slow: float | None = None  # yarn: ... below which frequencies are divided by factor
    mscale: float | None = None  # yarn: the temperature of cos/sin (nn/rope.py); 0: unset
    mscale_all_dim: float | None = None  # yarn: ... and of the softmax scale (DeepSeek); 0: unset

    def __post_init__(self):
        for name in ("factor", *(n for fields in ROPE_SCALING_FIELDS.values() for n in fields)):
            object.__setattr__(self, name, _as_float(f"rope_scaling.{name}", getattr(self, name)))
        _require(self.factor >= 1.0, "rope_scaling.factor", self.factor, "must be >= 1")
        context = self.original_max_position_embeddings
        _require(isinstance(context, int) and context > 0,
                 "rope_scaling.original_max_position_embeddings", context,
                 "must be a positive integer")
        for name in ("low_freq_factor", "beta_slow"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"rope_scaling.{name}", value, "must be > 0")
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"rope_scaling.{name}", value, "must be >= 0")
        # llama3 divides by high - low; YaRN's ramp has a floor for an empty range
        for low, high, strict in (("low_freq_factor", "high_freq_factor", True),
                                  ("beta_slow", "beta_fast", False)):
            if getattr(self, low) is not None and getattr(self, high) is not None:
                ok = (getattr(self, high) > getattr(self, low) if strict
                      else getattr(self, high) >= getattr(self, low))
                _require(ok, f"rope_scaling.{high}", getattr(self, high),
                         f"must be {'>' if strict else '>='} {low} ({getattr(self, low)})")

    def for_type(self, rope_type: str) -> "RopeScaling":
        """This scaling with `rope_type`'s fields defaulted; fields of another type refused."""
        for other, fields in ROPE_SCALING_FIELDS.items():
            for name in fields:
                value = getattr(self, name)
                _require(other == rope_type or value is None, f"rope_scaling.{name}", value,
                         f"applies only to rope_type {other!r}, not {rope_type!r}")
        defaults = {name: default for name, default in ROPE_SCALING_FIELDS[rope_type].items()
                    if getattr(self, name) is None}
        return dataclasses.replace(self, **defaults)

    def to_dict(self) -> dict[str, Any]:
        """The fields that apply (those of the other type are None)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """The `mla:` section of `attention: mla` (nn/mla.py): per token, the KV cache holds one
    latent of width kv_lora_rank and one RoPE key of width qk_rope_head_dim shared by all heads;
    each head's query and key have qk_nope_head_dim + qk_rope_head_dim features, its value
    v_head_dim. Defaults: DeepSeek-V2-Lite's attention."""

    q_lora_rank: int | None = None  # queries through a latent of this width; None: plain W_Q
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self):
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            value = getattr(self, name)
            _require((value is None and name == "q_lora_rank")
                     or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
                     f"mla.{name}", value, "must be a positive integer"
                     + (" (or null: a plain query projection)" if name == "q_lora_rank" else ""))
        _require(self.qk_rope_head_dim % 2 == 0, "mla.qk_rope_head_dim", self.qk_rope_head_dim,
                 "must be even: RoPE rotates pairs of features")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The `moe:` section of `mlp: moe` (nn/moe.py): E routed experts of which each token uses
    top_k, plus always-on shared experts; the first `first_dense_layers` blocks keep a dense
    MLP of kind `expert_mlp` and width `ffn_dim`."""

    n_experts: int = 8
    top_k: int = 2
    expert_mlp: str = "swiglu"  # the experts' (and the dense layers') MLP kind
    expert_ffn_dim: int | None = None  # None: the model's ffn_dim
    n_shared_experts: int = 0  # always-on experts of the same kind, one MLP n_shared x as wide
    router: str = "softmax"  # softmax over experts (Mixtral) | sigmoid per expert (DeepSeek-V3)
    normalize_top_k: bool = True  # the top_k weights renormalised to sum to 1
    routed_scaling: float = 1.0  # the routed experts' sum times this (DeepSeek-V3: 2.5)
    n_groups: int = 1  # group-limited routing: experts in n_groups groups ...
    top_k_groups: int = 1  # ... of which each token picks from its best top_k_groups
    first_dense_layers: int = 0
    capacity_factor: float | None = None  # slots per expert / (tokens·top_k/E); None: dropless
    aux_loss_weight: float = 0.01  # times the load-balancing loss (1 under uniform routing)
    router_z_loss_weight: float = 0.0  # times mean(logsumexp(logits)^2)
    # sigmoid router: the selection bias moves by this much per step towards balance (the sign
    # of mean load - expert load, DeepSeek-V3's gamma), outside the gradient; 0 = frozen
    bias_update_rate: float = 0.001

    def __post_init__(self):
        for name in ("routed_scaling", "capacity_factor", "aux_loss_weight",
                     "router_z_loss_weight", "bias_update_rate"):
            object.__setattr__(self, name, _as_float(f"moe.{name}", getattr(self, name)))
        for name in ("n_experts", "top_k", "n_groups", "top_k_groups"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     f"moe.{name}", value, "must be a positive integer")
        for name in ("n_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     f"moe.{name}", value, "must be a non-negative integer")
        _require(self.expert_ffn_dim is None or (isinstance(self.expert_ffn_dim, int)
                                                 and self.expert_ffn_dim > 0),
                 "moe.expert_ffn_dim", self.expert_ffn_dim, "must be a positive integer")
        _require(self.expert_mlp in DENSE_MLPS, "moe.expert_mlp", self.expert_mlp,
                 f"is not one of {DENSE_MLPS}")
        _require(self.router in ROUTERS, "moe.router", self.router, f"is not one of {ROUTERS}")
        _require(isinstance(self.normalize_top_k, bool), "moe.normalize_top_k",
                 self.normalize_top_k, "must be true or false")
        _require(self.top_k <= self.n_experts, "moe.top_k", self.top_k,
                 f"must be <= n_experts ({self.n_experts})")
        _require(self.n_experts % self.n_groups == 0, "moe.n_groups", self.n_groups,
                 f"must divide n_experts ({self.n_experts})")
        _require(self.top_k_groups <= self.n_groups, "moe.top_k_groups", self.top_k_groups,
                 f"must be <= n_groups ({self.n_groups})")
        if self.n_groups > 1:
            per_group = self.n_experts // self.n_groups
            _require(self.top_k <= self.top_k_groups * per_group, "moe.top_k", self.top_k,
                     f"must be <= top_k_groups x experts per group "
                     f"({self.top_k_groups} x {per_group})")
            _require(self.router == "softmax" or per_group >= 2, "moe.n_groups", self.n_groups,
                     "leaves one expert per group; a sigmoid router scores a group by its two "
                     "best experts")
        _require(self.capacity_factor is None or self.capacity_factor > 0,
                 "moe.capacity_factor", self.capacity_factor, "must be > 0 (or null: dropless)")
        for name in ("aux_loss_weight", "router_z_loss_weight", "bias_update_rate"):
            _require(getattr(self, name) >= 0, f"moe.{name}", getattr(self, name), "must be >= 0")
        _require(self.routed_scaling > 0, "moe.routed_scaling", self.routed_scaling,
                 "must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder-only Transformer: LLaMA by default, the classic choices by config value.

    `ffn_dim` defaults to Meta's SwiGLU rule for gated MLPs and to 4·D for the others (see
    `default_ffn_dim`); `head_dim` to dim // n_heads. RoPE fields (`rope_theta`, `rope_type`,
    `rope_scaling`) apply only to `positions: rope` and default to 10000 / "default" there.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: equal to n_heads (MHA)
    head_dim: int | None = None  # None: dim // n_heads (mla: qk_nope + qk_rope head dims)
    attention: str = "gqa"  # gqa: MHA/GQA/MQA by n_kv_heads | mla: latent KV (Multi-head Latent)
    mla: MlaConfig | None = None  # with attention: mla (None there: MlaConfig's defaults)
    ffn_dim: int | None = None  # None: `default_ffn_dim` for the MLP kind
    multiple_of: int = dataclasses.field(default=256, metadata=INIT)
    ffn_dim_multiplier: float | None = dataclasses.field(default=None, metadata=INIT)
    norm: str = "rmsnorm"  # rmsnorm (LLaMA) | layernorm (mean, gain and bias)
    norm_position: str = "pre"  # pre: x + f(norm(x)), final norm; post: norm(x + f(x)), none
    norm_eps: float = 1e-5
    positions: str = "rope"  # rope | sinusoidal | learned (added to the embedding) | none
    rope_theta: float | None = None  # None: 10000 with rope
    rope_type: str | None = None  # None: "default" with rope
    rope_scaling: RopeScaling | None = None
    mlp: str = "swiglu"  # swiglu | geglu (gated, 3 matrices) | gelu | gelu_tanh | relu (2) | moe
    moe: MoeConfig | None = None  # with mlp: moe (None there: MoeConfig's defaults)
    bias: bool = False  # biases on the attention and MLP projections (GPT-2)
    embed_scale: bool = False  # token embeddings times √D (Vaswani et al.), before positions
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # What the final hidden states feed (nn/heads.py): the LM head, or a task head of n_labels
    # outputs (classes, or regression targets) that replaces it.
    head: str = "lm"  # lm | sequence_classification | token_classification | regression
    n_labels: int | None = None  # task heads: classes, or regression targets
    pooling: str | None = None  # pooled heads: last (non-padding token) | mean; None: last
    pad_id: int | None = None  # task heads: the id that pads batches; None: no padding
    label_names: tuple[str, ...] | None = dataclasses.field(default=None, metadata=NAMES)
    init_std: float = dataclasses.field(default=0.02, metadata=INIT)
    param_dtype: str = dataclasses.field(default="float32", metadata=EXECUTION)
    compute_dtype: str = dataclasses.field(default="float32", metadata=EXECUTION)
    remat: str = dataclasses.field(default="none", metadata=EXECUTION)
    # False unrolls the layer loop in training (compile time grows with L).
    scan_layers: bool = dataclasses.field(default=True, metadata=EXECUTION)
    # How attention is computed (nn/dot_product.py): auto | xla (dense, memory quadratic in T) |
    # chunked (blockwise, linear) | cudnn (NVIDIA GPUs) | splash (TPUs); blocks of the last three.
    attention_impl: str = dataclasses.field(default="auto", metadata=EXECUTION)
    attention_block_q: int = dataclasses.field(default=512, metadata=EXECUTION)
    attention_block_kv: int = dataclasses.field(default=512, metadata=EXECUTION)
    # How MoE experts are dispatched (nn/moe.py): capacity (fixed per-expert buffers) |
    # dropless (sorted tokens, grouped matmuls) | auto (capacity with a capacity_factor).
    moe_dispatch: str = dataclasses.field(default="auto", metadata=EXECUTION)
    # How MLA decodes one token (nn/mla.py): absorbed (scores against the cached latents) |
    # expanded (per-head keys and values rebuilt from them at every step).
    mla_decode: str = dataclasses.field(default="absorbed", metadata=EXECUTION)
    # ids that end generation by default (from the tokenizer)
    eos_ids: tuple[int, ...] = dataclasses.field(default=(), metadata=GENERATION)

    def __post_init__(self):
        for name in ("norm_eps", "rope_theta", "init_std", "ffn_dim_multiplier"):
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len",
                     "attention_block_q", "attention_block_kv"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, value, "must be a positive integer")
        for name, kinds in (("norm", NORMS), ("norm_position", NORM_POSITIONS),
                            ("positions", POSITIONS), ("mlp", MLPS),
                            ("attention_impl", ATTENTION_IMPLS),
                            ("moe_dispatch", MOE_DISPATCHES), ("attention", ATTENTIONS),
                            ("mla_decode", MLA_DECODES)):
            _require(getattr(self, name) in kinds, name, getattr(self, name),
                     f"is not one of {kinds}")
        self._check_mla()
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _require(isinstance(self.n_kv_heads, int) and self.n_kv_heads > 0, "n_kv_heads",
                 self.n_kv_heads, "must be a positive integer")
        _require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", self.n_kv_heads,
                 f"must divide n_heads ({self.n_heads}): each KV head serves a whole group of "
                 "query heads")
        if self.head_dim is None:
            _require(self.dim % self.n_heads == 0, "n_heads", self.n_heads,
                     f"must divide dim ({self.dim}) unless head_dim is given")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        _require(isinstance(self.head_dim, int) and self.head_dim > 0, "head_dim", self.head_dim,
                 "must be a positive integer")
        self._check_positions()
        self._check_moe()
        self._check_head()
        if self.ffn_dim_multiplier is not None:
            _require(self.ffn_dim_multiplier > 0, "ffn_dim_multiplier", self.ffn_dim_multiplier,
                     "must be > 0")
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", default_ffn_dim(
                self.dense_mlp, self.dim, self.multiple_of, self.ffn_dim_multiplier))
        _require(isinstance(self.ffn_dim, int) and self.ffn_dim > 0, "ffn_dim", self.ffn_dim,
                 "must be a positive integer")
        _require(self.norm_eps > 0, "norm_eps", self.norm_eps, "must be > 0")
        _require(self.init_std > 0, "init_std", self.init_std, "must be > 0")
        for name in ("tie_embeddings", "scan_layers", "bias", "embed_scale"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name),
                     "must be true or false")
        _require(isinstance(self.eos_ids, (list, tuple)), "eos_ids", self.eos_ids,
                 "must be a list of token ids")
        object.__setattr__(self, "eos_ids", tuple(self.eos_ids))
        for token in self.eos_ids:
            _require(isinstance(token, int) and 0 <= token < self.vocab_size, "eos_ids",
                     self.eos_ids, f"must be token ids in [0, vocab_size={self.vocab_size})")
        for name in ("param_dtype", "compute_dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name), name))
        _require(self.remat in REMAT_POLICIES, "remat", self.remat,
                 f"is not one of {REMAT_POLICIES}")

    def _check_positions(self) -> None:
        """RoPE fields are defaulted with `positions: rope` and refused with any other kind
        (their defaults, which `dataclasses.replace` carries over from a RoPE config, are
        cleared instead)."""
        if self.positions != "rope":
            for name, default in (("rope_theta", 10000.0), ("rope_type", "default"),
                                  ("rope_scaling", None)):
                value = getattr(self, name)
                _require(value in (None, default), name, value,
                         f"applies only to positions 'rope', not {self.positions!r}; remove it "
                         "(or set it to null)")
                object.__setattr__(self, name, None)
            return
        if self.rope_theta is None:
            object.__setattr__(self, "rope_theta", 10000.0)
        if self.rope_type is None:
            object.__setattr__(self, "rope_type", "default")
        if self.attention == "gqa":  # (MLA's RoPE dimension is checked by its section)
            _require(self.head_dim % 2 == 0, "head_dim", self.head_dim,
                     "must be even: RoPE rotates pairs of features")
        _require(self.rope_theta > 0, "rope_theta", self.rope_theta, "must be > 0")
        _require(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
                 "rope_scaling", self.rope_scaling, "must be a mapping of scaling fields")
        _require(self.rope_type in ROPE_TYPES, "rope_type", self.rope_type,
                 f"is not one of {ROPE_TYPES}")
        scaled = self.rope_type in ROPE_SCALING_FIELDS
        _require(scaled == (self.rope_scaling is not None), "rope_scaling",
                 self.rope_scaling, f"must be given exactly when rope_type is one of "
                 f"{tuple(ROPE_SCALING_FIELDS)} (rope_type is {self.rope_type!r})")
        if scaled:
            object.__setattr__(self, "rope_scaling", self.rope_scaling.for_type(self.rope_type))

    def _section(self, name: str, cls: type, field: str, kind: str) -> bool:
        """Whether the section `name` (of type `cls`) applies: it belongs to `field: kind`,
        which defaults it to `cls()`, and is refused with any other value of `field`."""
        if getattr(self, field) != kind:
            if getattr(self, name) is not None:
                raise ConfigError(f"{name}: the section applies only to {field} {kind!r}, not "
                                  f"{getattr(self, field)!r}; remove it (or set {field}: {kind})")
            return False
        if getattr(self, name) is None:
            object.__setattr__(self, name, cls())
        _require(isinstance(getattr(self, name), cls), name, getattr(self, name),
                 f"must be a mapping of {name} fields")
        return True

    def _check_mla(self) -> None:
        """`mla:` belongs to `attention: mla` (which defaults it). MLA fixes the head layout:
        every head has its own key and value (n_kv_heads = n_heads), queries and keys have
        qk_nope + qk_rope features (head_dim), and its decoupled key needs RoPE."""
        if not self._section("mla", MlaConfig, "attention", "mla"):
            return
        qk_head_dim = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        _require(self.n_kv_heads in (None, self.n_heads), "n_kv_heads", self.n_kv_heads,
                 f"does not apply to attention 'mla' (each of the n_heads={self.n_heads} heads "
                 "expands its own key and value from the shared latent); remove it")
        _require(self.head_dim in (None, qk_head_dim), "head_dim", self.head_dim,
                 f"is mla.qk_nope_head_dim + mla.qk_rope_head_dim ({qk_head_dim}) with "
                 "attention 'mla'; remove it (or set it to null)")
        object.__setattr__(self, "head_dim", qk_head_dim)
        _require(self.positions == "rope", "positions", self.positions,
                 "must be 'rope' with attention 'mla' (its decoupled key is rotary)")
        _require(not self.bias, "bias", self.bias, "is not supported with attention 'mla'")

    def _check_moe(self) -> None:
        """`moe:` belongs to `mlp: moe` (which defaults it); MoE experts have no biases."""
        if not self._section("moe", MoeConfig, "mlp", "moe"):
            return
        _require(not self.bias, "bias", self.bias, "is not supported with mlp 'moe'")
        _require(self.moe.first_dense_layers < self.n_layers, "moe.first_dense_layers",
                 self.moe.first_dense_layers, f"must be < n_layers ({self.n_layers})")

    def _check_head(self) -> None:
        """Task-head fields are refused with the LM head; a task head needs its output
        count, and pooling (default: last) belongs to the pooled heads."""
        _require(self.head in HEADS, "head", self.head, f"is not one of {HEADS}")
        if self.head == "lm":
            for name in ("n_labels", "pooling", "pad_id", "label_names"):
                _require(getattr(self, name) is None, name, getattr(self, name),
                         "applies only to task heads, not head 'lm'; remove it")
            return
        least = 2 if self.head != "regression" else 1
        _require(isinstance(self.n_labels, int) and not isinstance(self.n_labels, bool)
                 and self.n_labels >= least, "n_labels", self.n_labels,
                 f"must be an integer >= {least} with head {self.head!r}")
        if self.head in POOLED_HEADS:
            object.__setattr__(self, "pooling", self.pooling or "last")
            _require(self.pooling in POOLINGS, "pooling", self.pooling,
                     f"is not one of {POOLINGS}")
        else:
            _require(self.pooling is None, "pooling", self.pooling,
                     f"applies only to heads {POOLED_HEADS}; remove it")
        _require(self.pad_id is None or (isinstance(self.pad_id, int)
                                         and 0 <= self.pad_id < self.vocab_size),
                 "pad_id", self.pad_id, f"must be a token id in [0, vocab_size={self.vocab_size})")
        if self.label_names is not None:
            _require(isinstance(self.label_names, (list, tuple))
                     and len(self.label_names) == self.n_labels
                     and all(isinstance(n, str) and n for n in self.label_names)
                     and len(set(self.label_names)) == len(self.label_names), "label_names",
                     self.label_names, f"must be {self.n_labels} distinct non-empty names")
            object.__setattr__(self, "label_names", tuple(self.label_names))

    @property
    def names_of_labels(self) -> tuple[str, ...]:
        """The head's output names: `label_names`, or LABEL_0.. as transformers names them."""
        return self.label_names or tuple(f"LABEL_{i}" for i in range(self.n_labels or 0))

    @property
    def dense_mlp(self) -> str:
        """The kind of every dense MLP: `mlp`, or the MoE experts' kind (which its dense first
        layers and shared experts also use)."""
        return self.moe.expert_mlp if self.mlp == "moe" else self.mlp

    @property
    def gated_mlp(self) -> bool:
        return self.dense_mlp in GATED_MLPS

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe.expert_ffn_dim or self.ffn_dim

    @property
    def rope_dim(self) -> int:
        """The features of a head RoPE rotates: all of them, or MLA's qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def v_head_dim(self) -> int:
        """A head's value (and attention output) width: head_dim, or MLA's v_head_dim."""
        return self.mla.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def dims(self) -> dict[str, int]:
        """Sizes by dimension letter, for `TensorSpec` shapes (E, M, U: with mlp moe; Z, Q, J,
        I, Y: with attention mla; O: with a task head)."""
        dims = {"V": self.V, "D": self.D, "N": self.N, "K": self.K, "H": self.H, "F": self.F,
                "P": self.max_seq_len, **({"O": self.n_labels} if self.n_labels else {})}
        if self.attention == "mla":
            a = self.mla
            dims.update(Z=a.kv_lora_rank, J=a.qk_nope_head_dim, I=a.qk_rope_head_dim,
                        Y=a.v_head_dim, **({"Q": a.q_lora_rank} if a.q_lora_rank else {}))
        if self.mlp == "moe":
            dims.update(E=self.moe.n_experts, M=self.expert_ffn_dim,
                        U=self.moe.n_shared_experts * self.expert_ffn_dim)
        return dims

    def architecture(self) -> dict[str, Any]:
        """The fields that determine the function the model computes (no execution settings,
        generation defaults or init-only fields): two configs with equal architectures run the
        same weights."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if "role" not in f.metadata}

    def with_execution(self, **settings) -> "ModelConfig":
        """The same architecture with other execution settings (dtypes, remat, scan,
        attention implementation)."""
        roles = {f.name: f.metadata.get("role") for f in dataclasses.fields(self)}
        for name in settings:
            _require(roles.get(name) == "execution", name, settings[name],
                     "is not an execution setting")
        return dataclasses.replace(self, **settings)

    # The dimension letters (README, "Code map"), so code can say `config.K` where the math says K.
    V = property(lambda self: self.vocab_size)
    D = property(lambda self: self.dim)
    L = property(lambda self: self.n_layers)
    N = property(lambda self: self.n_heads)
    K = property(lambda self: self.n_kv_heads)
    G = property(lambda self: self.n_heads // self.n_kv_heads)
    H = property(lambda self: self.head_dim)
    F = property(lambda self: self.ffn_dim)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any], where: str = "model") -> "ModelConfig":
        """Builds a config from plain data (a YAML section); `where` prefixes error messages."""
        fields = dict(fields)
        for name, section in (("rope_scaling", RopeScaling), ("moe", MoeConfig),
                              ("mla", MlaConfig)):
            if isinstance(fields.get(name), Mapping):  # its errors name `name.field` already
                _check_keys(fields[name], section, f"{where}.{name}")
                fields[name] = build_section(section, fields[name], where)
        return build_section(cls, fields, where)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a YAML file (tuples become lists)."""
        out = {**dataclasses.asdict(self), "eos_ids": list(self.eos_ids)}
        for section in ("moe", "mla"):  # a dense GQA model's file has neither section
            if getattr(self, section) is None:
                del out[section]
        if self.head == "lm":  # a language model's file has no task-head fields either
            for name in ("head", "n_labels", "pooling", "pad_id", "label_names"):
                del out[name]
        elif self.label_names is not None:
            out["label_names"] = list(self.label_names)
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_dict()
        return out


SCHEDULES = ("cosine", "wsd", "constant")
FREEZES = ("none", "backbone")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping of a training run (the `train:` section)."""

    seq_len: int = 256  # tokens per packed sequence
    batch_size: int = 8  # sequences per optimizer step, across all devices
    micro_batches: int = 1  # gradient accumulation: the batch is split into this many parts
    steps: int = 1000  # the schedule's horizon
    learning_rate: float = 3e-4  # peak
    schedule: str = "cosine"  # cosine: warmup, cosine decay; wsd: warmup, stable, decay
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # final learning rate / peak
    decay_fraction: float = 0.2  # wsd: share of the steps spent decaying (linearly)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # AdamW, decoupled; never applied to norm gains and biases
    clip_norm: float = 1.0  # global gradient norm; 0 = off
    z_loss: float = 0.0  # coefficient of log(Z)^2 (PaLM); 0 = off
    seed: int = 0  # parameter init and data order
    log_every: int = 10  # lr, tokens/s and MFU every this many steps (loss is every step)
    eval_every: int = 200  # validation loss every this many steps, and at the end
    eval_batches: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    max_nonfinite: int = 5  # stop after this many non-finite steps in a row
    peak_flops: float | None = None  # per device, for MFU; None: known table or measured
    freeze: str = "none"  # none | backbone: fine-tune the task head only (finetune.py)

    # Fields that only change bookkeeping: a run may resume with different values.
    RESUMABLE_CHANGES = ("steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
                         "keep_checkpoints", "max_nonfinite", "peak_flops")

    def __post_init__(self):
        for name in ("learning_rate", "min_lr_ratio", "decay_fraction", "b1", "b2", "eps",
                     "weight_decay", "clip_norm", "z_loss", "peak_flops"):
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        for name in ("seq_len", "batch_size", "micro_batches", "steps", "log_every", "eval_every",
                     "eval_batches", "checkpoint_every", "keep_checkpoints", "max_nonfinite"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     name, value, "must be a positive integer")
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     name, value, "must be a non-negative integer")
        _require(self.batch_size % self.micro_batches == 0, "micro_batches",
                 self.micro_batches, f"must divide batch_size ({self.batch_size})")
        _require(self.schedule in SCHEDULES, "schedule", self.schedule,
                 f"is not one of {SCHEDULES}")
        _require(self.learning_rate > 0, "learning_rate", self.learning_rate, "must be > 0")
        for name in ("min_lr_ratio", "b1", "b2"):
            _require(0 <= getattr(self, name) <= 1, name, getattr(self, name),
                     "must be in [0, 1]")
        _require(0 < self.decay_fraction <= 1, "decay_fraction", self.decay_fraction,
                 "must be in (0, 1]")
        for name in ("eps", "weight_decay", "clip_norm", "z_loss"):
            _require(getattr(self, name) >= 0, name, getattr(self, name),
                     "must be >= 0")
        _require(self.peak_flops is None or self.peak_flops > 0, "peak_flops",
                 self.peak_flops, "must be > 0 (or null to measure)")
        _require(self.freeze in FREEZES, "freeze", self.freeze, f"is not one of {FREEZES}")


DEFAULT_CORPUS = "/usr/share/doc/python3.11/html/_sources"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split (the `data:` section)."""

    corpus: str = DEFAULT_CORPUS  # a directory (every file below it) or a glob; one document each
    tokenizer: str | None = None  # a tokenizer.model; None: train SentencePiece BPE on the corpus
    val_fraction: float = 0.05  # share of documents held out for validation
    max_tokenizer_chars: int = 20_000_000  # text fed to tokenizer training (sampled by document)

    def __post_init__(self):
        object.__setattr__(self, "val_fraction", _as_float("val_fraction", self.val_fraction))
        _require(isinstance(self.corpus, str) and self.corpus != "", "corpus", self.corpus,
                 "must be a directory or a glob")
        _require(self.tokenizer is None or isinstance(self.tokenizer, str), "tokenizer",
                 self.tokenizer, "must be a path to a tokenizer.model (or null to train one)")
        _require(0 < self.val_fraction < 1, "val_fraction", self.val_fraction,
                 "must be in (0, 1)")
        _require(isinstance(self.max_tokenizer_chars, int) and self.max_tokenizer_chars > 0,
                 "max_tokenizer_chars", self.max_tokenizer_chars,
                 "must be a positive integer")


TASKS = ("sequence_classification", "token_classification", "regression")  # = the task heads


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """A downstream task (the `task:` section; tasks.py, task_data.py): the head it puts on
    the model, and the JSONL files it reads — one example per line, with `text` and `label`
    (sequence_classification), `labels` per word (token_classification) or `target`
    (regression)."""

    kind: str  # sequence_classification | token_classification | regression
    train: str  # a JSONL file
    val: str | None = None  # a JSONL file; None: hold out val_fraction of train by hash
    val_fraction: float = 0.1
    # classification: the class names (a label is a name or its index) or their count;
    # regression: the target names or their count
    labels: Any = 1
    pooling: str = "last"  # sequence_classification and regression: last | mean

    def __post_init__(self):
        object.__setattr__(self, "val_fraction", _as_float("val_fraction", self.val_fraction))
        _require(self.kind in TASKS, "kind", self.kind, f"is not one of {TASKS}")
        for name in ("train", "val"):
            value = getattr(self, name)
            _require((value is None and name == "val") or (isinstance(value, str) and value),
                     name, value, "must be a path to a JSONL file")
        _require(0 < self.val_fraction < 1, "val_fraction", self.val_fraction,
                 "must be in (0, 1)")
        names = self.labels
        if isinstance(names, (list, tuple)):
            _require(all(isinstance(n, str) and n for n in names) and len(set(names)) == len(
                names), "labels", names, "must be distinct non-empty names (or a count)")
            object.__setattr__(self, "labels", tuple(names))
        else:
            _require(isinstance(names, int) and not isinstance(names, bool) and names > 0,
                     "labels", names, "must be a list of names or a positive count")
        least = 1 if self.kind == "regression" else 2
        _require(self.n_labels >= least, "labels", self.labels,
                 f"must name at least {least} output(s) for kind {self.kind!r}")
        _require(self.pooling in POOLINGS, "pooling", self.pooling, f"is not one of {POOLINGS}")

    @property
    def n_labels(self) -> int:
        return len(self.labels) if isinstance(self.labels, tuple) else self.labels

    @property
    def label_names(self) -> tuple[str, ...] | None:
        return self.labels if isinstance(self.labels, tuple) else None

    def head_fields(self) -> dict[str, Any]:
        """The model fields of this task's head."""
        return {"head": self.kind, "n_labels": self.n_labels, "label_names": self.label_names,
                "pooling": None if self.kind == "token_classification" else self.pooling}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (their product is the device count; one may be -1: the rest) and the
    logical-axis rules (the `mesh:` section). Rules given here are merged over the default
    tables of the sharding module (`sharding.RULE_TABLES`) and
    stored as sorted `(logical axis, (mesh axes...))` tuples, so the config stays hashable."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1  # expert parallelism: MoE experts split over it (a batch axis elsewhere)
    weight_rules: Any = None  # {logical axis: mesh axis | [mesh axes] | null}
    activation_rules: Any = None
    cache_rules: Any = None

    def __post_init__(self):
        sizes = list(self.sizes)
        for name, size in zip(MESH_AXES, sizes):
            _require(isinstance(size, int) and not isinstance(size, bool)
                     and (size > 0 or size == -1), name, size, "must be a positive integer or -1")
        _require(sizes.count(-1) <= 1, "data", sizes, "at most one mesh axis may be -1")
        for name, (defaults, known) in RULE_TABLES.items():
            given = getattr(self, name) or {}
            if isinstance(given, tuple):  # already normalised (dataclasses.replace)
                given = dict(given)
            _require(isinstance(given, Mapping), name, given,
                     "must map logical axis names to mesh axes")
            rules = []
            for axis, target in {**defaults, **given}.items():
                _require(axis in known, name, axis,
                         f"is not a logical axis name; known: {', '.join(known)}")
                targets = [target] if isinstance(target, str) or target is None else target
                _require(isinstance(targets, (list, tuple)) and all(
                    t is None or t in MESH_AXES for t in targets), f"{name}.{axis}", target,
                    f"must be a mesh axis ({', '.join(MESH_AXES)}), a list of them, or null")
                rules.append((axis, tuple(t for t in targets if t is not None)))
            object.__setattr__(self, name, tuple(sorted(rules)))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The axis sizes in `MESH_AXES` order, as given (-1 unfilled)."""
        return tuple(getattr(self, name) for name in MESH_AXES)

    def shape_for(self, n_devices: int) -> tuple[int, ...]:
        """The sizes in `MESH_AXES` order with the -1 entry filled; the product must be
        `n_devices`."""
        sizes = list(self.sizes)
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if n_devices % known:
                raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))}: the given sizes "
                                  f"(product {known}) do not divide the {n_devices} devices")
            sizes[sizes.index(-1)] = n_devices // known
        if math.prod(sizes) != n_devices:
            raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} "
                              f"devices; this run has {n_devices}")
        return tuple(sizes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in RULE_TABLES:
            out[name] = {axis: list(targets) for axis, targets in getattr(self, name)}
        return out


def build_section(cls: type, fields: Mapping[str, Any], where: str):
    """`cls(**fields)` with unknown or missing keys and bad values reported as `where.field`."""
    try:
        _check_keys(fields, cls, where)
        return cls(**fields)
    except ConfigError as e:
        if str(e).startswith(where):  # from _check_keys
            raise
        raise ConfigError(f"{where}.{e}") from None
    except TypeError as e:  # e.g. a YAML list where a number belongs
        raise ConfigError(f"{where}: {e}") from None


def default_ffn_dim(mlp: str, dim: int, multiple_of: int,
                    ffn_dim_multiplier: float | None) -> int:
    """The MLP width when `ffn_dim` is not given: the original Transformer's 4·D for the
    two-matrix MLPs, and 2/3 of it, int(2·4D/3), for the gated ones (Shazeer 2020), whose
    third matrix would otherwise add half the parameters — so every kind has ~8·D² weights per
    layer. Then times `ffn_dim_multiplier` and rounded up to `multiple_of` (Meta's rule)."""
    hidden = int(2 * 4 * dim / 3) if mlp in GATED_MLPS else 4 * dim
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def dtype_name(dtype: Any, field: str = "dtype") -> str:
    """The name of any dtype-like (`jnp.bfloat16`, `np.float32`, `"float16"`, `jnp.dtype(...)`)
    among the floating dtypes parameters, activations and caches may use."""
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in DTYPES:
        raise ConfigError(f"{field}={dtype!r} is not one of {', '.join(DTYPES)}")
    return name


def _as_float(field: str, value: Any) -> float | None:
    """Accepts ints and numeric strings: YAML 1.1 reads `1e-5` (no dot) as a string."""
    if value is None or (isinstance(value, float)):
        return value
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}={value!r} must be a number") from None


def _require(ok: bool, field: str, value: Any, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value!r} {message}")


def _check_keys(fields: Mapping[str, Any], cls: type, where: str) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in fields:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{where}: unknown key {key!r}{suggestion}; known keys: "
                              f"{', '.join(known)}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.name not in fields]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)}")


# ----------------------------------------------------------------------------------- YAML files

SECTIONS = ("model", "train", "data", "mesh", "task")
SCALARS = ("init_from",)  # top-level keys that are values, not sections


def resolve_config_path(name_or_path: str | Path, relative_to: Path | None = None) -> Path:
    """A preset name (`llama3-8b`) or a path; relative paths are tried next to `relative_to`."""
    path = Path(name_or_path)
    candidates = [path]
    if relative_to is not None and not path.is_absolute():
        candidates.insert(0, relative_to / path)
    if path.suffix not in (".yaml", ".yml") and len(path.parts) == 1:
        candidates.append(CONFIG_DIR / f"{path}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    presets = ", ".join(list_presets())
    raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a preset; "
                      f"presets: {presets}")


def load_config_tree(name_or_path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Reads a YAML config with its `base:` chain merged in (the child wins, key by key)."""
    path = resolve_config_path(name_or_path, _seen[-1].parent if _seen else None).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"{path}: `base` chain loops: {chain}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(tree).__name__}")
    unknown = [k for k in tree if k not in (*SECTIONS, *SCALARS, "base")]
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {unknown}; expected base, "
                          f"{', '.join(SCALARS)} and sections {list(SECTIONS)}")
    base = tree.pop("base", None)
    if base is None:
        return tree
    return _merge(load_config_tree(base, (*_seen, path)), tree)


def _merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a training run is defined by: the model, its optimisation and its data."""

    model: ModelConfig
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    task: TaskConfig | None = None  # a downstream task; None: language modelling on data
    init_from: str | None = None  # a checkpoint the parameters start from (finetune.py)

    def __post_init__(self):
        if self.task is not None:
            for name, value in self.task.head_fields().items():
                _require(getattr(self.model, name) == value, f"model.{name}",
                         getattr(self.model, name), f"is set by the task section ({value!r})")
        _require(self.init_from is None or (isinstance(self.init_from, str) and self.init_from),
                 "init_from", self.init_from, "must be a checkpoint directory")

    def to_dict(self) -> dict[str, Any]:
        out = {"model": self.model.to_dict(), "train": dataclasses.asdict(self.train),
               "data": dataclasses.asdict(self.data), "mesh": self.mesh.to_dict()}
        if self.train.freeze == "none":  # a pretraining run's file is as before fine-tuning
            del out["train"]["freeze"]
        if self.task is not None:
            out["task"] = dataclasses.asdict(self.task)
            if isinstance(self.task.labels, tuple):
                out["task"]["labels"] = list(self.task.labels)
        if self.init_from is not None:
            out["init_from"] = self.init_from
        return out

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any], where: str) -> "RunConfig":
        """From a merged YAML tree; `where` (the file) prefixes error messages. With a `task:`
        section, the model's head fields come from the task."""
        if "model" not in tree:
            raise ConfigError(f"{where}: no `model:` section (directly or through `base:`)")
        sections = {}
        for name, build in (("task", functools.partial(build_section, TaskConfig)),
                            ("model", ModelConfig.from_dict),
                            ("train", functools.partial(build_section, TrainConfig)),
                            ("data", functools.partial(build_section, DataConfig)),
                            ("mesh", functools.partial(build_section, MeshConfig))):
            fields = tree.get(name) or {}
            if not isinstance(fields, Mapping):
                raise ConfigError(f"{where}: `{name}:` must be a mapping, got {fields!r}")
            if name == "task" and not fields:
                continue
            if name == "model" and "task" in sections:
                fields = with_task_head(fields, sections["task"])
            try:
                sections[name] = build(fields, where=name)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        try:
            return cls(**sections, init_from=tree.get("init_from"))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def with_task_head(model: Mapping[str, Any], task: TaskConfig) -> dict[str, Any]:
    """A model section with the task's head; head fields the section sets differently are
    refused (the task section owns them)."""
    head = task.head_fields()
    for name, value in model.items():
        if name in head and value != head[name] and not (
                name == "label_names" and list(value or ()) == list(head[name] or ())):
            raise ConfigError(f"model.{name}={value!r}: the task section sets it "
                              f"({head[name]!r}); remove it from `model:`")
    return {**model, **head}


def load_run_tree(name_or_path: str | Path, overrides: Sequence[str] = ()
                  ) -> tuple[dict[str, Any], Path]:
    """The merged tree of a config file or preset with `SECTION.KEY=VALUE` overrides (values
    parsed as YAML; `init_from=PATH` for the top-level key), and the file's path."""
    path = resolve_config_path(name_or_path)
    tree = load_config_tree(path)
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in SCALARS:
            tree[key] = yaml.safe_load(value)
            continue
        *parents, leaf = key.split(".")
        if not sep or not parents or parents[0] not in SECTIONS:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE with SECTION one of "
                              f"{', '.join(SECTIONS)} (e.g. train.learning_rate=1e-3)")
        node = tree
        for name in parents:
            if node.get(name) is None:  # absent, or an empty `name:` in the YAML
                node[name] = {}
            node = node[name]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {name} is {node!r} in {path}, not a mapping")
        node[leaf] = yaml.safe_load(value)
    return tree, path


def load_run_config(name_or_path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """A config file or preset with `SECTION.KEY=VALUE` overrides (values parsed as YAML). A
    fine-tuning config whose model comes from its `init_from` checkpoint is read by
    `finetune.load_run_config`."""
    tree, path = load_run_tree(name_or_path, overrides)
    return RunConfig.from_tree(tree, str(path))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """The validated `model:` section of a config file or preset."""
    return load_run_config(name_or_path).model


def list_presets() -> list[str]:
    """Names of the complete model presets (files starting with `_` are family bases)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if not p.stem.startswith("_"))
