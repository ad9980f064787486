"""Convert checkpoints between formats, behind a parity gate.

    python -m llama_jax.formats.convert SRC DST [--to native|hf] [--dtype D] [--no-reference]
    python -m llama_jax.formats.convert SRC OUT.gguf --to gguf [--dtype f16|bf16|q8_0|f32]
    python -m llama_jax.formats.convert LORA_RUN DST --to peft

SRC is anything `load_checkpoint` reads (HF, Meta, GGUF, native). The result is written to a
hidden temporary directory (a file, for GGUF) beside DST, loaded back, and moved to DST only
if:

1. our float32 forward on the written model gives the same logits as on the loaded source
   (a fixed random batch), and the architecture read back equals the source's;
2. for HF and Meta sources, when transformers is installed, our logits on the source match
   transformers' (`AutoModelForCausalLM` on HF sources: Llama, Mixtral, GPT-2, DeepSeek;
   `LlamaForCausalLM` on Meta sources, fed by a torch re-implementation of the q/k row
   permutation, independent of ours) within the tolerance of the target dtype.

Otherwise nothing is left behind and the exit status is non-zero. An existing DST is never
overwritten. Tokenizer files next to the source weights are copied along; a GGUF file gets the
source's tokenizer (SentencePiece or byte-level BPE) and chat template inside, its matrices
in `--dtype` (default f16), and its logits read back must be within that type's rounding of
the source's (GGUF_TOLERANCE). A LoRA run converts as its merged model (base + adapters), or
with `--to peft` as its adapters alone: PEFT's `adapter_config.json` +
`adapter_model.safetensors`, gated by reading them back and, when the base is a Hugging Face
checkpoint, by PEFT's logits on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

from llama_jax.formats.checkpoint import detect_format, load_checkpoint, lora_base
from llama_jax.data.chat_template import CHAT_TEMPLATE_FILE, load_chat_template
from llama_jax.data.tokenizer import has_tokenizer, load_tokenizer
from llama_jax.files import atomic_directory, check_new_directory, sibling_temp
from llama_jax.cli import user_errors_exit
from llama_jax.config import DTYPES, ModelConfig
from llama_jax.formats import gguf, hf, meta, native, peft, workdir
from llama_jax.errors import CheckpointError
from llama_jax.formats.torch_layout import META, names, slots, torch_shape
from llama_jax.model.transformer import forward
from llama_jax.model.params import Params

WRITERS = {"native": native.save, "hf": hf.save}  # each writes into an existing empty dir
# Relative logit error allowed against transformers, by the dtype the weights were loaded in.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
ROUND_TRIP_TOLERANCE = 1e-6  # same weights, same dtype: only summation order may differ
# Relative logit error allowed between a GGUF written as each type and its float32 source
GGUF_TOLERANCE = {"f32": ROUND_TRIP_TOLERANCE, "f16": 5e-3, "bf16": 3e-2, "q8_0": 5e-2}
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")


class ParityError(CheckpointError):
    """The converted model does not reproduce the source; nothing was written."""


def gate_tokens(config: ModelConfig, batch: int = 2, length: int = 48) -> np.ndarray:
    """The fixed random batch the gate compares logits on."""
    rng = np.random.default_rng(0)
    return rng.integers(0, config.vocab_size, (batch, min(length, config.max_seq_len)),
                        dtype=np.int32)


def float32_logits(config: ModelConfig, params: Params, tokens: np.ndarray) -> np.ndarray:
    f32 = dataclasses.replace(config, compute_dtype="float32")
    return np.asarray(jax.jit(forward, static_argnums=0)(f32, params, tokens))


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def transformers_logits(src: Path, fmt: str, config: ModelConfig,
                        tokens: np.ndarray) -> np.ndarray | None:
    """transformers' float32 logits for the source checkpoint (None if it is not installed)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if fmt == "hf":
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf.hf_config(config)))
        model.load_state_dict(_hf_state_from_meta(src, config))
    return _torch_logits(model, tokens)


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    """A transformers model's float32 logits on `tokens`, in eval mode without gradients."""
    import torch

    with torch.no_grad():
        return model.eval()(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _hf_state_from_meta(src: Path, config: ModelConfig) -> dict:
    """Meta tensors renamed to HF, with q/k rows permuted the way transformers' original
    conversion script did it (torch view/transpose), as an independent check of ours."""
    import torch

    shards = meta.open_shards(src)
    state = {}
    for slot in slots(config):
        for meta_name, hf_name in zip(names(slot, META), names(slot)):
            w = torch.from_numpy(meta.gather(shards, meta_name, torch_shape(slot), src)).float()
            if slot.rope_heads:
                heads = slot.rope_heads
                rows, cols = w.shape
                w = w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
            state[hf_name] = w
    if config.tie_embeddings:  # one shared parameter in transformers
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def convert(src: str | Path, dst: str | Path, to: str = "native", dtype: str | None = None,
            reference: bool = True) -> dict:
    """Converts SRC to DST through the parity gate; returns the gate's measurements."""
    src, dst = Path(src), Path(dst)
    if to == "gguf":
        return convert_to_gguf(src, dst, dtype or "f16")
    if to == "peft":
        return convert_to_peft(src, dst, reference)
    if to not in WRITERS:
        raise CheckpointError(f"--to {to!r}: expected one of "
                              f"{', '.join([*WRITERS, 'gguf', 'peft'])}")
    if dtype not in (None, *DTYPES):
        raise CheckpointError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)} for "
                              f"--to {to}")
    check_new_directory(dst)  # again in atomic_directory; here to fail before loading anything
    fmt = detect_format(src)
    config, params = load_checkpoint(src, dtype)
    tokens = gate_tokens(config)
    source_logits = float32_logits(config, params, tokens)
    report = {"source_format": fmt, "dtype": config.param_dtype}
    if reference and fmt in ("hf", "meta"):
        ref = transformers_logits(src, fmt, config, tokens)
        if ref is not None:
            report["vs_transformers"] = err = relative_error(source_logits, ref)
            if not err <= TOLERANCE[config.param_dtype]:
                raise ParityError(f"{src}: our logits differ from transformers' by {err:.3g} "
                                  f"(relative; allowed {TOLERANCE[config.param_dtype]:g} for "
                                  f"{config.param_dtype}); nothing written")

    with atomic_directory(dst) as tmp:
        WRITERS[to](config, params, tmp)
        _copy_tokenizer(src, tmp)
        del params
        written_config, written = load_checkpoint(tmp, config.param_dtype)
        if written_config.architecture() != config.architecture():
            raise ParityError(f"{dst}: the written config reads back as "
                              f"{written_config.architecture()}, not {config.architecture()}")
        report["round_trip"] = err = relative_error(
            float32_logits(written_config, written, tokens), source_logits)
        if not err <= ROUND_TRIP_TOLERANCE:
            raise ParityError(f"{dst}: the written model's logits differ from the source's by "
                              f"{err:.3g} (relative; allowed {ROUND_TRIP_TOLERANCE:g}); "
                              "nothing written")
    return report


