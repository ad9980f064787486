"""GGUF files (llama.cpp, Ollama, LM Studio): one file with the weights — often quantized in
blocks — the architecture's settings and the tokenizer.

Read with the `gguf` package (llama.cpp's own reader and its numpy dequantizers), tensor by
tensor from a memory map, so the host holds one dequantized tensor at a time. Every tensor type
`gguf` can dequantize loads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K to
Q6_K, ...), to the target dtype or, with `quantize="int8"`, to our int8.

A LLaMA-architecture GGUF stores Meta's tensors under other names: `[out, in]` matrices, and
attn_q / attn_k rows with each head's RoPE features interleaved (llama.cpp's converter permutes
Hugging Face's half-split rows back to Meta's order). So the file is read as a Meta checkpoint
whose names are translated (`GGUF_NAMES`), and loading undoes the interleaving as it does for
Meta's files. `general.architecture` other than llama is refused, naming the file and the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from llama_jax.config import ModelConfig
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.gguf_file import metadata, open_file
from llama_jax.formats.loading import Loading, Placement, assemble
from llama_jax.formats.torch_layout import (Slot, family_of, torch_pieces, torch_shape,
                                            torch_tensors)
from llama_jax.model.params import Params

ARCHITECTURE = "general.architecture"

# Meta's names (torch_layout's `meta` names) -> GGUF's, layer index as \1.
GGUF_NAMES = (
    (r"tok_embeddings\.weight", "token_embd.weight"),
    (r"norm\.weight", "output_norm.weight"),
    (r"output\.weight", "output.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"blk.\1.attn_norm.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", r"blk.\1.attn_q.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", r"blk.\1.attn_k.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", r"blk.\1.attn_v.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"blk.\1.attn_output.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"blk.\1.ffn_gate.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"blk.\1.ffn_up.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"blk.\1.ffn_down.weight"),
)
# The dtype a file's float tensors hold (quantized ones dequantize to float32)
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_name(meta_name: str) -> str:
    """The GGUF name of the tensor Meta's checkpoints call `meta_name`."""
    for pattern, replacement in GGUF_NAMES:
        if re.fullmatch(pattern, meta_name):
            return re.sub(pattern, replacement, meta_name)
    raise CheckpointError(f"tensor {meta_name!r} has no name in GGUF's LLaMA architecture")


