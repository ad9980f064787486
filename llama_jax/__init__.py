"""llama_jax: the LLaMA family (1, 2, 3, 3.1, 3.2) and its architecture variants as small pure
JAX functions over parameter pytrees, for pretraining, sampling and ablations.

Packages, in layer order: a package imports only from those before it (`tests/test_layout.py`
checks this, imports under `typing.TYPE_CHECKING` aside):

    errors, dtypes, files,     small shared leaves: the error classes (one base, `UserError`),
    spec, quant, cli,          dtype names, atomic file writes, tensor descriptions, int8
    xla_flags, gguf_file,      tensors, the CLIs' error exit, the XLA flags set on GPU, GGUF
    shapes                     files opened (their weights, vocabulary and chat template),
                               the shape buckets programs are compiled for
    parallel                   device meshes, logical-axis sharding rules, multi-host start-up,
                               a device's free memory, the platform compiled for, named
                               TPU / GPU topologies
    nn                         the components, each kind registered once: norms, positions,
                               MLPs, MoE routers, attention mixers, heads
    config                     the model and run schemas (component choices from nn's
                               registries), YAML files, presets
    model                      parameters, the forward pass, the KV cache
    data                       tokenizers, corpora, batches, task datasets
    formats                    checkpoints: HF, Meta, GGUF, native, run directories; conversion
    plan                       costs, memory, hardware peaks, the planner CLI (`plan.info`)
    decode                     sampling and jit-compiled generation
    training                   the optimizer, the train step, the training loop, fine-tuning
    eval                       log-likelihood scoring, perplexity, lm-eval, `predict`
    serve                      the OpenAI-compatible server: continuous batching, the API
    aot                        programs compiled for TPU slices and GPU nodes this host does
                               not have, and what the compiler says of their memory
    research                   ablation studies, the demo downstream task

The names below are the public API. They load on first use, so `import llama_jax` stays
light: the trainer's and the data pipeline's dependencies (grain, orbax, tqdm) load with them.
On an NVIDIA GPU the import also adds the library's XLA flags to `XLA_FLAGS`, keeping any the
user set (`llama_jax.xla_flags`).
"""

import importlib
import sys

from llama_jax.errors import ConfigError
from llama_jax.xla_flags import set_gpu_flags

try:
    set_gpu_flags()  # now, before JAX starts a backend: XLA reads XLA_FLAGS once
except ConfigError as e:  # the process's environment is wrong: one line, as the CLIs print
    sys.exit(f"error: {e}")

# public name -> the module that defines it
_API = {
    "UserError": "errors", "ConfigError": "errors", "CheckpointError": "errors",
    "DataError": "errors", "GenerateError": "errors", "ScoreError": "errors",
    "TrainingError": "errors",
    "ModelConfig": "config", "MoeConfig": "config", "MlaConfig": "config",
    "RopeScaling": "config", "RunConfig": "config", "TrainConfig": "config",
    "DataConfig": "config", "MeshConfig": "config", "TaskConfig": "config",
    "LoraConfig": "config",
    "load_model_config": "config",
    "Params": "model.params", "init_params": "model.params", "param_specs": "model.params",
    "abstract_params": "model.params",
    "forward": "model.transformer", "hidden_states": "model.transformer",
    "apply": "model.transformer",
    "load_checkpoint": "formats.checkpoint", "export_hf": "formats.checkpoint",
    "save_native": "formats.checkpoint",
    "load_tokenizer": "data.tokenizer", "load_chat_template": "data.chat_template",
    "ChatTemplate": "data.chat_template", "checkpoint_config": "formats.checkpoint",
    "generate": "decode.generate", "stream": "decode.generate",
    "load_run_config": "training.finetune", "train": "training.trainer",
    "make_mesh": "parallel.sharding",
    "compile_training": "aot.training",
    "score": "eval.scoring", "perplexity": "eval.scoring", "Score": "eval.scoring",
    "Perplexity": "eval.scoring",
}
__all__ = list(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'llama_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"llama_jax.{_API[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
