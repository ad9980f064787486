"""How PyTorch checkpoints (Hugging Face's, Meta's) store llama_jax parameters: a name table
per model family, and the shapes, names and conversions both ways derived from it.

A checkpoint family is chosen by the model's architecture (`family_of`):

- Llama (HF `LlamaForCausalLM`, Meta's consolidated .pth): RMSNorm, RoPE, SwiGLU, no biases.
  Both ecosystems store `nn.Linear` weights as [out, in] and embeddings as [V, D]; llama_jax
  stores [in..., out...] with head axes explicit (`wq: [D, N, H]`, `wo: [N, H, D]`), so a
  Linear weight becomes ours by a transpose and a reshape. The only other difference is RoPE's
  layout: Meta's q/k projection rows pair features (2i, 2i+1) of each head, HF's and ours pair
  (i, i + H/2). Loading Meta weights permutes those rows per head — with the KV head count K
  for wk, which is where GQA ports have gone wrong.
- GPT-2 (HF `GPT2LMHeadModel`): pre-LayerNorm, learned positions, a GELU (or ReLU) MLP, biases
  everywhere, multi-head attention. Its projections are `Conv1D`s, stored [in, out] — already
  our order, so a reshape and no transpose. Queries, keys and values are one fused `c_attn`
  tensor ([D, 3D], bias [3D]): each of wq, wk, wv (bq, bk, bv) is one equal third of it along
  the out axis (a `part` of the stored tensor). There are no Meta checkpoints of GPT-2.

A table entry (`TorchTensor`) says how one of our tensors is stored; everything else — shapes,
splitting and joining fused tensors, the conversions both ways — is derived here, once.
Reading yields each leaf's pieces in our layout; building the leaves from them, in a dtype or
quantized and onto a mesh, is the formats' shared loading (loading.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from llama_jax.config import ModelConfig
from llama_jax.errors import CheckpointError
from llama_jax.nn.heads import HEADS
from llama_jax.quant import as_float
from llama_jax.spec import TensorSpec
from llama_jax.model.params import Params, flat_paths, layer_groups, param_specs

if TYPE_CHECKING:
    from llama_jax.formats.loading import Pieces

# How a stored tensor holds ours, and the stored axis of its output features (along which a
# fused tensor's parts lie side by side): "same" is our shape (embeddings, norms, position
# tables); "linear" is nn.Linear's [out, in]; "conv1d" is GPT-2's Conv1D [in, out]; "flat" a
# vector (GPT-2's per-head biases [N·H]).
OUT_AXIS = {"same": None, "linear": 0, "conv1d": 1, "flat": 0}


@dataclasses.dataclass(frozen=True)
class TorchTensor:
    """How one of our tensors is stored in PyTorch checkpoints. `path` is its place in the
    parameter tree — relative to the block for per-layer tensors ("attn/wq"), from the root
    otherwise ("embed/table")."""

    path: str
    hf: str  # Hugging Face name; "{i}" is the layer index
    meta: str | None = None  # Meta name; None: the family has no Meta checkpoints
    stored: str = "same"  # a key of OUT_AXIS
    in_axes: int = 0  # linear / conv1d: how many of our leading axes (after L) form `in`
    # Rows of RoPE features stored interleaved (adjacent pairs) by the `interleaved` format:
    # per head of this config attribute ("N", "K"; "1": one head).
    rope_heads: str = ""
    interleaved: str = "meta"  # the Layout.rope that interleaves them: "meta" or "hf" (DeepSeek)
    # A fused stored tensor holds several of ours side by side along its out axis: their
    # widths by dimension letter, repeated per head of `fused_heads` ("" = once); ours is
    # the `part`-th. GPT-2's c_attn: ("D", "D", "D"); DeepSeek's kv_b_proj: ("J", "Y") per "N".
    fused: tuple[str, ...] = ()
    fused_heads: str = ""
    part: int = 0
    per_expert: bool = False  # our leading E axis is stored as one tensor per expert ("{e}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checkpoint format's conventions: whose names its tensors carry and whose q/k row order
    it keeps ("hf" or "meta" each; rows are interleaved where `rope` is the tensor's
    `interleaved`)."""

    names: str
    rope: str


