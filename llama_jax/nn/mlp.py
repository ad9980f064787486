"""The position-wise MLP, of kind `config.dense_mlp` (`mlp`, or the MoE experts' kind),
registered in `MLPS` (`mlp: moe`, the block's other choice, is nn/moe.py).

- gated (GLU family, Shazeer 2020): `W_down · (act(W_gate · x) ⊙ (W_up · x))` — swiglu (SiLU,
  LLaMA) and geglu (exact GELU); three matrices.
- plain: `W_down · act(W_up · x)` — relu (Vaswani et al. 2017), gelu (exact erf form, Hendrycks
  & Gimpel 2016) and gelu_tanh (their tanh approximation, GPT-2's `gelu_new`); two matrices.

With `config.bias`, every projection adds a bias. The default widths keep the parameter count
equal across kinds (see `config.default_ffn_dim`). `ffn_specs` / `ffn` are the same MLP for
any hidden-width letter and any leading axes: the MoE experts (nn/moe.py) stack E of them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp

from llama_jax.nn.lora import is_lora
from llama_jax.nn.ops import fenced, linear
from llama_jax.nn.registry import Registry
from llama_jax.parallel import target
from llama_jax.parallel.sharding import active_mesh, constrain
from llama_jax.quant import is_int8
from llama_jax.spec import bias, weight

if TYPE_CHECKING:
    from llama_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Mlp:
    """A dense MLP kind: its activation, and whether it is gated (a third matrix, W_gate,
    whose activation multiplies W_up's output). The tensors, the function, the FLOPs (from the
    matrices) and the memory terms (`saved_widths`) follow from these two."""

    activation: Callable[[jax.Array], jax.Array]
    gated: bool

    def saved_widths(self) -> dict[str, int]:
        """Hidden-width (F) activations per token the backward pass keeps, by remat policy:
        gated, gate, up and their product (two of them matmul outputs); plain, up and its
        activation (one)."""
        return {"none": 3, "dots": 2} if self.gated else {"none": 2, "dots": 1}


MLPS: Registry[Mlp] = Registry("mlp")
MLPS.register("swiglu", Mlp(jax.nn.silu, gated=True))
MLPS.register("geglu", Mlp(lambda x: jax.nn.gelu(x, approximate=False), gated=True))
MLPS.register("gelu", Mlp(lambda x: jax.nn.gelu(x, approximate=False), gated=False))
MLPS.register("gelu_tanh", Mlp(lambda x: jax.nn.gelu(x, approximate=True), gated=False))
MLPS.register("relu", Mlp(jax.nn.relu, gated=False))


def ffn_specs(dims: dict[str, int], kind: str, width: str, residual_scale: float,
              lead: tuple[tuple[str, str], ...] = ()) -> dict:
    """The matrices of one MLP of `kind` with hidden width letter `width`, each with leading
    axes `lead` ((letter, logical axis) pairs). `residual_scale` shrinks the init of W_down,
    which writes into the residual stream."""
    letters = "".join(letter for letter, _ in lead)
    axes = tuple(axis for _, axis in lead)
    specs = {"w_up": weight(dims, f"{letters}D{width}", (*axes, "embed", "mlp"), contract="D"),
             "w_down": weight(dims, f"{letters}{width}D", (*axes, "mlp", "embed"),
                              residual_scale, contract=width)}
    if MLPS[kind].gated:
        specs["w_gate"] = weight(dims, f"{letters}D{width}", (*axes, "embed", "mlp"),
                                 contract="D")
    return specs


def mlp_specs(config: ModelConfig, residual_scale: float) -> dict:
    dims = config.dims
    specs = ffn_specs(dims, config.dense_mlp, "F", residual_scale)
    if config.bias:
        specs.update(b_up=bias(dims, "F", ("mlp",)), b_down=bias(dims, "D", ("norm",)))
        if config.gated_mlp:
            specs["b_gate"] = bias(dims, "F", ("mlp",))
    return specs


def ffn(kind: str, p: dict, x, up, down, bias_of=lambda name: None,
        recomputed: bool | None = None, merged: bool = False):
    """One MLP of `kind` on x, its matmuls by `up(x, w, b)` into the hidden width and
    `down(h, w, b)` out of it (plain, batched per expert, or grouped), with biases
    `bias_of(name)`. `recomputed` (a `down` that closes over no array: whether the remat
    policy recomputes the up matmuls in the backward pass) runs a gated MLP's hidden state
    and W_down under one backward rule (`_glu_down`). `merged`: a gated MLP's gate and up
    matmuls run as one, over both matrices side by side (float ones, unsplit by a mesh)."""
    mlp = MLPS[kind]
    if merged:
        gate, up_x = _gate_and_up(p, x, up, bias_of)
    else:  # up before gate: in the other order XLA:CPU plans a training step's buffers apart
        up_x = up(x, p["w_up"], bias_of("b_up"))
        if not mlp.gated:
            return down(mlp.activation(up_x).astype(x.dtype), p["w_down"], bias_of("b_down"))
        gate = up(x, p["w_gate"], bias_of("b_gate"))
    if recomputed is None:
        hidden = _glu(mlp.activation, gate, up_x).astype(x.dtype)
        return down(hidden, p["w_down"], bias_of("b_down"))
    return _glu_down(mlp.activation, down, recomputed, gate, up_x, p["w_down"],
                     bias_of("b_down"))


# Tokens up to which a GPU runs a gated MLP's gate and up as one matmul (`_merges`): below
# ~295 (an H100's 989 TFLOP/s of bf16 over its 3.35 TB/s), a matmul reads its weights longer
# than it computes with them.
MERGED_ROWS = 256
# Remat policies under which a block's up matmuls run again in the backward pass
RECOMPUTING = ("full", "attention")


def apply_mlp(config: ModelConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    """The dense MLP (also the MoE's shared experts: the same kind, their width from `p`)."""
    return ffn(config.dense_mlp, p, x_BTD, _dense_up, _dense_down, p.get,
               recomputed=config.remat in RECOMPUTING, merged=_merges(p, x_BTD))


def _gate_and_up(p: dict, x, up, bias_of):
    """A gated MLP's gate and up projections by one `up` over `[W_gate | W_up]`."""
    F = p["w_up"].shape[-1]
    biases = (bias_of("b_gate"), bias_of("b_up"))
    both = up(x, jnp.concatenate((p["w_gate"], p["w_up"]), axis=-1),
              None if biases[0] is None else jnp.concatenate(biases, axis=-1))
    return both[..., :F], both[..., F:]


def _merges(p: dict, x_BTD: jax.Array) -> bool:
    """Whether a dense gated MLP's gate and up run as one matmul (`ffn(merged=True)`): on a
    GPU, for at most `MERGED_ROWS` tokens (a decode step's or verify pass's), its float
    matrices whole on one device. XLA:GPU reads the two matrices side by side inside the GEMM
    (no copy is made; its dot merger does the same for q, k and v) but merges two dots itself
    only where one of them is small (k and v are), and LLaMA-3 8B's gate and up are 112 MiB
    each: merged, a decode step launches one kernel a layer fewer. A training step's gradient
    would come back as one matrix to split (XLA:GPU's clock: LLaMA-3.2 1B's step 0.5%
    slower); on a mesh splitting their width, the concatenation would move them."""
    mesh = active_mesh()
    return ("w_gate" in p and target.platform() == "gpu"
            and x_BTD.shape[0] * x_BTD.shape[1] <= MERGED_ROWS
            and not any(is_int8(p[w]) or is_lora(p[w]) for w in ("w_gate", "w_up"))
            and (mesh is None or mesh.size == 1))


def _dense_up(x_BTD: jax.Array, w_DF, b_F) -> jax.Array:
    return constrain(linear("BTD,DF->BTF", x_BTD, w_DF, b_F), ("batch", "seq", "mlp"))


def _dense_down(h_BTF: jax.Array, w_FD, b_D) -> jax.Array:
    return linear("BTF,FD->BTD", h_BTF, w_FD, b_D)


# The gated MLP's backward pass as one elementwise pass of its own: both gradients (and, under
# `_glu_down`, the hidden state for W_down's gradient) from the gate, up and incoming gradient,
# written once. Left to itself, XLA:TPU fuses pieces of that pass into the matmuls around it,
# recomputing the activation and its derivative per matmul tile (LLaMA-3 8B's training step on
# XLA:TPU's clock: 1.5 ms a layer more; `ops.fenced`). The values are autodiff's.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _glu(activation: Callable[[jax.Array], jax.Array], gate: jax.Array,
         up: jax.Array) -> jax.Array:
    """`activation(gate) * up`, the gated MLP's hidden state."""
    return fenced(activation(gate) * up)


