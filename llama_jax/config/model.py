"""The model's schema: `ModelConfig`, a frozen, hashable dataclass validated on construction,
and its sections (`RopeScaling`, `MlaConfig`, `MoeConfig`).

A config is static under `jax.jit` (it is hashable), so shapes and code paths may depend on it.
Field names follow Meta's `params.json` where one exists (dim, n_layers, n_heads, n_kv_heads,
multiple_of, ffn_dim_multiplier, norm_eps, rope_theta); the dimension letters of the rest of the
code are exposed as read-only properties (D, L, N, K, G, H, F, V).

Each field declares what it accepts (`config.fields.setting`); `__post_init__` checks those
declarations, then the sections that belong to a kind, resolves every defaulted (None) field
in one place (`_resolve_defaults`), and checks the relations between fields.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Mapping

from llama_jax.config.fields import ROLES, build_section, check_keys, check_settings, setting
from llama_jax.dtypes import DTYPES, dtype_name
from llama_jax.errors import ConfigError, require
from llama_jax.nn.attention.dot_product import ATTENTION_IMPLS
from llama_jax.nn.attention.mixers import MIXERS
from llama_jax.nn.heads import HEADS
from llama_jax.nn.mlp import MLPS
from llama_jax.nn.moe import ROUTERS
from llama_jax.nn.norms import NORMS
from llama_jax.nn.positions import POSITIONS
from llama_jax.parallel import target
from llama_jax.quant import QUANTIZATIONS

# The choices of the component fields are their registries' names (nn/); these are the other
# fields' choices.
ROPE_TYPES = ("default", "llama3", "yarn")
MLA_DECODES = ("absorbed", "expanded")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "attention", "dots_with_attention")
NORM_POSITIONS = ("pre", "post")
MOE = "moe"  # the block MLP that routes tokens to expert MLPs (nn/moe.py), besides MLPS' kinds
MOE_DISPATCHES = ("auto", "capacity", "dropless")  # see nn/moe.py
POOLINGS = ("last", "mean")


def mlp_choices() -> tuple[str, ...]:
    return (*MLPS.names(), MOE)


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

    factor: float = setting(8.0, type="float", at_least=1,
                            doc="context extension factor")
    original_max_position_embeddings: int = setting(
        8192, type="int", above=0, doc="the context the model was trained at")
    low_freq_factor: float | None = setting(None, type="float", above=0, null=True,
                                            doc="llama3: wavelengths above original/low are "
                                                "divided by factor (default 1)")
    high_freq_factor: float | None = setting(None, type="float", null=True,
                                             doc="llama3: wavelengths below original/high are "
                                                 "kept; in between, interpolated (default 4)")
    beta_fast: float | None = setting(None, type="float", null=True,
                                      doc="yarn: rotations per context above which nothing "
                                          "changes (default 32)")
    beta_slow: float | None = setting(None, type="float", above=0, null=True,
                                      doc="yarn: rotations per context below which frequencies "
                                          "are divided by factor (default 1)")
    mscale: float | None = setting(None, type="float", at_least=0, null=True,
                                   doc="yarn: the temperature of cos/sin; 0: unset (default 0)")
    mscale_all_dim: float | None = setting(None, type="float", at_least=0, null=True,
                                           doc="yarn: ... and of the softmax scale (DeepSeek); "
                                               "0: unset (default 0)")

    def __post_init__(self):
        check_settings(self, "rope_scaling.")
        # llama3 divides by high - low; YaRN's ramp has a floor for an empty range
        for low, high, strict in (("low_freq_factor", "high_freq_factor", True),
                                  ("beta_slow", "beta_fast", False)):
            if getattr(self, low) is not None and getattr(self, high) is not None:
                ok = (getattr(self, high) > getattr(self, low) if strict
                      else getattr(self, high) >= getattr(self, low))
                require(ok, f"rope_scaling.{high}", getattr(self, high),
                        f"must be {'>' if strict else '>='} {low} ({getattr(self, low)})")

    def for_type(self, rope_type: str) -> "RopeScaling":
        """This scaling with `rope_type`'s fields defaulted; fields of another type refused."""
        for other, fields in ROPE_SCALING_FIELDS.items():
            for name in fields:
                value = getattr(self, name)
                require(other == rope_type or value is None, f"rope_scaling.{name}", value,
                        f"applies only to rope_type {other!r}, not {rope_type!r}")
        defaults = {name: default for name, default in ROPE_SCALING_FIELDS[rope_type].items()
                    if getattr(self, name) is None}
        return dataclasses.replace(self, **defaults)

    def to_dict(self) -> dict[str, Any]:
        """The fields that apply (those of the other type are None)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """The `mla:` section of `attention: mla` (nn/attention/mla.py): per token, the KV cache
    holds one latent of width kv_lora_rank and one RoPE key of width qk_rope_head_dim shared by
    all heads; each head's query and key have qk_nope_head_dim + qk_rope_head_dim features, its
    value v_head_dim. Defaults: DeepSeek-V2-Lite's attention."""

    q_lora_rank: int | None = setting(None, type="int", above=0, null=True,
                                      doc="queries through a latent of this width; null: a "
                                          "plain query projection")
    kv_lora_rank: int = setting(512, type="int", above=0,
                                doc="the cached latent's width (Z)")
    qk_nope_head_dim: int = setting(128, type="int", above=0,
                                    doc="query/key features per head without RoPE (J)")
    qk_rope_head_dim: int = setting(64, type="int", above=0,
                                    doc="query/key features per head with RoPE (I); even")
    v_head_dim: int = setting(128, type="int", above=0, doc="value features per head (Y)")

    def __post_init__(self):
        check_settings(self, "mla.")
        require(self.qk_rope_head_dim % 2 == 0, "mla.qk_rope_head_dim", self.qk_rope_head_dim,
                "must be even: RoPE rotates pairs of features")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The `moe:` section of `mlp: moe` (nn/moe.py): E routed experts of which each token uses
    top_k, plus always-on shared experts; the first `first_dense_layers` blocks keep a dense
    MLP of kind `expert_mlp` and width `ffn_dim`."""

    n_experts: int = setting(8, type="int", above=0, doc="routed experts (E)")
    top_k: int = setting(2, type="int", above=0, doc="experts per token")
    expert_mlp: str = setting("swiglu", type="str", choices=MLPS.names,
                              doc="the experts' (and the dense layers') MLP kind")
    expert_ffn_dim: int | None = setting(None, type="int", above=0, null=True,
                                         doc="an expert's hidden width (M); null: ffn_dim")
    n_shared_experts: int = setting(0, type="int", at_least=0,
                                    doc="always-on experts of the same kind, one MLP n_shared "
                                        "times as wide")
    router: str = setting("softmax", type="str", choices=ROUTERS.names,
                          doc="softmax over experts (Mixtral) | sigmoid per expert "
                              "(DeepSeek-V3)")
    normalize_top_k: bool = setting(True, type="bool",
                                    doc="the top_k weights renormalised to sum to 1")
    routed_scaling: float = setting(1.0, type="float", above=0,
                                    doc="the routed experts' sum times this (DeepSeek-V3: 2.5)")
    n_groups: int = setting(1, type="int", above=0,
                            doc="group-limited routing: experts in n_groups groups ...")
    top_k_groups: int = setting(1, type="int", above=0,
                                doc="... of which each token picks from its best top_k_groups")
    first_dense_layers: int = setting(0, type="int", at_least=0,
                                      doc="leading blocks with a dense MLP")
    capacity_factor: float | None = setting(None, type="float", above=0, null=True,
                                            doc="slots per expert / (tokens·top_k/E); "
                                                "null: dropless")
    aux_loss_weight: float = setting(0.01, type="float", at_least=0,
                                     doc="times the load-balancing loss (1 under uniform "
                                         "routing)")
    router_z_loss_weight: float = setting(0.0, type="float", at_least=0,
                                          doc="times mean(logsumexp(logits)^2)")
    bias_update_rate: float = setting(0.001, type="float", at_least=0,
                                      doc="sigmoid router: the selection bias moves by this much "
                                          "per step towards balance, outside the gradient "
                                          "(DeepSeek-V3's gamma); 0: frozen")

    def __post_init__(self):
        check_settings(self, "moe.")
        require(self.top_k <= self.n_experts, "moe.top_k", self.top_k,
                f"must be <= n_experts ({self.n_experts})")
        require(self.n_experts % self.n_groups == 0, "moe.n_groups", self.n_groups,
                f"must divide n_experts ({self.n_experts})")
        require(self.top_k_groups <= self.n_groups, "moe.top_k_groups", self.top_k_groups,
                f"must be <= n_groups ({self.n_groups})")
        if self.n_groups > 1:
            per_group = self.n_experts // self.n_groups
            require(self.top_k <= self.top_k_groups * per_group, "moe.top_k", self.top_k,
                    f"must be <= top_k_groups x experts per group "
                    f"({self.top_k_groups} x {per_group})")
            least = ROUTERS[self.router].min_group_size
            require(per_group >= least, "moe.n_groups", self.n_groups,
                    f"leaves {per_group} expert(s) per group; the {self.router} router scores "
                    f"a group by its {least} best experts")


class ChosenDtype(str):
    """A compute dtype that `compute_dtype: auto` chose for the platform being compiled for:
    the dtype's name (equal to it, hashed as it), marked as chosen rather than written."""


