"""Hugging Face checkpoints: `config.json` + `model.safetensors` (or shards + index), of the
families torch_layout.py has tables for, chosen by config.json's `model_type` when reading and by
the model's architecture when writing:

- Llama (`LlamaForCausalLM`). Reads both config forms found in the wild: `rope_theta` +
  `rope_scaling` (transformers 4.x, all official LLaMA-3.1/3.2 uploads) and `rope_parameters`
  (transformers 5.x). Writes the 4.x form, which both generations load.
- Mixtral (`MixtralForCausalLM`): Llama attention with a softmax top-k MoE of SwiGLU experts
  (`num_local_experts`, `num_experts_per_tok`, expert width `intermediate_size`). Its
  `router_aux_loss_coef` is a training setting of transformers' own loss (see nn/moe.py for how
  it relates to ours) and is not read; written as our weight / top_k · L.
- DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): Multi-head Latent
  Attention (`q_lora_rank` null: V2-Lite's plain query projection) with `default` or `yarn`
  RoPE, and the first `first_k_dense_replace` layers dense (`intermediate_size`), the others
  an MoE of `n_routed_experts` SwiGLU experts (`moe_intermediate_size`) plus
  `n_shared_experts` shared ones. V2 routes by softmax, unnormalised (transformers ignores its
  `norm_topk_prob`), `topk_method` greedy or group_limited_greedy (groups scored by their
  best expert); V3 by sigmoid with the `e_score_correction_bias` selecting (our selection
  bias), groups scored by their two best experts, `norm_topk_prob`; both times
  `routed_scaling_factor`. `head_dim` in their config.json is the RoPE head dim (unused:
  ours follows from the `mla` fields); YaRN takes the explicit `factor`. Written as V3 for
  sigmoid routers and dense MLA models, as V2 for softmax routers; RoPE rows as DeepSeek
  stores them (interleaved: torch_layout.py).
- GPT-2 (`GPT2LMHeadModel`, or a bare `GPT2Model` save, whose names lack `transformer.`).
  `activation_function` gelu_new / gelu_pytorch_tanh -> mlp gelu_tanh, gelu -> gelu (exact),
  relu -> relu; the MLP width is `n_inner` or 4·D. Written as `GPT2LMHeadModel`.

Tensors are memory-mapped and read one at a time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Collection

import numpy as np

from llama_jax.config import MlaConfig, ModelConfig, MoeConfig, RopeScaling
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.formats.loading import Loading, Placement, assemble
from llama_jax.formats.torch_layout import (HF, Family, Slot, family_of, stored_tensors,
                                            torch_pieces, torch_shape, torch_tensors)
from llama_jax.model.params import Params

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# transformers' Llama architectures with a task head -> our head (regression is a
# LlamaForSequenceClassification with problem_type regression)
HF_HEADS = {"LlamaForSequenceClassification": "sequence_classification",
            "LlamaForTokenClassification": "token_classification"}
# GPT2Config.activation_function -> our mlp, and the name each mlp is written with.
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                    "relu": "relu"}
GPT2_ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def is_hf(path: Path) -> bool:
    return (path / CONFIG).is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def read_config(path: Path) -> ModelConfig:
    """`config.json` → ModelConfig; rejects architectures that are not plain Llama or GPT-2."""
    file = path / CONFIG
    try:
        hf = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    model_type = hf.get("model_type")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{file}: quantized weights (quantization_config: {method!r}, "
                              "e.g. DeepSeek-V3's fp8 release) are not supported; load a "
                              "bf16/fp16/fp32 copy (dequantized)")
    if model_type not in CONFIG_READERS:
        raise CheckpointError(f"{file}: model_type {model_type!r} (architectures "
                              f"{hf.get('architectures')}) is not a Llama, Mixtral, GPT-2 or "
                              "DeepSeek model; expected model_type 'llama' (no biases), "
                              "'mixtral' (no sliding window), 'gpt2', 'deepseek_v2' or "
                              "'deepseek_v3'")
    try:
        return CONFIG_READERS[model_type](file, hf, _eos_ids(path, hf))
    except KeyError as e:
        raise CheckpointError(f"{file}: missing field {e.args[0]!r}") from None
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None


def _refuse_biases_and_other_activations(file: Path, hf: dict[str, Any], family: str) -> None:
    """Llama-like families have no biases and SiLU-gated MLPs."""
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"{file}: {flag}=true is not part of the {family} architecture")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{file}: hidden_act {act!r}; {family}'s SwiGLU uses 'silu'")


def _llama_config(file: Path, hf: dict[str, Any], eos_ids: tuple[int, ...]) -> ModelConfig:
    _refuse_biases_and_other_activations(file, hf, "Llama")
    rope_theta, rope_type, scaling = _rope(hf, ("default", "llama3"))
    return _head(file, hf, ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), ffn_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta, rope_type=rope_type,
        rope_scaling=scaling, max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), eos_ids=eos_ids))


def _head(file: Path, hf: dict[str, Any], config: ModelConfig) -> ModelConfig:
    """The task head of `LlamaForSequenceClassification` (`problem_type` regression: our
    regression head) or `LlamaForTokenClassification`, by `architectures`; outputs named by
    `id2label` (its LABEL_i defaults are not kept) and padding by `pad_token_id`."""
    architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if architecture not in HF_HEADS:
        return config
    if architecture == "LlamaForSequenceClassification":
        problem = hf.get("problem_type")
        if problem not in (None, "single_label_classification", "regression"):
            raise CheckpointError(f"{file}: problem_type {problem!r} is not supported "
                                  "(single_label_classification or regression)")
        head = "regression" if problem == "regression" else "sequence_classification"
    else:
        head = HF_HEADS[architecture]
    names = [name for _, name in sorted((int(i), n) for i, n in
                                        (hf.get("id2label") or {}).items())]
    n_labels = len(names) or hf.get("num_labels", 2)
    default_names = names == [f"LABEL_{i}" for i in range(len(names))]
    return dataclasses.replace(config, head=head, n_labels=n_labels,
                               pad_id=hf.get("pad_token_id"),
                               label_names=None if default_names else tuple(names))


def _mixtral_config(file: Path, hf: dict[str, Any], eos_ids: tuple[int, ...]) -> ModelConfig:
    if hf.get("sliding_window") is not None:
        raise CheckpointError(f"{file}: sliding_window={hf['sliding_window']} is not supported "
                              "(full causal attention only)")
    llama = _llama_config(file, {**hf, "model_type": "llama"}, eos_ids)
    return dataclasses.replace(llama, mlp="moe", moe=MoeConfig(
        n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"]))


def _gpt2_config(file: Path, hf: dict[str, Any], eos_ids: tuple[int, ...]) -> ModelConfig:
    """Optional fields default as in transformers' GPT2Config."""
    # Options that turn GPT-2's attention into one llama_jax does not compute.
    for flag, plain in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if hf.get(flag, plain) != plain:
            raise CheckpointError(f"{file}: {flag}={hf[flag]!r} is not supported (only "
                                  f"{plain!r}: plain GPT-2 attention)")
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise CheckpointError(f"{file}: activation_function {act!r} is not supported; expected "
                              f"one of {', '.join(GPT2_ACTIVATIONS)}")
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["n_embd"], n_layers=hf["n_layer"],
        n_heads=hf["n_head"], ffn_dim=hf.get("n_inner") or 4 * hf["n_embd"],
        norm="layernorm", norm_position="pre", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        positions="learned", mlp=GPT2_ACTIVATIONS[act], bias=True,
        max_seq_len=hf.get("n_positions", 1024),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), eos_ids=eos_ids)