HF = Layout("hf", "hf")
META = Layout("meta", "meta")
# llama.cpp's converter renames HF's tensors one to one, and permutes q/k rows to Meta's order
GGUF = Layout("hf", "meta")


def _llama_layer(path: str, hf: str, meta: str, in_axes: int = 0, rope_heads: str = ""):
    return TorchTensor(path, "model.layers.{i}." + hf, "layers.{i}." + meta,
                       "linear" if in_axes else "same", in_axes, rope_heads)


# Llama's tensors: every tensor of a Llama-architecture parameter tree, by path.
LLAMA = {t.path: t for t in (
    TorchTensor("embed/table", "model.embed_tokens.weight", "tok_embeddings.weight"),
    TorchTensor("final_norm/scale", "model.norm.weight", "norm.weight"),
    TorchTensor("lm_head/w", "lm_head.weight", "output.weight", "linear", 1),
    _llama_layer("attn_norm/scale", "input_layernorm.weight", "attention_norm.weight"),
    _llama_layer("attn/wq", "self_attn.q_proj.weight", "attention.wq.weight", 1, "N"),
    _llama_layer("attn/wk", "self_attn.k_proj.weight", "attention.wk.weight", 1, "K"),
    _llama_layer("attn/wv", "self_attn.v_proj.weight", "attention.wv.weight", 1),
    _llama_layer("attn/wo", "self_attn.o_proj.weight", "attention.wo.weight", 2),
    _llama_layer("mlp_norm/scale", "post_attention_layernorm.weight", "ffn_norm.weight"),
    _llama_layer("mlp/w_gate", "mlp.gate_proj.weight", "feed_forward.w1.weight", 1),
    _llama_layer("mlp/w_up", "mlp.up_proj.weight", "feed_forward.w3.weight", 1),
    _llama_layer("mlp/w_down", "mlp.down_proj.weight", "feed_forward.w2.weight", 1),
    # A task head in place of the LM head (LlamaForSequenceClassification and
    # LlamaForTokenClassification call it `score`; only the latter has a bias). Meta's format
    # has language models only.
    TorchTensor("head/w", "score.weight", None, "linear", 1),
    TorchTensor("head/b", "score.bias"),
)}


def _mixtral_expert(path: str, w: str):
    return TorchTensor(path, f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight",
                       stored="linear", in_axes=1, per_expert=True)


# Mixtral's tensors (MixtralForCausalLM's names as saved, also by transformers 5, which fuses
# the experts in memory only): Llama's attention and norms, a router and one SwiGLU MLP per
# expert with Meta's w1 (gate), w3 (up), w2 (down) names.
MIXTRAL = {**{path: t for path, t in LLAMA.items() if not path.startswith("mlp/")}, **{
    t.path: t for t in (
        TorchTensor("mlp/router", "model.layers.{i}.block_sparse_moe.gate.weight",
                    stored="linear", in_axes=1),
        _mixtral_expert("mlp/experts/w_gate", "w1"),
        _mixtral_expert("mlp/experts/w_up", "w3"),
        _mixtral_expert("mlp/experts/w_down", "w2"),
    )}}
MIXTRAL = {path: dataclasses.replace(t, meta=None) for path, t in MIXTRAL.items()}


def _gpt2_layer(path: str, hf: str, stored: str = "same", in_axes: int = 0, part: int = 0,
                fused: tuple[str, ...] = ()):
    return TorchTensor(path, "transformer.h.{i}." + hf, None, stored, in_axes, part=part,
                       fused=fused)


