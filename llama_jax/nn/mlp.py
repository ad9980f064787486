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

from llama_jax.nn.ops import fenced, linear
from llama_jax.nn.registry import Registry
from llama_jax.parallel.sharding import constrain
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


def ffn(kind: str, p: dict, x, up, down, bias_of=lambda name: None):
    """One MLP of `kind` on x, its matmuls by `up(x, w, b)` into the hidden width and
    `down(h, w, b)` out of it (plain, batched per expert, or grouped), with biases
    `bias_of(name)`."""
    up_x, mlp = up(x, p["w_up"], bias_of("b_up")), MLPS[kind]
    if mlp.gated:
        hidden = _glu(mlp.activation, up(x, p["w_gate"], bias_of("b_gate")), up_x)
    else:
        hidden = mlp.activation(up_x)
    return down(hidden.astype(x.dtype), p["w_down"], bias_of("b_down"))


def apply_mlp(config: ModelConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    """The dense MLP (also the MoE's shared experts: the same kind, their width from `p`)."""
    def up(x_BTD, w_DF, b_F):
        return constrain(linear("BTD,DF->BTF", x_BTD, w_DF, b_F), ("batch", "seq", "mlp"))

    def down(h_BTF, w_FD, b_D):
        return linear("BTF,FD->BTD", h_BTF, w_FD, b_D)
    return ffn(config.dense_mlp, p, x_BTD, up, down, p.get)



@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _glu(activation: Callable[[jax.Array], jax.Array], gate: jax.Array,
         up: jax.Array) -> jax.Array:
    """`activation(gate) * up`, the gated MLP's hidden state, with its backward pass as one
    elementwise pass of its own: both gradients from the gate, up and incoming gradient,
    written once. Left to itself, XLA:TPU fuses pieces of that pass into the matmuls around
    it, recomputing the activation and its derivative per matmul tile (LLaMA-3 8B's training
    step on XLA:TPU's clock: 1.5 ms a layer more; `ops.fenced`). The values are autodiff's."""
    return fenced(activation(gate) * up)


def _glu_forward(activation, gate, up):
    return _glu(activation, gate, up), (gate, up)


def _glu_backward(activation, residuals, d_hidden):
    gate, up, d_hidden = fenced((*residuals, d_hidden))
    activated, pull = jax.vjp(activation, gate)
    return fenced((pull(d_hidden * up)[0], d_hidden * activated))


_glu.defvjp(_glu_forward, _glu_backward)
