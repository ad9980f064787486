"""GGUF files (llama.cpp, Ollama, LM Studio): one file with the weights — often quantized in
blocks — the architecture's settings and the tokenizer.

Read with the `gguf` package (llama.cpp's own reader and its numpy dequantizers), tensor by
tensor from a memory map, so the host holds one dequantized tensor at a time. Every tensor type
`gguf` can dequantize loads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K to
Q6_K, ...), to the target dtype or, with `quantize="int8"`, to our int8.

A LLaMA-architecture GGUF holds Hugging Face's tensors under other names (`GGUF_NAMES`, as
llama.cpp's converter maps them), `[out, in]` as HF's, with attn_q / attn_k rows in Meta's
interleaved RoPE order (the converter permutes them): so it is read in torch_layout's `GGUF`
layout, which undoes the interleaving. A Mixtral-style model (`llama.expert_count`) keeps each
layer's experts stacked in one tensor per matrix (`ffn_gate_exps`: [E, F, D]), read one expert
at a time. Llama-3.1's RoPE scaling is a `rope_freqs` tensor of per-frequency divisors, read
back as the "llama3" parameters that give them. `general.architecture` other than llama, and
scalings we do not compute, are refused, naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from llama_jax.config import ModelConfig, MoeConfig, RopeScaling
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.gguf_file import metadata, open_file
from llama_jax.formats.loading import Loading, Placement, assemble
from llama_jax.formats.torch_layout import (GGUF, Slot, family_of, torch_pieces, torch_shape,
                                            torch_tensors)
from llama_jax.model.params import Params
from llama_jax.nn.rope import base_frequencies, frequency_divisors

ARCHITECTURE = "general.architecture"
ROPE_FREQS = "rope_freqs.weight"

# HF's names (torch_layout's `hf` names) -> GGUF's, layer index as \1; an expert's matrix of
# Mixtral is one slice (its index: \2) of a stacked tensor
_LAYER = r"model\.layers\.(\d+)\."
GGUF_NAMES = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_LAYER + r"input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (_LAYER + r"self_attn\.q_proj\.weight", r"blk.\1.attn_q.weight"),
    (_LAYER + r"self_attn\.k_proj\.weight", r"blk.\1.attn_k.weight"),
    (_LAYER + r"self_attn\.v_proj\.weight", r"blk.\1.attn_v.weight"),
    (_LAYER + r"self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (_LAYER + r"post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (_LAYER + r"mlp\.gate_proj\.weight", r"blk.\1.ffn_gate.weight"),
    (_LAYER + r"mlp\.up_proj\.weight", r"blk.\1.ffn_up.weight"),
    (_LAYER + r"mlp\.down_proj\.weight", r"blk.\1.ffn_down.weight"),
    (_LAYER + r"block_sparse_moe\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
)
_EXPERT = _LAYER + r"block_sparse_moe\.experts\.(\d+)\."
GGUF_EXPERT_NAMES = (
    (_EXPERT + r"w1\.weight", r"blk.\1.ffn_gate_exps.weight"),
    (_EXPERT + r"w3\.weight", r"blk.\1.ffn_up_exps.weight"),
    (_EXPERT + r"w2\.weight", r"blk.\1.ffn_down_exps.weight"),
)
# The dtype a file's float tensors hold (quantized ones dequantize to float32)
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# How closely "llama3" parameters read from a rope_freqs tensor must give it back (the file
# holds float32 divisors computed in float32)
_DIVISOR_RTOL = 1e-5


def gguf_name(hf_name: str) -> tuple[str, int | None]:
    """The GGUF tensor holding the tensor HF calls `hf_name`, and which slice of it (an
    expert's index in a stacked tensor; None: all of it)."""
    for pattern, replacement in GGUF_NAMES:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, replacement, hf_name), None
    for pattern, replacement in GGUF_EXPERT_NAMES:
        if match := re.fullmatch(pattern, hf_name):
            return re.sub(pattern, replacement, hf_name), int(match[2])
    raise CheckpointError(f"tensor {hf_name!r} has no name in GGUF's LLaMA architecture")