def convert_to_gguf(src: Path, dst: Path, file_type: str) -> dict:
    """SRC as one GGUF file at DST (`file_type`: gguf.GGUF_TYPES) through the gate: the
    written file's float32 logits within GGUF_TOLERANCE of the source's."""
    if file_type not in gguf.GGUF_TYPES:
        raise CheckpointError(f"--dtype {file_type}: expected one of "
                              f"{', '.join(gguf.GGUF_TYPES)} for --to gguf")
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists; refusing to overwrite it")
    fmt = detect_format(src)
    config, params = load_checkpoint(src, "float32")
    tokens = gate_tokens(config)
    source_logits = float32_logits(config, params, tokens)
    tmp = sibling_temp(dst)
    try:
        gguf.save(config, params, tmp, file_type, _tokenizer_of(src), _template_of(src))
        del params
        written_config, written = load_checkpoint(tmp, "float32")
        err = relative_error(float32_logits(written_config, written, tokens), source_logits)
        if not err <= GGUF_TOLERANCE[file_type]:
            raise ParityError(f"{dst}: the written model's logits differ from the source's by "
                              f"{err:.3g} (relative; allowed {GGUF_TOLERANCE[file_type]:g} for "
                              f"{file_type}); nothing written")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return {"source_format": fmt, "dtype": file_type, "round_trip": err}