EXECUTION, GENERATION, INIT, NAMES = ROLES  # the non-architecture roles (config/fields.py)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder-only Transformer: LLaMA by default, the classic choices by config value.

    `ffn_dim` defaults to Meta's SwiGLU rule for gated MLPs and to 4·D for the others (see
    `default_ffn_dim`); `head_dim` to dim // n_heads. RoPE fields (`rope_theta`, `rope_type`,
    `rope_scaling`) apply only to `positions: rope` and default to 10000 / "default" there.
    """

    vocab_size: int = setting(type="int", above=0, doc="tokens in the vocabulary (V)")
    dim: int = setting(type="int", above=0, doc="model width (D)")
    n_layers: int = setting(type="int", above=0, doc="blocks (L)")
    n_heads: int = setting(type="int", above=0, doc="query heads (N)")
    n_kv_heads: int | None = setting(None, type="int", above=0, null=True,
                                     doc="key/value heads (K): n_heads is MHA, 1 MQA, between "
                                         "GQA; null: n_heads")
    head_dim: int | None = setting(None, type="int", above=0, null=True,
                                   doc="features per head (H); null: dim / n_heads (mla: "
                                       "qk_nope + qk_rope head dims)")
    attention: str = setting("gqa", type="str", choices=MIXERS.names,
                             doc="the mixer: gqa (MHA/GQA/MQA by n_kv_heads) | mla (latent KV, "
                                 "Multi-head Latent Attention)")
    mla: MlaConfig | None = setting(None, type="section", null=True,
                                    doc="the `mla:` section, with attention mla (null there: "
                                        "its defaults)")
    ffn_dim: int | None = setting(None, type="int", above=0, null=True,
                                  doc="MLP hidden width (F); null: `default_ffn_dim` for the "
                                      "MLP kind")
    multiple_of: int = setting(256, type="int", above=0, role=INIT,
                               doc="the default ffn_dim is rounded up to a multiple of this")
    ffn_dim_multiplier: float | None = setting(None, type="float", above=0, null=True,
                                               role=INIT,
                                               doc="the default ffn_dim times this (LLaMA 2 70B, "
                                                   "LLaMA 3)")
    norm: str = setting("rmsnorm", type="str", choices=NORMS.names,
                        doc="rmsnorm (LLaMA) | layernorm (mean, gain and bias)")
    norm_position: str = setting("pre", type="str", choices=NORM_POSITIONS,
                                 doc="pre: x + f(norm(x)), final norm | post: norm(x + f(x)), "
                                     "no final norm")
    norm_eps: float = setting(1e-5, type="float", above=0, doc="added to the variance")
    positions: str = setting("rope", type="str", choices=POSITIONS.names,
                             doc="rope | sinusoidal | learned (added to the embedding) | none")
    rope_theta: float | None = setting(None, type="float", above=0, null=True,
                                       doc="RoPE base; null: 10000 with rope")
    rope_type: str | None = setting(None, type="str", choices=ROPE_TYPES, null=True,
                                    doc="RoPE frequencies: default | llama3 | yarn (scaled); "
                                        "null: default with rope")
    rope_scaling: RopeScaling | None = setting(None, type="section", null=True,
                                               doc="the `rope_scaling:` section, given exactly "
                                                   "with a scaled rope_type")
    mlp: str = setting("swiglu", type="str", choices=mlp_choices,
                       doc="swiglu | geglu (gated, 3 matrices) | gelu | gelu_tanh | relu "
                           "(2 matrices) | moe")
    moe: MoeConfig | None = setting(None, type="section", null=True,
                                    doc="the `moe:` section, with mlp moe (null there: its "
                                        "defaults)")
    bias: bool = setting(False, type="bool",
                         doc="biases on the attention and MLP projections (GPT-2)")
    embed_scale: bool = setting(False, type="bool",
                                doc="token embeddings times √D (Vaswani et al.), before positions")
    max_seq_len: int = setting(2048, type="int", above=0,
                               doc="the longest context (learned positions' table size)")
    tie_embeddings: bool = setting(False, type="bool",
                                   doc="the LM head is the embedding table (LLaMA 3.2 1B/3B)")
    # What the final hidden states feed (nn/heads.py): the LM head, or a task head of n_labels
    # outputs (classes, or regression targets) that replaces it.
    head: str = setting("lm", type="str", choices=HEADS.names,
                        doc="lm | sequence_classification | token_classification | regression")
    n_labels: int | None = setting(None, type="int", above=0, null=True,
                                   doc="task heads: classes, or regression targets (O)")
    pooling: str | None = setting(None, type="str", choices=POOLINGS, null=True,
                                  doc="pooled heads: last (non-padding token) | mean; null: last")
    pad_id: int | None = setting(None, type="int", at_least=0, null=True,
                                 doc="task heads: the id that pads batches; null: no padding")
    label_names: tuple[str, ...] | None = setting(None, type="list", null=True, role=NAMES,
                                                  doc="task heads: the names of the n_labels "
                                                      "outputs")
    init_std: float = setting(0.02, type="float", above=0, role=INIT,
                              doc="standard deviation of the initial weights")
    param_dtype: str = setting("float32", type="dtype", role=EXECUTION,
                               doc="parameters (and optimizer master weights)")
    compute_dtype: str = setting("auto", type="dtype", role=EXECUTION,
                                 doc="activations and matmul inputs; auto: bfloat16 on TPUs "
                                     "and GPUs (fp32 master weights in param_dtype), float32 "
                                     "on CPUs (where bfloat16 is slower), by the platform "
                                     "compiled for")
    remat: str = setting("none", type="str", choices=REMAT_POLICIES, role=EXECUTION,
                         doc="what the backward pass recomputes: none | full | dots | "
                             "dots_no_batch | attention | dots_with_attention")
    loss_chunk: int | None = setting(None, type="int", above=0, null=True, role=EXECUTION,
                                     doc="the LM loss computes the logits of this many "
                                         "positions per row at a time (memory B x chunk x V "
                                         "instead of B x T x V); null: all at once")
    scan_layers: bool = setting(True, type="bool", role=EXECUTION,
                                doc="false unrolls the layer loop in training (compile time "
                                    "grows with L)")
    attention_impl: str = setting("auto", type="str", choices=ATTENTION_IMPLS, role=EXECUTION,
                                  doc="auto | xla (dense, memory quadratic in T) | chunked "
                                      "(blockwise, linear) | cudnn (NVIDIA GPUs) | splash (TPUs)")
    attention_block_q: int = setting(512, type="int", above=0, role=EXECUTION,
                                     doc="query block of chunked, cudnn and splash attention")
    attention_block_kv: int = setting(512, type="int", above=0, role=EXECUTION,
                                      doc="key/value block of chunked, cudnn and splash "
                                          "attention")
    moe_dispatch: str = setting("auto", type="str", choices=MOE_DISPATCHES, role=EXECUTION,
                                doc="capacity (fixed per-expert buffers) | dropless (sorted "
                                    "tokens, grouped matmuls) | auto (capacity with a "
                                    "capacity_factor)")
    mla_decode: str = setting("absorbed", type="str", choices=MLA_DECODES, role=EXECUTION,
                              doc="how MLA decodes a token: absorbed (scores against the cached "
                                  "latents) | expanded (keys and values rebuilt every step)")
    quantize: str | None = setting(None, type="str", choices=QUANTIZATIONS, null=True,
                                   role=EXECUTION,
                                   doc="int8: the blocks' matmul weights stored as int8 with a "
                                       "float32 scale per output channel, for inference; "
                                       "null: in param_dtype")
    quantize_head: bool = setting(False, type="bool", role=EXECUTION,
                                  doc="with quantize: the LM head and the embedding table too")
    eos_ids: tuple[int, ...] = setting((), type="list", role=GENERATION,
                                       doc="ids that end generation by default (from the "
                                           "tokenizer); ids outside the vocabulary are kept "
                                           "(and exported) but never stop generation")

    def __post_init__(self):
        # "auto" is chosen by the platform compiled for whenever the config is built (copies
        # included), and stays marked as chosen (`ChosenDtype`), so that a compile for another
        # platform chooses again (`for_platform`) and reports can say so.
        auto = self.compute_dtype == "auto" or isinstance(self.compute_dtype, ChosenDtype)
        if auto:
            object.__setattr__(self, "compute_dtype", target.default_compute_dtype())
        else:  # a bad value's error names "auto" among the choices
            dtype_name(self.compute_dtype, "compute_dtype", ("auto", *DTYPES))
        check_settings(self)
        if auto:
            object.__setattr__(self, "compute_dtype", ChosenDtype(self.compute_dtype))
        self._check_sections()
        self._resolve_defaults()
        self._check_relations()

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
        require(isinstance(getattr(self, name), cls), name, getattr(self, name),
                f"must be a mapping of {name} fields")
        return True

    def _check_sections(self) -> None:
        """`mla:` belongs to `attention: mla` and `moe:` to `mlp: moe` (which default them);
        MoE experts have no biases."""
        self._section("mla", MlaConfig, "attention", "mla")
        if self._section("moe", MoeConfig, "mlp", MOE):
            require(not self.bias, "bias", self.bias, "is not supported with mlp 'moe'")
            require(self.moe.first_dense_layers < self.n_layers, "moe.first_dense_layers",
                    self.moe.first_dense_layers, f"must be < n_layers ({self.n_layers})")

    def _resolve_defaults(self) -> None:
        """Every field whose null means "the default for this model" gets its value here."""
        resolve = functools.partial(object.__setattr__, self)
        if self.n_kv_heads is None:
            resolve("n_kv_heads", self.n_heads)
        if self.head_dim is None and self.mla is not None:
            resolve("head_dim", self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim)
        elif self.head_dim is None:
            require(self.dim % self.n_heads == 0, "n_heads", self.n_heads,
                    f"must divide dim ({self.dim}) unless head_dim is given")
            resolve("head_dim", self.dim // self.n_heads)
        if POSITIONS[self.positions].rotary:
            resolve("rope_theta", 10000.0 if self.rope_theta is None else self.rope_theta)
            resolve("rope_type", self.rope_type or "default")
        else:  # the RoPE defaults, which `dataclasses.replace` carries over, are cleared
            for name, default in (("rope_theta", 10000.0), ("rope_type", "default"),
                                  ("rope_scaling", None)):
                value = getattr(self, name)
                require(value in (None, default), name, value,
                        f"applies only to positions {self._rotary()}, not "
                        f"{self.positions!r}; remove it (or set it to null)")
                resolve(name, None)
        if HEADS[self.head].pooled:
            resolve("pooling", self.pooling or "last")
        if self.ffn_dim is None:
            resolve("ffn_dim", default_ffn_dim(self.dense_mlp, self.dim, self.multiple_of,
                                               self.ffn_dim_multiplier))
        require(isinstance(self.eos_ids, (list, tuple)), "eos_ids", self.eos_ids,
                "must be a list of token ids")
        resolve("eos_ids", tuple(self.eos_ids))
        if isinstance(self.label_names, list):
            resolve("label_names", tuple(self.label_names))

    @staticmethod
    def _rotary() -> str:
        return " or ".join(repr(name) for name in POSITIONS if POSITIONS[name].rotary)

    def _check_relations(self) -> None:
        MIXERS[self.attention].check_config(self)
        require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", self.n_kv_heads,
                f"must divide n_heads ({self.n_heads}): each KV head serves a whole group of "
                "query heads")
        if POSITIONS[self.positions].rotary:
            self._check_rope()
        self._check_head()
        if self.loss_chunk is not None:
            require(not HEADS[self.head].task, "loss_chunk", self.loss_chunk,
                    f"applies to the LM head's loss; a task head ({self.head}) has no "
                    "vocabulary to split")
        if self.quantize_head:
            require(self.quantize is not None, "quantize_head", self.quantize_head,
                    "needs quantize (e.g. quantize: int8)")
            require(not HEADS[self.head].task, "quantize_head", self.quantize_head,
                    f"applies to the LM head; a task head ({self.head}) stays in float")
        for token in self.eos_ids:
            require(isinstance(token, int) and not isinstance(token, bool), "eos_ids",
                    self.eos_ids, "must be a list of integer token ids")
        outside = [token for token in self.eos_ids if token not in self.stop_ids]
        if outside:
            # transformers loads such configs (its GPT-2 test configs pair vocab_size 512 with
            # the default eos_token_id 50256); a model can never emit these ids. One warning
            # per distinct message and process: the warnings module's default filter.
            warnings.warn(f"eos_ids {outside} are outside the vocabulary [0, vocab_size="
                          f"{self.vocab_size}): they are kept but never stop generation",
                          stacklevel=2)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The EOS ids a model can emit (those inside its vocabulary): the default stops."""
        return tuple(token for token in self.eos_ids if 0 <= token < self.vocab_size)

    def _check_rope(self) -> None:
        require(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
                "rope_scaling", self.rope_scaling, "must be a mapping of scaling fields")
        scaled = self.rope_type in ROPE_SCALING_FIELDS
        require(scaled == (self.rope_scaling is not None), "rope_scaling",
                self.rope_scaling, f"must be given exactly when rope_type is one of "
                f"{tuple(ROPE_SCALING_FIELDS)} (rope_type is {self.rope_type!r})")
        if scaled:
            object.__setattr__(self, "rope_scaling", self.rope_scaling.for_type(self.rope_type))

    def _check_head(self) -> None:
        """Task-head fields are refused with the LM head; a task head needs its output
        count, and pooling belongs to the pooled heads."""
        head = HEADS[self.head]
        if not head.task:
            for name in ("n_labels", "pooling", "pad_id", "label_names"):
                require(getattr(self, name) is None, name, getattr(self, name),
                        f"applies only to task heads, not head {self.head!r}; remove it")
            return
        require(self.n_labels is not None and self.n_labels >= head.min_labels, "n_labels",
                self.n_labels, f"must be an integer >= {head.min_labels} with head {self.head!r}")
        require(head.pooled or self.pooling is None, "pooling", self.pooling,
                f"applies only to heads {tuple(n for n in HEADS if HEADS[n].pooled)}; "
                "remove it")
        require(self.pad_id is None or self.pad_id < self.vocab_size, "pad_id", self.pad_id,
                f"must be a token id in [0, vocab_size={self.vocab_size})")
        if self.label_names is not None:
            require(isinstance(self.label_names, tuple)
                    and len(self.label_names) == self.n_labels
                    and all(isinstance(n, str) and n for n in self.label_names)
                    and len(set(self.label_names)) == len(self.label_names), "label_names",
                    self.label_names, f"must be {self.n_labels} distinct non-empty names")

    @property
    def names_of_labels(self) -> tuple[str, ...]:
        """The head's output names: `label_names`, or LABEL_0.. as transformers names them."""
        return self.label_names or tuple(f"LABEL_{i}" for i in range(self.n_labels or 0))

    @property
    def dense_mlp(self) -> str:
        """The kind of every dense MLP: `mlp`, or the MoE experts' kind (which its dense first
        layers and shared experts also use)."""
        return self.moe.expert_mlp if self.mlp == MOE else self.mlp

    @property
    def gated_mlp(self) -> bool:
        return MLPS[self.dense_mlp].gated

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe.expert_ffn_dim or self.ffn_dim

    @property
    def rope_dim(self) -> int:
        """The features of a head RoPE rotates: all of them, or MLA's qk_rope_head_dim."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def v_head_dim(self) -> int:
        """A head's value (and attention output) width: head_dim, or MLA's v_head_dim."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def dims(self) -> dict[str, int]:
        """Sizes by dimension letter, for `TensorSpec` shapes (E, M, U: with mlp moe; Z, Q, J,
        I, Y: with attention mla; O: with a task head)."""
        dims = {"V": self.V, "D": self.D, "N": self.N, "K": self.K, "H": self.H, "F": self.F,
                "P": self.max_seq_len, **({"O": self.n_labels} if self.n_labels else {})}
        if self.mla is not None:
            a = self.mla
            dims.update(Z=a.kv_lora_rank, J=a.qk_nope_head_dim, I=a.qk_rope_head_dim,
                        Y=a.v_head_dim, **({"Q": a.q_lora_rank} if a.q_lora_rank else {}))
        if self.moe is not None:
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
            require(roles.get(name) == "execution", name, settings[name],
                    "is not an execution setting")
        return dataclasses.replace(self, **settings)

    @property
    def compute_dtype_auto(self) -> bool:
        """Whether the compute dtype is the platform's choice (`compute_dtype: auto`)."""
        return isinstance(self.compute_dtype, ChosenDtype)

    def for_platform(self) -> "ModelConfig":
        """The config as built on the platform being compiled for (`parallel.target`): an
        automatic compute dtype chosen again for it; an explicit one kept."""
        return self.with_execution(compute_dtype="auto") if self.compute_dtype_auto else self

    # The dimension letters (docs/model.md), so code can say `config.K` where the math says K.
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
                check_keys(fields[name], section, f"{where}.{name}")
                fields[name] = build_section(section, fields[name], where)
        return build_section(cls, fields, where)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a YAML file (tuples become lists)."""
        out = {**dataclasses.asdict(self), "eos_ids": list(self.eos_ids)}
        out["compute_dtype"] = str(self.compute_dtype)  # the dtype it ran in, as plain data
        for section in ("moe", "mla"):  # a dense GQA model's file has neither section
            if getattr(self, section) is None:
                del out[section]
        if self.quantize is None:  # a float model's file is as before quantization existed
            del out["quantize"], out["quantize_head"]
        if not HEADS[self.head].task:  # a language model's file has no task-head fields
            for name in ("head", "n_labels", "pooling", "pad_id", "label_names"):
                del out[name]
        elif self.label_names is not None:
            out["label_names"] = list(self.label_names)
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_dict()
        return out


def default_ffn_dim(mlp: str, dim: int, multiple_of: int,
                    ffn_dim_multiplier: float | None) -> int:
    """The MLP width when `ffn_dim` is not given: the original Transformer's 4·D for the
    two-matrix MLPs, and 2/3 of it, int(2·4D/3), for the gated ones (Shazeer 2020), whose
    third matrix would otherwise add half the parameters — so every kind has ~8·D² weights per
    layer. Then times `ffn_dim_multiplier` and rounded up to `multiple_of` (Meta's rule)."""
    hidden = int(2 * 4 * dim / 3) if MLPS[mlp].gated else 4 * dim
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)
