"""llama_jax: the LLaMA family (1, 2, 3, 3.1, 3.2) as small pure JAX functions.

Public API:
    ModelConfig, RopeScaling, ConfigError, load_model_config  -- configuration
    Params, LayerParams, init_params, param_specs            -- parameter pytrees
    forward, hidden_states                                   -- the model
    load_checkpoint, export_hf, save_native, CheckpointError -- HF / Meta / native checkpoints
    load_tokenizer                                           -- SentencePiece and LLaMA-3 tokenizers
    generate, stream, GenerateError                          -- jit-compiled sampling with a KV cache
"""

from llama_jax.checkpoint import export_hf, load_checkpoint, save_native
from llama_jax.config import ConfigError, ModelConfig, RopeScaling, load_model_config
from llama_jax.model import forward, hidden_states
from llama_jax.decoder import GenerateError, generate, stream
from llama_jax.formats import CheckpointError
from llama_jax.params import LayerParams, Params, init_params, param_specs
from llama_jax.tokenizer import load_tokenizer

__all__ = [
    "ConfigError", "ModelConfig", "RopeScaling", "load_model_config",
    "Params", "LayerParams", "init_params", "param_specs",
    "forward", "hidden_states",
    "load_checkpoint", "export_hf", "save_native", "CheckpointError", "load_tokenizer",
    "generate", "stream", "GenerateError",
]