def read_config(path: Path, reader) -> ModelConfig:
    """The model's config from the file's `llama.*` keys."""
    kv = metadata(reader)
    architecture = kv.get(ARCHITECTURE)
    if architecture != "llama":
        raise CheckpointError(f"{path}: {ARCHITECTURE} is {architecture!r}; llama_jax reads "
                              "GGUF files of the llama architecture")
    if kv.get("llama.expert_count"):
        raise CheckpointError(f"{path}: llama.expert_count={kv['llama.expert_count']}: "
                              "mixture-of-experts GGUF files are not read yet")
    tensors = {t.name for t in reader.tensors}
    if "llama.rope.scaling.type" in kv or "rope_freqs.weight" in tensors:
        raise CheckpointError(f"{path}: RoPE scaling (llama.rope.scaling.type or a rope_freqs "
                              "tensor) is not read yet")

    def key(name: str, default: Any = KeyError):
        if f"llama.{name}" in kv:
            return kv[f"llama.{name}"]
        if default is KeyError:
            raise CheckpointError(f"{path}: missing key 'llama.{name}'")
        return default

    n_heads = key("attention.head_count")

    def decimal(name: str, default: float) -> float:
        """A float32 key as the shortest decimal that is that float32 (1e-05, not
        9.99999974e-06), so a config written and read back is the same."""
        return float(str(np.float32(key(name, default))))

    dim = key("embedding_length")
    vocab = key("vocab_size", None) or len(kv.get("tokenizer.ggml.tokens") or ()) or \
        _rows(reader, "token_embd.weight")
    eos = [kv[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in kv]
    try:
        return ModelConfig(
            vocab_size=int(vocab), dim=dim, n_layers=key("block_count"), n_heads=n_heads,
            n_kv_heads=key("attention.head_count_kv", n_heads),
            head_dim=key("attention.key_length", None), ffn_dim=key("feed_forward_length"),
            norm_eps=decimal("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=decimal("rope.freq_base", 10000.0),
            max_seq_len=key("context_length", 2048),
            tie_embeddings="output.weight" not in tensors,
            eos_ids=tuple(dict.fromkeys(int(i) for i in eos)))
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _rows(reader, name: str) -> int:
    for t in reader.tensors:
        if t.name == name:
            return int(t.shape[-1])  # GGUF lists dimensions innermost first
    return 0


def stored_dtype(reader) -> str:
    """The float dtype the file's weights are held in: that of its token embedding when it is
    a float tensor, else float32 (what quantized blocks dequantize to)."""
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return _FLOAT_TYPES.get(t.tensor_type.name, "float32")
    return "float32"


def dequantized(path: Path, tensor) -> np.ndarray:
    """One tensor as float32 in numpy's order (GGUF's dimensions reversed)."""
    from gguf import quants

    try:
        w = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} has type "
                              f"{tensor.tensor_type.name}, which the gguf package cannot "
                              "dequantize") from None
    return np.asarray(w, np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def load(path: Path, loading: Loading,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    reader = open_file(path)
    config = read_config(path, reader)
    family_of(config)
    tensors = {t.name: t for t in reader.tensors}
    config = loading.config(config, stored_dtype(reader), path)

    def read(slot: Slot, meta_name: str) -> np.ndarray:
        name = gguf_name(meta_name)
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        w = dequantized(path, tensors[name])
        if w.shape != torch_shape(slot):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {w.shape}, expected "
                                  f"{torch_shape(slot)} from the file's llama.* keys")
        return w

    return config, assemble(config, torch_pieces(config, read, meta=True),
                            np.dtype(config.param_dtype), placement)


# What `save` writes matrices as (`convert --to gguf --dtype`); vectors are always F32, and a
# matrix whose rows do not split into Q8_0's blocks of 32 falls back to F16, as in llama.cpp
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
_Q8_BLOCK = 32


def save(config: ModelConfig, params: Params, path: Path, file_type: str = "f16",
         tokenizer=None, chat_template: str | None = None) -> None:
    """Writes a LLaMA-architecture model as one GGUF file at `path` (which must not exist),
    its matrices as `file_type`, with `tokenizer`'s vocabulary and the chat template when
    given: a file llama.cpp, Ollama and `load_checkpoint` read."""
    import gguf

    _check_writable(config, file_type, path)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[file_type]
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_architecture(writer, config)
    if tokenizer is not None:  # its BOS and EOS ids with it
        from llama_jax.data.gguf_vocab import add_vocabulary
        add_vocabulary(writer, tokenizer, path)
    else:
        for eos in config.eos_ids[:1]:
            writer.add_eos_token_id(eos)
    if chat_template:
        writer.add_chat_template(chat_template)
    for meta_name, w in torch_tensors(config, params, meta=True):
        w = np.asarray(w, np.float32)
        kind = gguf.GGMLQuantizationType.F32 if w.ndim == 1 else qtype
        if kind == gguf.GGMLQuantizationType.Q8_0 and w.shape[-1] % _Q8_BLOCK:
            kind = gguf.GGMLQuantizationType.F16
        writer.add_tensor(gguf_name(meta_name), gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _check_writable(config: ModelConfig, file_type: str, path: Path) -> None:
    if file_type not in GGUF_TYPES:
        raise CheckpointError(f"{path}: GGUF type {file_type!r} is not one of "
                              f"{', '.join(GGUF_TYPES)}")
    if family_of(config).model_type != "llama" or config.head != "lm":
        raise CheckpointError(f"{path}: only LLaMA-architecture language models are written as "
                              "GGUF")
    if config.rope_scaling is not None or config.quantize is not None:
        raise CheckpointError(f"{path}: RoPE scaling and int8 weights are not written as GGUF "
                              "yet (load the model without quantize)")


def _add_architecture(writer, config: ModelConfig) -> None:
    """The `llama.*` keys `read_config` reads back."""
    for add, value in ((writer.add_block_count, config.n_layers),
                       (writer.add_context_length, config.max_seq_len),
                       (writer.add_embedding_length, config.dim),
                       (writer.add_feed_forward_length, config.F),
                       (writer.add_head_count, config.n_heads),
                       (writer.add_head_count_kv, config.K), (writer.add_key_length, config.H),
                       (writer.add_value_length, config.H),
                       (writer.add_rope_dimension_count, config.H),
                       (writer.add_rope_freq_base, config.rope_theta),
                       (writer.add_layer_norm_rms_eps, config.norm_eps),
                       (writer.add_vocab_size, config.vocab_size)):
        add(value)
