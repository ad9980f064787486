"""Meta's original LLaMA checkpoints: `params.json` + `consolidated.NN.pth` (model-parallel shards).

`.pth` files are read with `torch.load(weights_only=True, mmap=True)`: tensors only, never
arbitrary pickled objects, and memory-mapped so shards are not loaded whole. Each shard holds a
slice of the column-parallel (wq, wk, wv, w1, w3, output) or row-parallel (wo, w2) weights; the
embedding is split along D in LLaMA 1/2 and along V in LLaMA 3. Instead of hard-coding which, the
split axis is the one along which the shards add up to the tensor's full shape.

FFN width follows Meta's rule from `dim`, `multiple_of`, `ffn_dim_multiplier`; `use_scaled_rope`
turns on llama3 rope scaling (factor `rope_scaling_factor`, default 8). Meta's params.json does
not record the context length: it is taken from `max_seq_len` if present, else from the family
(131072 with scaled RoPE, 8192 for rope_theta 500000, 4096 for norm_eps 1e-5, else 2048).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llama_jax.config import ModelConfig, RopeScaling
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.formats.loading import Loading, Placement, assemble
from llama_jax.formats.torch_layout import META, Slot, torch_pieces, torch_shape
from llama_jax.model.params import Params

PARAMS = "params.json"
SHARDS = "consolidated.*.pth"
_TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16",
                 "torch.float16": "float16"}


def is_meta(path: Path) -> bool:
    return (path / PARAMS).is_file() and any(path.glob(SHARDS))


def open_shards(path: Path) -> list[dict]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path}: reading Meta .pth checkpoints needs torch "
                              "(pip install 'llama_jax[meta]')") from None
    shards = []
    for file in sorted(path.glob(SHARDS)):
        try:
            shards.append(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:  # torch raises several types for truncated or unsafe pickles
            raise CheckpointError(f"{file}: not a readable tensor-only .pth file: {e}") from None
        if not isinstance(shards[-1], dict):
            raise CheckpointError(f"{file}: expected a state dict, got {type(shards[-1]).__name__}")
    return shards


def read_config(path: Path, shards: list[dict]) -> ModelConfig:
    file = path / PARAMS
    try:
        meta = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    vocab = meta.get("vocab_size", -1)
    if vocab is None or vocab <= 0:  # LLaMA 1/2 write -1 (the tokenizer decides): ask the weights
        vocab = _vocab_size(shards, meta.get("dim"))
    theta = float(meta.get("rope_theta", 10000.0))
    scaled = bool(meta.get("use_scaled_rope", False))
    eps = meta.get("norm_eps", 1e-5)
    default_context = (131072 if scaled else 8192 if theta == 500000.0 else
                       4096 if eps == 1e-5 else 2048)
    try:
        return ModelConfig(
            vocab_size=vocab, dim=meta["dim"], n_layers=meta["n_layers"], n_heads=meta["n_heads"],
            n_kv_heads=meta.get("n_kv_heads"), multiple_of=meta.get("multiple_of", 256),
            ffn_dim_multiplier=meta.get("ffn_dim_multiplier"), norm_eps=eps, rope_theta=theta,
            rope_type="llama3" if scaled else "default",
            rope_scaling=RopeScaling(factor=meta.get("rope_scaling_factor") or 8.0)
            if scaled else None,
            max_seq_len=meta.get("max_seq_len", default_context),
            tie_embeddings="output.weight" not in shards[0],
            eos_ids=_tokenizer_eos_ids(path))
    except KeyError as e:
        raise CheckpointError(f"{file}: missing field {e.args[0]!r}") from None
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None


def _tokenizer_eos_ids(path: Path) -> tuple[int, ...]:
    """Meta's params.json has no EOS ids; the tokenizer beside it does."""
    from llama_jax.data.tokenizer import TOKENIZER_FILE, load_tokenizer

    return load_tokenizer(path).eos_ids if (path / TOKENIZER_FILE).is_file() else ()


def _vocab_size(shards: list[dict], dim: int | None) -> int:
    """V from the LM head (always split along V) or, when tied, from the embedding (split along
    V when its shards are D wide, along D otherwise)."""
    if "output.weight" in shards[0]:
        return sum(s["output.weight"].shape[0] for s in shards)
    parts = [s["tok_embeddings.weight"].shape for s in shards]
    return sum(p[0] for p in parts) if parts[0][1] == dim else parts[0][0]


def gather(shards: list[dict], name: str, expected: tuple[int, ...], path: Path) -> np.ndarray:
    """Concatenates one tensor's model-parallel slices along the axis they split."""
    parts = [s.get(name) for s in shards]
    if any(p is None for p in parts):
        raise CheckpointError(f"{path}: tensor {name!r} missing from "
                              f"{len([p for p in parts if p is None])} of {len(parts)} shard(s)")
    shape = tuple(parts[0].shape)
    if shape == expected:  # replicated (norms) or a single shard
        return _numpy(parts[0])
    for axis in range(len(expected)):
        if (sum(p.shape[axis] for p in parts) == expected[axis]
                and all(tuple(p.shape[:axis]) + tuple(p.shape[axis + 1:])
                        == expected[:axis] + expected[axis + 1:] for p in parts)):
            return np.concatenate([_numpy(p) for p in parts], axis=axis)
    raise CheckpointError(f"{path}: tensor {name!r} has shard shape {shape} x {len(parts)} "
                          f"shard(s), which does not assemble to {expected} from {path / PARAMS}")


def _numpy(t) -> np.ndarray:
    return t.float().numpy() if str(t.dtype) != "torch.float32" else t.numpy()


def load(path: Path, loading: Loading,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    shards = open_shards(path)
    config = read_config(path, shards)
    stored = _TORCH_DTYPES.get(str(shards[0]["tok_embeddings.weight"].dtype), "float32") \
        if "tok_embeddings.weight" in shards[0] else "float32"
    config = loading.config(config, stored, path)
    # Shards are re-opened for each leaf: dropping the previous mmaps releases the file pages
    # already read, so resident memory holds the weights once, not the weights plus the files.
    opened = {"leaf": None, "shards": shards}

    def read(slot: Slot, name: str) -> np.ndarray:
        if opened["leaf"] not in (None, slot.tree_path):
            opened["shards"] = None
            opened["shards"] = open_shards(path)
        opened["leaf"] = slot.tree_path
        return gather(opened["shards"], name, torch_shape(slot), path)

    del shards
    return config, assemble(config, torch_pieces(config, read, META),
                            np.dtype(config.param_dtype), placement)