def _fused(paths: tuple[str, ...], hf: str, stored: str, in_axes: int = 0):
    """Our tensors `paths`, stored side by side in one tensor in that order (N·H = D each)."""
    return [_gpt2_layer(path, hf, stored, in_axes, i, ("D",) * len(paths))
            for i, path in enumerate(paths)]


# GPT-2's tensors (GPT2LMHeadModel's names), by path.
GPT2 = {t.path: t for t in (
    TorchTensor("embed/table", "transformer.wte.weight"),
    TorchTensor("positions/table", "transformer.wpe.weight"),
    TorchTensor("final_norm/scale", "transformer.ln_f.weight"),
    TorchTensor("final_norm/bias", "transformer.ln_f.bias"),
    TorchTensor("lm_head/w", "lm_head.weight", stored="linear", in_axes=1),  # the head is Linear
    _gpt2_layer("attn_norm/scale", "ln_1.weight"),
    _gpt2_layer("attn_norm/bias", "ln_1.bias"),
    *_fused(("attn/wq", "attn/wk", "attn/wv"), "attn.c_attn.weight", "conv1d", 1),
    *_fused(("attn/bq", "attn/bk", "attn/bv"), "attn.c_attn.bias", "flat"),
    _gpt2_layer("attn/wo", "attn.c_proj.weight", "conv1d", 2),
    _gpt2_layer("attn/bo", "attn.c_proj.bias"),
    _gpt2_layer("mlp_norm/scale", "ln_2.weight"),
    _gpt2_layer("mlp_norm/bias", "ln_2.bias"),
    _gpt2_layer("mlp/w_up", "mlp.c_fc.weight", "conv1d", 1),
    _gpt2_layer("mlp/b_up", "mlp.c_fc.bias"),
    _gpt2_layer("mlp/w_down", "mlp.c_proj.weight", "conv1d", 1),
    _gpt2_layer("mlp/b_down", "mlp.c_proj.bias"),
)}


def _deepseek_layer(path: str, hf: str, in_axes: int = 0, **fields):
    return TorchTensor(path, "model.layers.{i}." + hf, None, "linear" if in_axes else "same",
                       in_axes, **fields)


def _deepseek_query(hf: str) -> list[TorchTensor]:
    """Each head's query rows: position-free features, then RoPE features (interleaved)."""
    fused = dict(fused=("J", "I"), fused_heads="N")
    return [_deepseek_layer("attn/wq_nope", hf, 1, part=0, **fused),
            _deepseek_layer("attn/wq_rope", hf, 1, part=1, rope_heads="N", interleaved="hf",
                            **fused)]


def _deepseek_experts(path: str, hf: str) -> TorchTensor:
    return _deepseek_layer(f"mlp/experts/{path}", f"mlp.experts.{{e}}.{hf}.weight", 1,
                           per_expert=True)