def _deepseek_config(file: Path, hf: dict[str, Any], eos_ids: tuple[int, ...]) -> ModelConfig:
    """DeepSeek-V2 or V3 (by model_type), optional fields defaulted as transformers does."""
    v3 = hf["model_type"] == "deepseek_v3"
    _refuse_biases_and_other_activations(file, hf, "DeepSeek")
    if v3 and not hf.get("rope_interleave", True):
        raise CheckpointError(f"{file}: rope_interleave=false is not supported (released "
                              "DeepSeek checkpoints store RoPE rows interleaved)")
    if hf.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{file}: moe_layer_freq={hf['moe_layer_freq']} is not "
                              "supported (every layer after first_k_dense_replace is MoE)")
    rope_theta, rope_type, scaling = _rope(hf, ("default", "yarn"))
    mla = MlaConfig(q_lora_rank=hf.get("q_lora_rank", 1536),
                    kv_lora_rank=hf.get("kv_lora_rank", 512),
                    qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
                    qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
                    v_head_dim=hf.get("v_head_dim", 128))
    config = ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], attention="mla", mla=mla,
        ffn_dim=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta, rope_type=rope_type, rope_scaling=scaling,
        max_seq_len=hf.get("max_position_embeddings", 4096 if v3 else 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), eos_ids=eos_ids)
    n_experts = hf.get("n_routed_experts", 256 if v3 else 64)
    first_dense = hf.get("first_k_dense_replace", 3 if v3 else 0) or 0
    if n_experts is None or first_dense >= config.n_layers:
        return config
    if v3:
        groups = (hf.get("n_group", 8) or 1, hf.get("topk_group", 4) or 1)
    else:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"{file}: topk_method {method!r} is not supported by "
                                  "deepseek_v2 (greedy or group_limited_greedy)")
        groups = ((hf.get("n_group") or 1, hf.get("topk_group") or 1)
                  if method == "group_limited_greedy" else (1, 1))
    moe = MoeConfig(
        n_experts=n_experts, top_k=hf.get("num_experts_per_tok") or (8 if v3 else 1),
        expert_ffn_dim=hf.get("moe_intermediate_size", 2048 if v3 else 1407),
        n_shared_experts=hf.get("n_shared_experts", 1 if v3 else 2) or 0,
        router="sigmoid" if v3 else "softmax",
        normalize_top_k=bool(hf.get("norm_topk_prob", True)) if v3 else False,
        routed_scaling=hf.get("routed_scaling_factor", 2.5 if v3 else 1.0),
        n_groups=groups[0], top_k_groups=groups[1], first_dense_layers=first_dense)
    return dataclasses.replace(config, mlp="moe", moe=moe)


