"""llama_jax: the LLaMA family (1, 2, 3, 3.1, 3.2) as small pure JAX functions.

Public API:
    ModelConfig, MoeConfig, MlaConfig, RopeScaling, ConfigError, load_model_config
                                                              -- model configuration
    RunConfig, TrainConfig, DataConfig, MeshConfig, load_run_config -- training runs (a
                                                              fine-tuning run's model is read
                                                              from its init_from checkpoint)
    Params, init_params, param_specs, abstract_params        -- the parameter tree
    forward, hidden_states, apply                            -- the model (LM or task head)
    load_checkpoint, export_hf, save_native, CheckpointError -- HF / Meta / native checkpoints
    load_tokenizer                                           -- SentencePiece and LLaMA-3 tokenizers
    generate, stream, GenerateError                          -- jit-compiled sampling with a KV cache
    train, TrainingError                                      -- the training loop (train.py)
    TaskConfig                                                -- downstream tasks (finetune.py)
    score, perplexity, Score, Perplexity, ScoreError          -- zero-shot log-likelihood scoring
    make_mesh                                                 -- a device mesh from a MeshConfig
"""

from llama_jax.checkpoint import export_hf, load_checkpoint, save_native
from llama_jax.config import (ConfigError, DataConfig, MeshConfig, MlaConfig, ModelConfig,
                              MoeConfig, RopeScaling, RunConfig, TaskConfig, TrainConfig,
                              load_model_config)
from llama_jax.model import apply, forward, hidden_states
from llama_jax.decoder import GenerateError, generate, stream
from llama_jax.eval.scoring import Perplexity, Score, ScoreError, perplexity, score
from llama_jax.finetune import load_run_config
from llama_jax.formats import CheckpointError
from llama_jax.params import Params, abstract_params, init_params, param_specs
from llama_jax.sharding import make_mesh
from llama_jax.tokenizer import load_tokenizer
from llama_jax.trainer import TrainingError, train

__all__ = [
    "ConfigError", "ModelConfig", "MoeConfig", "MlaConfig", "RopeScaling", "load_model_config",
    "Params", "init_params", "param_specs", "abstract_params",
    "forward", "hidden_states", "apply",
    "load_checkpoint", "export_hf", "save_native", "CheckpointError", "load_tokenizer",
    "generate", "stream", "GenerateError",
    "RunConfig", "TrainConfig", "DataConfig", "MeshConfig", "load_run_config", "train",
    "TrainingError", "make_mesh", "TaskConfig",
    "score", "perplexity", "Score", "Perplexity", "ScoreError",
]