# DeepSeek-V2/V3's tensors (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; experts per expert as
# saved): Llama's embeddings, norms and dense MLPs, MLA's projections (W_DKV and W_KR fused in
# kv_a_proj_with_mqa, W_UK and W_UV per head in kv_b_proj; RoPE rows interleaved, as DeepSeek
# trained them: transformers turns them to halves at run time), the MoE's router and its
# selection bias (V3's e_score_correction_bias), routed and shared experts.
DEEPSEEK = {**{path: dataclasses.replace(t, meta=None) for path, t in LLAMA.items()
               if not path.startswith("attn/")}, **{t.path: t for t in (
    _deepseek_layer("attn/wq_a", "self_attn.q_a_proj.weight", 1),
    _deepseek_layer("attn/q_norm", "self_attn.q_a_layernorm.weight"),
    *_deepseek_query("self_attn.q_b_proj.weight"),
    _deepseek_layer("attn/w_dkv", "self_attn.kv_a_proj_with_mqa.weight", 1, part=0,
                    fused=("Z", "I")),
    _deepseek_layer("attn/w_kr", "self_attn.kv_a_proj_with_mqa.weight", 1, part=1,
                    fused=("Z", "I"), rope_heads="1", interleaved="hf"),
    _deepseek_layer("attn/kv_norm", "self_attn.kv_a_layernorm.weight"),
    _deepseek_layer("attn/w_uk", "self_attn.kv_b_proj.weight", 1, part=0, fused=("J", "Y"),
                    fused_heads="N"),
    _deepseek_layer("attn/w_uv", "self_attn.kv_b_proj.weight", 1, part=1, fused=("J", "Y"),
                    fused_heads="N"),
    _deepseek_layer("attn/wo", "self_attn.o_proj.weight", 2),
    _deepseek_layer("mlp/router", "mlp.gate.weight", 1),
    _deepseek_layer("mlp/selection_bias", "mlp.gate.e_score_correction_bias"),
    _deepseek_experts("w_gate", "gate_proj"),
    _deepseek_experts("w_up", "up_proj"),
    _deepseek_experts("w_down", "down_proj"),
    _deepseek_layer("mlp/shared/w_gate", "mlp.shared_experts.gate_proj.weight", 1),
    _deepseek_layer("mlp/shared/w_up", "mlp.shared_experts.up_proj.weight", 1),
    _deepseek_layer("mlp/shared/w_down", "mlp.shared_experts.down_proj.weight", 1),
)}}
# V2-Lite's form: a plain query projection instead of the query latent
DEEPSEEK_PLAIN_QUERY = {**DEEPSEEK,
                        **{t.path: t for t in _deepseek_query("self_attn.q_proj.weight")}}


@dataclasses.dataclass(frozen=True)
class Family:
    """The models one name table stores: those whose architecture fields take the values
    `requires(config)` allows (field -> allowed values)."""

    name: str
    model_type: str  # Hugging Face's config.json model_type
    table: Callable[[ModelConfig], dict[str, TorchTensor]]  # the names of config's tensors
    requires: Callable[[ModelConfig], dict[str, tuple]]
    base_prefix: str = ""  # what a save of the bare base model (GPT2Model) leaves off names
    buffers: tuple[str, ...] = ()  # name suffixes of non-parameter tensors some saves include
    # Layers numbered from n_layers on hold modules outside the model, which loading skips
    # (DeepSeek-V3's release stores its multi-token-prediction module as layer 61).
    extra_layers: bool = False

    def skipped(self, name: str, config: ModelConfig) -> bool:
        """Whether a stored tensor that is not one of the model's may be left unread."""
        if name.endswith(self.buffers):
            return True
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return self.extra_layers and layer is not None and int(layer[1]) >= config.n_layers

    def mismatches(self, config: ModelConfig) -> list[str]:
        """The fields of `config` this family cannot store, each with what it would need
        (`moe.router`: a field of a section)."""
        def value(field: str):
            section, _, name = field.rpartition(".")
            return getattr(getattr(config, section) if section else config, name)
        return [f"{field}={value(field)!r} should be {' or '.join(repr(v) for v in allowed)}"
                for field, allowed in self.requires(config).items()
                if value(field) not in allowed]


def _llama_like(mlp: str, attention: str = "gqa", heads: tuple = ("lm",)) -> dict[str, tuple]:
    return {"norm": ("rmsnorm",), "norm_position": ("pre",), "positions": ("rope",),
            "mlp": (mlp,), "bias": (False,), "embed_scale": (False,),
            "attention": (attention,), "rope_type": ("default", "llama3"), "head": heads}


def _mixtral(config: ModelConfig) -> dict[str, tuple]:
    """Mixtral's MoE: softmax top-k renormalised, SwiGLU experts, nothing else routed. (Its
    inference is dropless; a capacity factor is a training choice the checkpoint does not
    carry.)"""
    if config.mlp != "moe":
        return _llama_like("moe")
    return {**_llama_like("moe"), "moe.expert_mlp": ("swiglu",), "moe.router": ("softmax",),
            "moe.normalize_top_k": (True,), "moe.routed_scaling": (1.0,),
            "moe.n_shared_experts": (0,), "moe.n_groups": (1,), "moe.first_dense_layers": (0,),
            "moe.expert_ffn_dim": (None, config.ffn_dim)}


