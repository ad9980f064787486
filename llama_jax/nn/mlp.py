"""The position-wise MLP, of kind `config.dense_mlp` (`mlp`, or the MoE experts' kind).

- gated (GLU family, Shazeer 2020): `W_down · (act(W_gate · x) ⊙ (W_up · x))` — swiglu (SiLU,
  LLaMA) and geglu (exact GELU); three matrices.
- plain: `W_down · act(W_up · x)` — relu (Vaswani et al. 2017), gelu (exact erf form, Hendrycks
  & Gimpel 2016) and gelu_tanh (their tanh approximation, GPT-2's `gelu_new`); two matrices.

With `config.bias`, every projection adds a bias. The default widths keep the parameter count
equal across kinds (see `config.default_ffn_dim`). `ffn_specs` / `ffn` are the same MLP for
any hidden-width letter and any leading axes: the MoE experts (nn/moe.py) stack E of them.
"""

from __future__ import annotations

import jax

from llama_jax.config import GATED_MLPS, ModelConfig
from llama_jax.nn.ops import linear
from llama_jax.nn.spec import bias, weight
from llama_jax.sharding import constrain

ACTIVATIONS = {
    "swiglu": jax.nn.silu,
    "geglu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def ffn_specs(dims: dict[str, int], kind: str, width: str, residual_scale: float,
              lead: tuple[tuple[str, str], ...] = ()) -> dict:
    """The matrices of one MLP of `kind` with hidden width letter `width`, each with leading
    axes `lead` ((letter, logical axis) pairs). `residual_scale` shrinks the init of W_down,
    which writes into the residual stream."""
    letters = "".join(letter for letter, _ in lead)
    axes = tuple(axis for _, axis in lead)
    specs = {"w_up": weight(dims, f"{letters}D{width}", (*axes, "embed", "mlp")),
             "w_down": weight(dims, f"{letters}{width}D", (*axes, "mlp", "embed"),
                              residual_scale)}
    if kind in GATED_MLPS:
        specs["w_gate"] = weight(dims, f"{letters}D{width}", (*axes, "embed", "mlp"))
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
    up_x = up(x, p["w_up"], bias_of("b_up"))
    if kind in GATED_MLPS:
        hidden = ACTIVATIONS[kind](up(x, p["w_gate"], bias_of("b_gate"))) * up_x
    else:
        hidden = ACTIVATIONS[kind](up_x)
    return down(hidden.astype(x.dtype), p["w_down"], bias_of("b_down"))


def apply_mlp(config: ModelConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    """The dense MLP (also the MoE's shared experts: the same kind, their width from `p`)."""
    def up(x_BTD, w_DF, b_F):
        return constrain(linear("BTD,DF->BTF", x_BTD, w_DF, b_F), ("batch", "seq", "mlp"))

    def down(h_BTF, w_FD, b_D):
        return linear("BTF,FD->BTD", h_BTF, w_FD, b_D)
    return ffn(config.dense_mlp, p, x_BTD, up, down, p.get)