# by config.json's model_type
CONFIG_READERS = {"llama": _llama_config, "mixtral": _mixtral_config, "gpt2": _gpt2_config,
                  "deepseek_v2": _deepseek_config, "deepseek_v3": _deepseek_config}


def _eos_ids(path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (instruct models list several) or config.json."""
    eos = hf.get("eos_token_id")
    generation = path / "generation_config.json"
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{generation}: cannot read: {e}") from None
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def _rope(hf: dict[str, Any], types: tuple[str, ...]) -> tuple[float, str, RopeScaling | None]:
    """rope_theta, rope_type and scaling from either config form (see the module docstring)."""
    params = hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in types:
        raise ConfigError(f"rope_type {rope_type!r} is not supported for this model_type "
                          f"(expected one of {', '.join(map(repr, types))})")
    if rope_type == "default":
        return theta, "default", None
    if rope_type == "llama3":
        return theta, "llama3", RopeScaling(
            factor=params["factor"], low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position_embeddings=params["original_max_position_embeddings"])
    for name, plain in (("attention_factor", None), ("truncate", True),
                        ("partial_rotary_factor", 1.0)):
        if params.get(name, plain) != plain:
            raise ConfigError(f"rope_scaling {name}={params[name]!r} is not supported")
    return theta, "yarn", RopeScaling(
        factor=params["factor"], beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0, mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        original_max_position_embeddings=params.get("original_max_position_embeddings",
                                                    hf.get("max_position_embeddings")))


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → safetensors file, from the index or the single file."""
    from safetensors import safe_open

    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{path / INDEX}: not a safetensors index: {e}") from None
        files = {name: path / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"{path / INDEX}: shard(s) missing: {', '.join(missing)}")
        return files
    file = path / SINGLE
    try:
        with safe_open(file, framework="numpy") as f:
            return {name: file for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from None


def load(path: Path, loading: Loading,
         placement: Placement | None = None) -> tuple[ModelConfig, Params]:
    from safetensors import safe_open

    config = read_config(path)
    family = family_of(config)
    files = _weight_files(path)
    expected = stored_tensors(config)
    stored = _stored_names(files, family, expected)
    missing = sorted(expected.keys() - stored.keys())
    if missing:
        raise CheckpointError(f"{path}: tensor(s) missing from the safetensors files: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(stored[n] for n in stored.keys() - expected.keys()
                        if not family.skipped(n, config) and n != "lm_head.weight")
    if unexpected:
        raise CheckpointError(f"{path}: tensor(s) that are not {family.name} weights: "
                              f"{', '.join(unexpected[:5])}")
    first = stored[next(iter(expected))]
    config = loading.config(config, _stored_dtype(files[first], first), path)

    def read(slot: Slot, ours: str) -> np.ndarray:
        name = stored[ours]
        file = files[name]
        try:
            with safe_open(file, framework="numpy") as f:
                w = f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r}: {e}") from None
        expected_shape = torch_shape(slot)
        if w.shape != expected_shape:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {w.shape}, expected "
                                  f"{expected_shape} from {path / CONFIG}")
        return w

    return config, assemble(config, torch_pieces(config, read, HF),
                            np.dtype(config.param_dtype), placement)