def _deepseek(router: str):
    """MLA with a dense SwiGLU MLP or an MoE of SwiGLU experts routed by `router`: softmax
    scores unnormalised (DeepSeek-V2 ignores norm_topk_prob) or sigmoid scores (V3)."""
    def requires(config: ModelConfig) -> dict[str, tuple]:
        out = {**_llama_like("moe", "mla"), "mlp": ("swiglu", "moe"),
               "rope_type": ("default", "yarn")}
        if config.mlp == "moe":
            out.update({"moe.expert_mlp": ("swiglu",), "moe.router": (router,)})
            if router == "softmax":
                out["moe.normalize_top_k"] = (False,)
        return out
    return requires


FAMILIES = (
    # Llama stores the task heads too (transformers' Llama*Classification); the others the LM
    # head only.
    Family("Llama", "llama", lambda c: LLAMA, lambda c: _llama_like("swiglu", heads=HEADS.names()),
           buffers=("rotary_emb.inv_freq",)),  # recomputed; some older exports saved it
    Family("Mixtral", "mixtral", lambda c: MIXTRAL, _mixtral, buffers=("rotary_emb.inv_freq",)),
    # c_attn holds q, k, v as equal thirds of D: multi-head attention over the whole width.
    Family("GPT-2", "gpt2", lambda c: GPT2,
           lambda c: {"norm": ("layernorm",), "norm_position": ("pre",),
                      "positions": ("learned",), "mlp": ("gelu_tanh", "gelu", "relu"),
                      "bias": (True,), "embed_scale": (False,), "n_kv_heads": (c.n_heads,),
                      "dim": (c.n_heads * c.head_dim,), "attention": ("gqa",),
                      "head": ("lm",)},
           base_prefix="transformer.",
           buffers=(".attn.bias", ".attn.masked_bias")),  # causal masks of older saves
    # V3 first: it also stores dense MLA models (every layer dense), and its sigmoid router
    # is DeepSeek's current one.
    *(Family(name, model_type,
             lambda c: DEEPSEEK if c.mla and c.mla.q_lora_rank else DEEPSEEK_PLAIN_QUERY,
             _deepseek(router), buffers=("rotary_emb.inv_freq",), extra_layers=True)
      for name, model_type, router in (("DeepSeek-V3", "deepseek_v3", "sigmoid"),
                                       ("DeepSeek-V2", "deepseek_v2", "softmax"))),
)


def family_of(config: ModelConfig) -> Family:
    """The family whose checkpoints can hold `config`'s model; an error naming the fields that
    keep it from each family otherwise."""
    reasons = []
    for family in FAMILIES:
        mismatches = family.mismatches(config)
        if not mismatches:
            return family
        reasons.append(f"As {family.name}: {', '.join(mismatches)}")
    raise CheckpointError(
        f"this checkpoint format stores {' or '.join(f.name for f in FAMILIES)} models only, "
        f"and this model is neither. {'. '.join(reasons)}.")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One of our tensors: where it goes in our tree and how it is stored."""

    tree_path: str  # "groups/0/attn/wq"
    tensor: TorchTensor
    spec: TensorSpec
    layers: range  # checkpoint layer indices of a stacked leaf (empty for the others)
    # the tensor's letters resolved for the config: the fused parts' widths, the heads they
    # repeat over, and the heads of interleaved RoPE rows (0: none)
    fused: tuple[int, ...] = ()
    fused_heads: int = 1
    rope_heads: int = 0

    def rope_interleaved(self, layout: Layout) -> bool:
        """Whether a format of `layout` stores this tensor's RoPE rows interleaved."""
        return bool(self.rope_heads) and layout.rope == self.tensor.interleaved

    @property
    def pieces(self) -> list[dict[str, int]]:
        """The stored tensors that make up the leaf, as the indices their names are formatted
        with ({i}: layer, {e}: expert), in the leaf's row-major order: one per layer of a
        stacked leaf, times one per expert of a per-expert one, or a single one."""
        pieces = [{"i": i} for i in self.layers] or [{}]
        if not self.tensor.per_expert:
            return pieces
        n_experts = self.spec.shape[1 if self.layers else 0]
        return [{**piece, "e": e} for piece in pieces for e in range(n_experts)]

    @property
    def shape(self) -> tuple[int, ...]:
        """Our shape of one piece: a layer's (and an expert's) slice, or the whole leaf."""
        shape = self.spec.shape[1:] if self.layers else self.spec.shape
        return shape[1:] if self.tensor.per_expert else shape


