"""LoRA adapters in Hugging Face PEFT's format: a LoRA run's adapters written as a directory that
`peft.PeftModel.from_pretrained` puts on the transformers model of the run's base, and such a
directory read back into our adapters (nn/lora.py).

    DIR/adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules",
                                    "base_model_name_or_path", ...}
    DIR/adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in]
                                   base_model.model.<module>.lora_B.weight  [out, r]

`<module>` is the Hugging Face name of the adapted Linear (`model.layers.3.self_attn.q_proj`),
one pair per layer. PEFT computes x·Wᵀ + (alpha/r)·(x·A_pᵀ)·B_pᵀ on the stored W [out, in];
ours computes x·W + (alpha/r)·(x·A)·B on W `[K.., N..]`, so per layer A_p = Aᵀ (the inputs
flattened) and B_p = Bᵀ with its rows in the order the checkpoint's W keeps its output rows
(the Llama family's: ours; DeepSeek's interleaved RoPE rows: permuted as its weights are).

Only what the two compute alike is exchanged: plain LoRA (no rsLoRA or DoRA scaling, no bias
training, no per-module ranks, no `modules_to_save`) on unfused Linear weights of Llama-family
layers; anything else is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from llama_jax.config import LoraConfig, ModelConfig
from llama_jax.errors import CheckpointError
from llama_jax.formats.torch_layout import (HF, Slot, half_to_interleaved, interleaved_to_half,
                                            names, slots)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's name for the wrapped transformers model
# Settings of PEFT's LoraConfig that change what an adapter computes, with the value that
# computes what ours do
PLAIN = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none",
         "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
         "alpha_pattern": {}}


def is_peft(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file()


def base_of(path: Path) -> str:
    """The checkpoint a PEFT adapter directory adapts (`base_model_name_or_path`): it must be
    on this machine (nothing is downloaded)."""
    base = _read_config(path).get("base_model_name_or_path")
    if not isinstance(base, str) or not base or not Path(base).exists():
        raise CheckpointError(f"{path / CONFIG}: base_model_name_or_path {base!r} is not a "
                              "checkpoint on this machine; set it to the base model's "
                              "directory (llama_jax downloads nothing)")
    return base


def save(config: ModelConfig, lora: LoraConfig, adapters: dict, base: str, path: Path) -> None:
    """Writes `adapters` (`{path: {"a", "b"}}`, of a model of `config`) into the empty
    directory `path`, for PEFT on the Hugging Face checkpoint of that model (`base` names it
    in the adapter's config)."""
    tensors = {}
    modules = set()
    for tree_path, slot in _slots(config, adapters).items():
        a_LKr, b_LrN = (np.asarray(adapters[tree_path][k], np.float32) for k in ("a", "b"))
        for j, module in enumerate(_modules(slot)):
            r = a_LKr.shape[-1]
            tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
                a_LKr[j].reshape(-1, r).T)
            b_Nr = b_LrN[j].reshape(r, -1).T
            if slot.rope_interleaved(HF):
                b_Nr = half_to_interleaved(b_Nr, slot.rope_heads)
            tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b_Nr)
            modules.add(module.rsplit(".", 1)[1])
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
                "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
                "target_modules": sorted(modules), "inference_mode": True, **PLAIN}
    (path / CONFIG).write_text(json.dumps(settings, indent=2) + "\n")


def load(path: Path, config: ModelConfig) -> tuple[LoraConfig, dict]:
    """(the adapters' settings, the adapters `{path: {"a", "b"}}` in float32) of the PEFT
    directory `path`, for the model of `config` (its base's)."""
    settings = _read_config(path)
    where = path / CONFIG
    for key, plain in PLAIN.items():
        if settings.get(key) not in (None, plain, {}, []):
            raise CheckpointError(f"{where}: {key}={settings[key]!r} is not supported "
                                  f"(llama_jax's LoRA is plain LoRA: {key}={plain!r})")
    if settings.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type {settings.get('peft_type')!r}: only LORA "
                              "adapters load")
    wanted = settings.get("target_modules")
    wanted = [wanted] if isinstance(wanted, str) else list(wanted or ())
    by_module: dict[str, list[Slot]] = {}
    for s in _linear_slots(config):
        by_module.setdefault(_modules(s)[0].rsplit(".", 1)[1], []).append(s)
    unknown = [m for m in wanted if m not in by_module]
    if unknown or not wanted:
        raise CheckpointError(f"{where}: target_modules {wanted} are not (all) Linear weights of "
                              f"this model's layers ({', '.join(sorted(by_module))})")
    tensors = load_file(str(path / WEIGHTS))
    adapters = {}
    for slot in (s for module in wanted for s in by_module[module]):
        a, b = [], []
        for name in _modules(slot):
            a_rK, b_Nr = (_tensor(tensors, f"{PREFIX}{name}.lora_{k}.weight", path)
                          for k in ("A", "B"))
            if slot.rope_interleaved(HF):
                b_Nr = interleaved_to_half(b_Nr, slot.rope_heads)
            r, in_axes = a_rK.shape[0], slot.tensor.in_axes
            a.append(a_rK.T.reshape(*slot.shape[:in_axes], r))
            b.append(b_Nr.T.reshape(r, *slot.shape[in_axes:]))
        adapters[slot.tree_path.removeprefix("groups/")] = {
            "a": np.stack(a).astype(np.float32), "b": np.stack(b).astype(np.float32)}
    lora = LoraConfig(rank=int(settings["r"]), alpha=float(settings["lora_alpha"]),
                      dropout=float(settings.get("lora_dropout") or 0.0),
                      targets=tuple(dict.fromkeys(p.rsplit("/", 1)[1] for p in adapters)))
    return lora, adapters


def _read_config(path: Path) -> dict[str, Any]:
    try:
        settings = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / CONFIG}: cannot read a PEFT adapter config: {e}") from None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path / CONFIG}: not a JSON object")
    return settings


def _tensor(tensors: dict[str, np.ndarray], name: str, path: Path) -> np.ndarray:
    if name not in tensors:
        raise CheckpointError(f"{path / WEIGHTS}: no tensor {name}")
    return tensors[name].astype(np.float32)


def _linear_slots(config: ModelConfig) -> list[Slot]:
    """The layers' weights that PEFT adapts as a Linear of their own: stored [out, in], one
    tensor per layer (not fused with others, not one per expert)."""
    return [s for s in slots(config) if s.layers and s.tensor.stored == "linear"
            and not s.fused and not s.tensor.per_expert]


def _slots(config: ModelConfig, adapters: dict) -> dict[str, Slot]:
    """The slot of each adapted weight; one that PEFT cannot adapt alike is refused."""
    linear = {s.tree_path.removeprefix("groups/"): s for s in _linear_slots(config)}
    refused = [p for p in adapters if p not in linear]
    if refused:
        raise CheckpointError(f"adapters on {', '.join(refused)}: PEFT adapts unfused Linear "
                              "weights of Llama-family layers only")
    return {p: linear[p] for p in adapters}


def _modules(slot: Slot) -> list[str]:
    """The Hugging Face module name of each layer's weight (`model.layers.3.self_attn.q_proj`)."""
    return [name.removesuffix(".weight") for name in names(slot, HF)]

