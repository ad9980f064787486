"""llama_jax: the LLaMA family (1, 2, 3, 3.1, 3.2) as small pure JAX functions.

Public API:
    ModelConfig, RopeScaling, ConfigError, load_model_config  -- configuration
    Params, LayerParams, init_params, param_specs            -- parameter pytrees
    forward, hidden_states                                   -- the model
"""

from llama_jax.config import ConfigError, ModelConfig, RopeScaling, load_model_config
from llama_jax.model import forward, hidden_states
from llama_jax.params import LayerParams, Params, init_params, param_specs

__all__ = [
    "ConfigError", "ModelConfig", "RopeScaling", "load_model_config",
    "Params", "LayerParams", "init_params", "param_specs",
    "forward", "hidden_states",
]