def _stored_names(files: dict[str, Path], family: Family,
                  expected: Collection[str]) -> dict[str, str]:
    """Our name of each stored tensor → its name in the files, which lacks the family's
    `base_prefix` in a save of the bare base model (GPT2Model rather than GPT2LMHeadModel)."""
    prefix = family.base_prefix
    return {prefix + name if prefix + name in expected else name: name for name in files}


def _stored_dtype(file: Path, name: str) -> str:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            stored = f.get_slice(name).get_dtype()
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from None
    return _SAFETENSORS_DTYPES.get(stored, "float32")


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json content for the model's family (refused for other architectures)."""
    return CONFIG_WRITERS[family_of(config).model_type](config)


def _llama_json(config: ModelConfig) -> dict[str, Any]:
    """The transformers 4.x form (also read by 5.x)."""
    scaling = config.rope_scaling and {"rope_type": config.rope_type,
                                       **config.rope_scaling.to_dict()}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": scaling,
        "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": config.param_dtype,
        "eos_token_id": _eos_token_id(config), **_head_json(config),
    }


def _head_json(config: ModelConfig) -> dict[str, Any]:
    """A task head's architecture, outputs and padding (nothing for the LM head)."""
    if config.head == "lm":
        return {}
    out = {"architectures": [{v: k for k, v in HF_HEADS.items()}.get(
               config.head, "LlamaForSequenceClassification")],
           "id2label": dict(enumerate(config.names_of_labels)),
           "label2id": {name: i for i, name in enumerate(config.names_of_labels)},
           "pad_token_id": config.pad_id}
    if config.head != "token_classification":
        out["problem_type"] = ("regression" if config.head == "regression"
                               else "single_label_classification")
    return out


def _mixtral_json(config: ModelConfig) -> dict[str, Any]:
    m = config.moe
    llama = {k: v for k, v in _llama_json(config).items()
             if k not in ("attention_bias", "mlp_bias", "head_dim")}
    return {**llama, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "head_dim": config.head_dim, "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.top_k, "sliding_window": None,
            "router_aux_loss_coef": m.aux_loss_weight / m.top_k * config.n_layers}


