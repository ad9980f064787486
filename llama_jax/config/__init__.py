"""Configuration: the typed, frozen schemas of a model (`model.py`) and of a training run
(`run.py`), the per-field checks they are built with (`fields.py`), and YAML files with `base:`
inheritance, presets and command-line overrides (`loading.py`). Configs are hashable, so they are
static arguments under `jax.jit`; every error is a `ConfigError` naming the file and the field.
The names below are the package's public surface.
"""

from llama_jax.dtypes import CACHE_DTYPES, DTYPES, cache_dtype_name, dtype_name
from llama_jax.config.loading import (CONFIG_DIR, list_presets, load_config_tree,
                                      load_model_config, load_run_tree, load_sections,
                                      resolve_config_path)
from llama_jax.config.model import (MOE, QUANTIZATIONS, REMAT_POLICIES, ROPE_SCALING_FIELDS,
                                    MlaConfig, ModelConfig, MoeConfig, RopeScaling,
                                    default_ffn_dim)
from llama_jax.config.run import (DEFAULT_CORPUS, DataConfig, LoraConfig, MeshConfig, RunConfig, TaskConfig,
                                  TrainConfig, parse_mesh)

__all__ = ["CACHE_DTYPES", "DTYPES", "cache_dtype_name", "dtype_name", "CONFIG_DIR",
           "list_presets", "load_config_tree", "load_model_config", "load_run_tree",
           "load_sections", "resolve_config_path", "MOE", "QUANTIZATIONS", "REMAT_POLICIES",
           "ROPE_SCALING_FIELDS", "MlaConfig", "ModelConfig", "MoeConfig", "RopeScaling",
           "default_ffn_dim", "DEFAULT_CORPUS", "DataConfig", "LoraConfig", "MeshConfig", "RunConfig",
           "TaskConfig", "TrainConfig", "parse_mesh"]