def slots(config: ModelConfig) -> list[Slot]:
    """Every tensor of `config`'s parameter tree, matched with its description in the table of
    the model's family (`family_of`)."""
    table = family_of(config).table(config)
    offsets = np.cumsum([0] + [g.n_layers for g in layer_groups(config)])
    dims = {**config.dims, "1": 1}
    out = []
    for tree_path, spec in flat_paths(param_specs(config)).items():
        parts = tree_path.split("/")
        stacked = parts[0] == "groups"
        key = "/".join(parts[2:]) if stacked else tree_path
        layers = (range(offsets[int(parts[1])], offsets[int(parts[1]) + 1]) if stacked
                  else range(0))
        tensor = table[key]
        out.append(Slot(tree_path, tensor, spec, layers,
                        fused=tuple(dims[letter] for letter in tensor.fused),
                        fused_heads=dims.get(tensor.fused_heads, 1),
                        rope_heads=dims.get(tensor.rope_heads, 0)))
    return out


def torch_shape(slot: Slot) -> tuple[int, ...]:
    """The shape of the stored tensor that holds `slot` (all of it, when fused)."""
    tensor, shape = slot.tensor, slot.shape
    if tensor.stored == "same":
        return shape
    if tensor.stored == "flat":
        stored = [math.prod(shape)]
    else:
        in_out = [math.prod(shape[:tensor.in_axes]), math.prod(shape[tensor.in_axes:])]
        stored = in_out[::-1] if tensor.stored == "linear" else in_out
    if slot.fused:
        stored[OUT_AXIS[tensor.stored]] = (stored[OUT_AXIS[tensor.stored]]
                                           // slot.fused[tensor.part] * sum(slot.fused))
    return tuple(stored)


def interleaved_to_half(w: np.ndarray, heads: int) -> np.ndarray:
    """Interleaved RoPE rows (head, 2i + j) → half-split rows (head, j·H/2 + i)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def half_to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def from_torch(slot: Slot, w: np.ndarray, layout: Layout) -> np.ndarray:
    """One stored tensor (torch layout) → our layout for that leaf (one layer's slice); of a
    fused tensor, the slot's part."""
    tensor = slot.tensor
    if slot.fused:
        w = _split_part(slot, w)
    if slot.rope_interleaved(layout):
        w = interleaved_to_half(w, slot.rope_heads)
    if tensor.stored == "linear":
        w = w.T
    return w.reshape(slot.shape)


def to_torch(slot: Slot, a: np.ndarray, layout: Layout) -> np.ndarray:
    """Inverse of `from_torch`: our slice → a contiguous tensor in HF (or Meta) layout (the
    slot's part only, for a fused tensor: see `torch_tensors`)."""
    tensor = slot.tensor
    if tensor.stored == "flat":
        a = a.reshape(-1)
    elif tensor.stored != "same":
        a = a.reshape(math.prod(a.shape[:tensor.in_axes]), -1)
        if tensor.stored == "linear":
            a = a.T
    if slot.rope_interleaved(layout):
        a = half_to_interleaved(a, slot.rope_heads)
    return np.ascontiguousarray(a)


def _split_part(slot: Slot, w: np.ndarray) -> np.ndarray:
    """The slot's part of a fused stored tensor: per head, its rows of the out axis."""
    axis, widths = OUT_AXIS[slot.tensor.stored], slot.fused
    rows = np.moveaxis(w, axis, 0)
    per_head = rows.reshape(slot.fused_heads, sum(widths), *rows.shape[1:])
    start = sum(widths[:slot.tensor.part])
    part = per_head[:, start:start + widths[slot.tensor.part]]
    return np.moveaxis(part.reshape(-1, *rows.shape[1:]), 0, axis)


def _join_parts(slot: Slot, parts: list[np.ndarray]) -> np.ndarray:
    """Inverse of `_split_part` over all the parts of a fused tensor, in order."""
    axis = OUT_AXIS[slot.tensor.stored]
    per_head = [np.moveaxis(p, axis, 0).reshape(slot.fused_heads, -1, *p.shape[:axis],
                                                *p.shape[axis + 1:]) for p in parts]
    rows = np.concatenate(per_head, axis=1)
    return np.ascontiguousarray(np.moveaxis(rows.reshape(-1, *rows.shape[2:]), 0, axis))


def names(slot: Slot, layout: Layout = HF) -> list[str]:
    """The checkpoint name of each of a slot's pieces (`Slot.pieces`)."""
    name = slot.tensor.meta if layout.names == "meta" else slot.tensor.hf
    if name is None:
        raise CheckpointError(f"tensor {slot.tree_path} has no name in Meta's format, which "
                              "stores Llama models only")
    return [name.format(**piece) for piece in slot.pieces]


def stored_tensors(config: ModelConfig, layout: Layout = HF
                   ) -> dict[str, list[tuple[Slot, int]]]:
    """Checkpoint name → the (slot, index among its pieces) it holds — several, in part order,
    for a fused tensor — in the order of our tree (a fused tensor where its first part is)."""
    out: dict[str, list[tuple[Slot, int]]] = {}
    for slot in slots(config):
        for j, name in enumerate(names(slot, layout)):
            out.setdefault(name, []).append((slot, j))
    return {name: sorted(parts, key=lambda part: part[0].tensor.part)
            for name, parts in out.items()}


Reader = Callable[[Slot, str], np.ndarray]  # (slot, checkpoint name) -> the stored tensor


def torch_pieces(config: ModelConfig, read: Reader, layout: Layout) -> dict[str, Pieces]:
    """Every leaf's pieces in our layout, by path (for `loading.assemble`): each stored tensor
    is read by `read(slot, name)` (in torch layout, shape-checked by the reader; a fused tensor
    once per part) when the leaf's iterator reaches it, so one piece is in memory at a time."""
    return {slot.tree_path: (slot.shape, _pieces(slot, read, layout)) for slot in slots(config)}


def _pieces(slot: Slot, read: Reader, layout: Layout) -> Iterator[np.ndarray]:
    for name in names(slot, layout):
        yield from_torch(slot, read(slot, name), layout)


def torch_tensors(config: ModelConfig, params: Params, layout: Layout = HF
                  ) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, tensor) in torch layout for every stored tensor, one at a time (for
    writers); a fused tensor is joined from its parts, an int8 one dequantized to float32."""
    leaves = flat_paths(params, whole_int8=True)

    def part(slot: Slot, j: int) -> np.ndarray:
        leaf = leaves[slot.tree_path]
        lead = leaf.shape[:len(leaf.shape) - len(slot.shape)]  # (layers, experts) of a piece
        piece = leaf[tuple(int(i) for i in np.unravel_index(j, lead))] if lead else leaf
        return to_torch(slot, np.asarray(as_float(piece, np.float32)), layout)

    for name, parts in stored_tensors(config, layout).items():
        tensors = [part(slot, j) for slot, j in parts]
        yield name, tensors[0] if len(tensors) == 1 else _join_parts(parts[0][0], tensors)