def _gpt2_json(config: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_embd": config.dim, "n_layer": config.n_layers,
        "n_head": config.n_heads, "n_inner": config.ffn_dim, "n_positions": config.max_seq_len,
        "activation_function": GPT2_ACTIVATION_NAMES[config.mlp],
        "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False, "torch_dtype": config.param_dtype,
        # GPT-2 begins and ends documents with the same <|endoftext|>; left out, transformers
        # would default both ids to 50256, outside smaller vocabularies.
        "bos_token_id": config.eos_ids[0] if config.eos_ids else None,
        "eos_token_id": _eos_token_id(config),
    }


def _eos_token_id(config: ModelConfig) -> int | list[int] | None:
    if not config.eos_ids:
        return None
    return config.eos_ids[0] if len(config.eos_ids) == 1 else list(config.eos_ids)


def _deepseek_json(config: ModelConfig) -> dict[str, Any]:
    """The form of released DeepSeek checkpoints (rope_scaling + top-level rope_theta), which
    transformers 4.x and 5.x both read."""
    a, m, v3 = config.mla, config.moe, family_of(config).model_type == "deepseek_v3"
    llama = {k: v for k, v in _llama_json(config).items() if k not in ("mlp_bias", "head_dim")}
    scaling = llama["rope_scaling"] and {"type": config.rope_type, **llama["rope_scaling"]}
    out = {**llama, "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
           "model_type": "deepseek_v3" if v3 else "deepseek_v2", "rope_scaling": scaling,
           "num_key_value_heads": config.n_heads, "q_lora_rank": a.q_lora_rank,
           "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
           "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
           "head_dim": a.qk_rope_head_dim}
    if m is None:  # every layer dense
        return {**out, "first_k_dense_replace": config.n_layers, "n_routed_experts": 8,
                "num_experts_per_tok": 1, "n_shared_experts": 0, "n_group": 1, "topk_group": 1,
                "moe_intermediate_size": config.ffn_dim}
    out.update(first_k_dense_replace=m.first_dense_layers, n_routed_experts=m.n_experts,
               num_experts_per_tok=m.top_k, moe_intermediate_size=config.expert_ffn_dim,
               n_shared_experts=m.n_shared_experts, routed_scaling_factor=m.routed_scaling,
               n_group=m.n_groups, topk_group=m.top_k_groups)
    if v3:
        return {**out, "norm_topk_prob": m.normalize_top_k, "rope_interleave": True}
    return {**out, "mlp_bias": False, "norm_topk_prob": False,
            "topk_method": "group_limited_greedy" if m.n_groups > 1 else "greedy"}


# by the family's model_type
CONFIG_WRITERS = {"llama": _llama_json, "mixtral": _mixtral_json, "gpt2": _gpt2_json,
                  "deepseek_v3": _deepseek_json, "deepseek_v2": _deepseek_json}


def save(config: ModelConfig, params: Params, path: Path,
         max_shard_bytes: int = 5 * 1024 ** 3) -> None:
    """Writes config.json and safetensors shards (with an index when there is more than one)
    into the existing empty directory `path`, converting and writing one shard at a time."""
    from safetensors.numpy import save_file

    written: list[tuple[Path, list[str]]] = []  # (file, tensor names); renamed once counted
    shard: dict[str, np.ndarray] = {}
    total = 0

    def flush():
        file = path / f"shard-{len(written):05d}.tmp"
        save_file(shard, str(file), metadata={"format": "pt"})
        written.append((file, list(shard)))
        shard.clear()

    for name, tensor in torch_tensors(config, params):
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        total += tensor.nbytes
    flush()
    n = len(written)
    names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for (file, _), name in zip(written, names):
        file.rename(path / name)
    if n > 1:
        weight_map = {t: name for (_, tensors), name in zip(written, names) for t in tensors}
        (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}, indent=2))
    (path / CONFIG).write_text(json.dumps(hf_config(config), indent=2))