def convert_to_peft(src: Path, dst: Path, reference: bool = True) -> dict:
    """A LoRA run's adapters as a PEFT adapter directory at DST (formats/peft.py), through the
    gate: the adapters read back from DST are ours, and — when the run's base is a Hugging Face
    checkpoint and PEFT is installed — PEFT's model (base + adapter) gives our merged model's
    logits."""
    if detect_format(src) != "run" or not workdir.is_lora_run(src):
        raise CheckpointError(f"{src}: --to peft writes a LoRA run's adapters; this is not a "
                              "training run with a lora: section")
    check_new_directory(dst)
    run = workdir.run_config(src)
    adapters = workdir.load_adapters(src)
    base = str(Path(lora_base(run.init_from)).resolve())
    config = run.model.with_execution(quantize=None, quantize_head=False)
    report = {"source_format": "lora run", "base": base}
    with atomic_directory(dst) as tmp:
        peft.save(config, run.lora, adapters, base, tmp)
        _copy_tokenizer(src, tmp)
        _, back = peft.load(tmp, config)
        if jax.tree.map(np.shape, back) != jax.tree.map(np.shape, adapters) or not all(
                np.array_equal(x, y) for x, y in zip(jax.tree.leaves(back),
                                                     jax.tree.leaves(adapters))):
            raise ParityError(f"{dst}: the adapters read back differ from the run's; nothing "
                              "written")
        if reference and detect_format(base) == "hf":
            tokens = gate_tokens(config)
            ref = peft_logits(base, tmp, tokens)
            if ref is not None:
                merged_config, merged = load_checkpoint(src, "float32")
                ours = float32_logits(merged_config, merged, tokens)
                report["vs_peft"] = err = relative_error(ours, ref)
                if not err <= TOLERANCE["float32"]:
                    raise ParityError(f"{dst}: PEFT's logits on {base} with the written adapter "
                                      f"differ from our merged model's by {err:.3g} "
                                      f"(relative; allowed {TOLERANCE['float32']:g}); nothing "
                                      "written")
    return report


def peft_logits(base: str, adapter: Path, tokens: np.ndarray) -> np.ndarray | None:
    """PEFT's float32 logits of the adapter on its transformers base (None when peft or
    transformers is not installed)."""
    try:
        import peft as hf_peft
        import torch
        import transformers
    except ImportError:
        return None
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = hf_peft.PeftModel.from_pretrained(model, str(adapter))
    return _torch_logits(model, tokens)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer and chat template files beside SRC's weights, copied into DST."""
    for name in (*TOKENIZER_FILES, CHAT_TEMPLATE_FILE):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _tokenizer_of(src: Path):
    """The source's tokenizer, or None when it has none (a broken one is an error: a GGUF
    written without its vocabulary would not chat)."""
    return load_tokenizer(src) if has_tokenizer(src) else None


def _template_of(src: Path) -> str | None:
    template = load_chat_template(src)
    return template.text if template is not None else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.formats.convert",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint directory (HF, Meta or llama_jax)")
    parser.add_argument("dst", help="new directory (or .gguf file) to write (must not exist)")
    parser.add_argument("--to", default="native", choices=sorted([*WRITERS, "gguf", "peft"]),
                        help="peft: a LoRA run's adapters as a PEFT adapter directory (hf, "
                             "native, gguf: a LoRA run's merged model)")
    parser.add_argument("--dtype", choices=[*DTYPES, *gguf.GGUF_TYPES], default=None,
                        help="parameter dtype to write (default: as stored); for --to gguf the "
                             "matrices' type (default f16)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the comparison with transformers (saves a second copy in RAM)")
    return parser.parse_args(argv)


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = convert(args.src, args.dst, args.to, args.dtype, not args.no_reference)
    checks = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in report.items())
    print(f"wrote {args.dst} ({args.to}); parity gate passed: {checks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