def _glu_forward(activation, gate, up):
    return _glu(activation, gate, up), (gate, up)


def _glu_backward(activation, residuals, d_hidden):
    return fenced(_gated_grads(activation, *fenced((*residuals, d_hidden)))[1:])


_glu.defvjp(_glu_forward, _glu_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _glu_down(activation, down, recomputed: bool, gate, up, w, b):
    """`down(activation(gate) * up, w, b)`. Its backward pass writes the hidden state beside
    both gradients instead of recomputing it for W_down's gradient (under full remat, in the
    up matmul's epilogue: 0.6 ms a layer of LLaMA-3 8B on XLA:TPU's clock). Where the up
    matmuls run again in the backward pass (`recomputed`), their outputs are fenced too, else
    XLA fuses the pass into them; where they were saved, fencing them would copy them out of
    the saved layers' stack."""
    return down(fenced(activation(gate) * up), w, b)


def _glu_down_forward(activation, down, recomputed, gate, up, w, b):
    return _glu_down(activation, down, recomputed, gate, up, w, b), (gate, up, w, b)


def _glu_down_backward(activation, down, recomputed, residuals, d_y):
    gate, up, w, b = residuals
    _, pull_hidden = jax.vjp(lambda h: down(h, w, b), gate)  # linear in h: its value unused
    (d_hidden,) = pull_hidden(d_y)
    if recomputed:
        gate, up, d_hidden = fenced((gate, up, d_hidden))
    else:
        d_hidden = fenced(d_hidden)
    hidden, d_gate, d_up = fenced(_gated_grads(activation, gate, up, d_hidden))
    _, pull_weights = jax.vjp(lambda w, b: down(hidden, w, b), w, b)
    return (d_gate, d_up, *pull_weights(d_y))


_glu_down.defvjp(_glu_down_forward, _glu_down_backward)


def _gated_grads(activation, gate, up, d_hidden):
    """(hidden state, d gate, d up): the callers fence the ones they use."""
    activated, pull = jax.vjp(activation, gate)
    return activated * up, pull(d_hidden * up)[0], d_hidden * activated