def read_config(path: Path, reader) -> ModelConfig:
    """The model's config from the file's `llama.*` keys (and its rope_freqs tensor)."""
    kv = metadata(reader)
    architecture = kv.get(ARCHITECTURE)
    if architecture != "llama":
        raise CheckpointError(f"{path}: {ARCHITECTURE} is {architecture!r}; llama_jax reads "
                              "GGUF files of the llama architecture")
    tensors = {t.name: t for t in reader.tensors}
    scaling_type = kv.get("llama.rope.scaling.type", "none")
    if scaling_type != "none":
        raise CheckpointError(f"{path}: llama.rope.scaling.type is {scaling_type!r}; llama_jax "
                              "reads Llama-3.1's scaling (a rope_freqs tensor) or none")

    def key(name: str, default: Any = KeyError):
        if f"llama.{name}" in kv:
            return kv[f"llama.{name}"]
        if default is KeyError:
            raise CheckpointError(f"{path}: missing key 'llama.{name}'")
        return default

    n_heads = key("attention.head_count")
    dim = key("embedding_length")
    head_dim = key("attention.key_length", None) or dim // n_heads
    if key("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{path}: llama.rope.dimension_count is "
                              f"{key('rope.dimension_count')}; llama_jax rotates whole heads "
                              f"({head_dim} features)")

    def decimal(name: str, default: float) -> float:
        """A float32 key as the shortest decimal that is that float32 (1e-05, not
        9.99999974e-06), so a config written and read back is the same."""
        return float(str(np.float32(key(name, default))))

    vocab = key("vocab_size", None) or len(kv.get("tokenizer.ggml.tokens") or ()) or \
        _rows(tensors.get("token_embd.weight"))
    eos = [kv[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in kv]
    experts = key("expert_count", 0)
    try:
        config = ModelConfig(
            vocab_size=int(vocab), dim=dim, n_layers=key("block_count"), n_heads=n_heads,
            n_kv_heads=key("attention.head_count_kv", n_heads), head_dim=head_dim,
            ffn_dim=key("feed_forward_length"),
            norm_eps=decimal("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=decimal("rope.freq_base", 10000.0),
            max_seq_len=key("context_length", 2048),
            tie_embeddings="output.weight" not in tensors,
            eos_ids=tuple(dict.fromkeys(int(i) for i in eos)),
            mlp="moe" if experts else "swiglu",
            moe=MoeConfig(n_experts=experts, top_k=key("expert_used_count")) if experts
            else None)
        if ROPE_FREQS in tensors:
            config = _with_rope_freqs(path, config, dequantized(path, tensors[ROPE_FREQS]),
                                      key("rope.scaling.original_context_length", 8192))
        return config
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _rows(tensor) -> int:
    return _numpy_shape(tensor)[0] if tensor is not None else 0


def _numpy_shape(tensor) -> tuple[int, ...]:
    """A tensor's shape in numpy's order (GGUF lists dimensions innermost first)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def _with_rope_freqs(path: Path, config: ModelConfig, divisors: np.ndarray,
                     context: int) -> ModelConfig:
    """`config` with the "llama3" scaling whose per-frequency divisors are `divisors`.

    Meta's scaling divides θ_i by `factor` where its wavelength is past context/low, keeps it
    below context/high, and between divides by 1 / ((1 - s)/factor + s), s linear in θ_i:
    s = a·θ_i/2π - b with a = context/(high - low), b = low/(high - low). So the largest
    divisor is `factor` and the ones between fix a and b; the original context is not in the
    divisors (any gives them), so it is the file's, or Llama-3's 8192."""
    refusal = CheckpointError(f"{path}: tensor {ROPE_FREQS!r} is not a Llama-3.1 RoPE scaling "
                              f"of {config.rope_dim}-feature heads (no factor, low_freq_factor "
                              "and high_freq_factor give it)")
    if divisors.shape != (config.rope_dim // 2,):
        raise refusal
    factor = float(divisors.max())
    if np.allclose(divisors, 1, rtol=_DIVISOR_RTOL):
        return config
    turns = base_frequencies(config) / (2 * math.pi)
    between = (divisors > 1 + _DIVISOR_RTOL) & (divisors < factor * (1 - _DIVISOR_RTOL))
    low, high = 1.0, 4.0  # Meta's, where too few divisors lie between to fit them
    if between.sum() >= 2:
        s = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
        a, minus_b = np.polyfit(turns[between], s, 1)
        low = -minus_b * context / a
        high = low + context / a
    try:
        scaled = dataclasses.replace(config, rope_type="llama3", rope_scaling=RopeScaling(
            factor=_rounded(factor), original_max_position_embeddings=int(context),
            low_freq_factor=_rounded(low), high_freq_factor=_rounded(high)))
    except ConfigError:  # a fit no scaling has (a negative factor)
        raise refusal from None
    if not np.allclose(frequency_divisors(scaled), divisors, rtol=_DIVISOR_RTOL):
        raise refusal
    return scaled


def _rounded(x: float) -> float:
    """A fitted float32-derived value to 6 significant digits (8.0, not 7.9999995)."""
    return float(f"{x:.6g}")


def stored_dtype(reader) -> str:
    """The float dtype the file's weights are held in: that of its token embedding when it is
    a float tensor, else float32 (what quantized blocks dequantize to)."""
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return _FLOAT_TYPES.get(t.tensor_type.name, "float32")
    return "float32"


def dequantized(path: Path, tensor, expert: int | None = None) -> np.ndarray:
    """One tensor (or, of a stacked expert tensor, one expert's slice) as float32 in numpy's
    order (GGUF's dimensions reversed)."""
    from gguf import quants

    shape, data = _numpy_shape(tensor), tensor.data
    if expert is not None:  # the reader's blocks are rows of the leading (expert) axis too
        data, shape = data[expert], shape[1:]
    try:
        w = quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} has type "
                              f"{tensor.tensor_type.name}, which the gguf package cannot "
                              "dequantize") from None
    return np.asarray(w, np.float32).reshape(shape)


def load(path: Path, loading: Loading,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    reader = open_file(path)
    config = read_config(path, reader)
    family_of(config)
    tensors = {t.name: t for t in reader.tensors}
    config = loading.config(config, stored_dtype(reader), path)

    def read(slot: Slot, hf_name: str) -> np.ndarray:
        name, expert = gguf_name(hf_name)
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        expected = torch_shape(slot) if expert is None else (
            config.moe.n_experts, *torch_shape(slot))
        stored = _numpy_shape(tensors[name])
        if stored != expected:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {stored}, expected "
                                  f"{expected} from the file's llama.* keys")
        return dequantized(path, tensors[name], expert)

    return config, assemble(config, torch_pieces(config, read, GGUF),
                            np.dtype(config.param_dtype), placement)


# What `save` writes matrices as (`convert --to gguf --dtype`); vectors and routers are always
# F32 (as llama.cpp keeps them), and a matrix whose rows do not split into Q8_0's blocks of 32
# falls back to F16, as in llama.cpp
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
_Q8_BLOCK = 32


def save(config: ModelConfig, params: Params, path: Path, file_type: str = "f16",
         tokenizer=None, chat_template: str | None = None) -> None:
    """Writes a LLaMA-architecture model (dense or Mixtral-style) as one GGUF file at `path`
    (which must not exist), its matrices as `file_type`, with `tokenizer`'s vocabulary and
    the chat template when given: a file llama.cpp, Ollama and `load_checkpoint` read."""
    import gguf

    _check_writable(config, file_type, path)
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
    if config.rope_type == "llama3":
        writer.add_tensor(ROPE_FREQS, frequency_divisors(config).astype(np.float32))
    for name, w in _gguf_tensors(config, params):
        kind = _stored_type(name, w, file_type)
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensors(config: ModelConfig, params: Params):
    """(GGUF name, float32 tensor) for every tensor of the file, one at a time: a layer's
    experts stacked into one tensor once the last of them is reached."""
    experts: list[np.ndarray] = []
    for hf_name, w in torch_tensors(config, params, GGUF):
        name, expert = gguf_name(hf_name)
        w = np.asarray(w, np.float32)
        if expert is None:
            yield name, w
            continue
        experts.append(w)
        if expert == config.moe.n_experts - 1:
            yield name, np.stack(experts)
            experts = []


def _stored_type(name: str, w: np.ndarray, file_type: str):
    from gguf import GGMLQuantizationType as Q

    if w.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        return Q.F32
    if file_type == "q8_0" and w.shape[-1] % _Q8_BLOCK:
        return Q.F16
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[file_type]


def _check_writable(config: ModelConfig, file_type: str, path: Path) -> None:
    if file_type not in GGUF_TYPES:
        raise CheckpointError(f"{path}: GGUF type {file_type!r} is not one of "
                              f"{', '.join(GGUF_TYPES)}")
    if family_of(config).model_type not in ("llama", "mixtral") or config.head != "lm":
        raise CheckpointError(f"{path}: only LLaMA-architecture language models (dense or "
                              "Mixtral-style) are written as GGUF")


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
    if config.mlp == "moe":
        writer.add_expert_count(config.moe.n_experts)
        writer.add_expert_used_count(config.moe.top_k)
    if config.rope_type == "llama3":
        writer.add_rope_scaling_orig_ctx_len(
            config.rope_scaling.original_max_position_embeddings)
