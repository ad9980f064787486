"""The position-wise MLP, selected by `config.mlp`.

- gated (GLU family, Shazeer 2020): `W_down · (act(W_gate · x) ⊙ (W_up · x))` — swiglu (SiLU,
  LLaMA) and geglu (exact GELU); three matrices.
- plain: `W_down · act(W_up · x)` — relu (Vaswani et al. 2017), gelu (exact erf form, Hendrycks
  & Gimpel 2016) and gelu_tanh (their tanh approximation, GPT-2's `gelu_new`); two matrices.

With `config.bias`, every projection adds a bias. The default widths keep the parameter count
equal across kinds (see `config.default_ffn_dim`).
"""

from __future__ import annotations

import jax

from llama_jax.config import ModelConfig
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


def mlp_specs(config: ModelConfig, residual_scale: float) -> dict:
    """`residual_scale` shrinks the init of W_down, which writes into the residual stream."""
    dims = config.dims
    specs = {"w_up": weight(dims, "DF", ("embed", "mlp")),
             "w_down": weight(dims, "FD", ("mlp", "embed"), residual_scale)}
    if config.gated_mlp:
        specs["w_gate"] = weight(dims, "DF", ("embed", "mlp"))
    if config.bias:
        specs.update(b_up=bias(dims, "F", ("mlp",)), b_down=bias(dims, "D", ("norm",)))
        if config.gated_mlp:
            specs["b_gate"] = bias(dims, "F", ("mlp",))
    return specs


def apply_mlp(config: ModelConfig, p: dict, x_BTD: jax.Array) -> jax.Array:
    act = ACTIVATIONS[config.mlp]
    up_BTF = linear("BTD,DF->BTF", x_BTD, p["w_up"], p.get("b_up"))
    if config.gated_mlp:
        hidden_BTF = act(linear("BTD,DF->BTF", x_BTD, p["w_gate"], p.get("b_gate"))) * up_BTF
    else:
        hidden_BTF = act(up_BTF)
    hidden_BTF = constrain(hidden_BTF, ("batch", "seq", "mlp"))
    return linear("BTF,FD->BTD", hidden_BTF, p["w_down"], p.get("b_down"))

