"""Peak host memory while loading a checkpoint, relative to one copy of the weights.

    python bench/load_memory.py [--dim 1024] [--layers 8] [--vocab 32000] [--repeats 3]

Writes one random model in each format (HF safetensors, Meta consolidated.00.pth, native orbax)
to a temporary directory, then loads each in a fresh process and reports the peak resident set
size (VmHWM) above the process's RSS after imports, divided by the bytes of the weights in
the target dtype. 1.0x means the loader never held more than the final weights. Target `int8`
is the bf16 model quantized while loading (`quantize="int8"`); the last column divides by the
fp32 weights, so below 1.0x means the float model was never held. transformers'
`from_pretrained` on the same HF directory is measured the same way as the peer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import peak_rss_bytes, rss_bytes, run_child


def child(kind: str, path: str, dtype: str) -> dict:
    import jax

    import llama_jax
    import llama_jax.formats.checkpoint  # noqa: F401 (`import llama_jax` loads modules lazily:
    # the loader's own imports are part of the baseline, not of the load)

    if kind == "transformers":
        import torch
        import transformers
    before = rss_bytes()
    if kind == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype))
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        quantize = "int8" if dtype == "int8" else None  # int8: the bf16 model, quantized
        _, params = llama_jax.load_checkpoint(path, dtype="bfloat16" if quantize else dtype,
                                              quantize=quantize)
        jax.block_until_ready(params)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))  # no host copy
    peak = peak_rss_bytes()
    return {"extra_bytes": peak - before, "weight_bytes": weight_bytes}


def write_checkpoints(root: Path, dim: int, layers: int, vocab: int) -> dict[str, Path]:
    import jax
    import numpy as np
    import torch

    import llama_jax
    from llama_jax.formats.torch_layout import META, torch_tensors

    config = llama_jax.ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers,
                                   n_heads=dim // 64, n_kv_heads=dim // 256)
    params = llama_jax.init_params(config, jax.random.key(0))
    paths = {"hf": root / "hf", "native": root / "native", "meta": root / "meta"}
    llama_jax.export_hf(config, params, paths["hf"])
    llama_jax.save_native(config, params, paths["native"])
    paths["meta"].mkdir()
    state = {name: torch.from_numpy(np.array(w))
             for name, w in torch_tensors(config, params, META)}
    torch.save(state, paths["meta"] / "consolidated.00.pth")
    (paths["meta"] / "params.json").write_text(json.dumps(dict(
        dim=dim, n_layers=layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
        vocab_size=vocab, multiple_of=config.multiple_of, norm_eps=config.norm_eps)))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp), args.dim, args.layers, args.vocab)
        print(f"model D={args.dim} L={args.layers} V={args.vocab}, fp32 on disk; median of "
              f"{args.repeats} fresh processes")
        print("| loader | target dtype | weights MiB | peak extra RSS MiB | ratio | vs fp32 "
              "weights |")
        print("|---|---|---|---|---|---|")
        runs = [("hf", "float32"), ("hf", "bfloat16"), ("hf", "int8"), ("meta", "float32"),
                ("meta", "int8"), ("native", "float32"), ("native", "int8"),
                ("transformers", "float32"), ("transformers", "bfloat16")]
        fp32_bytes = None
        for kind, dtype in runs:
            path = paths["hf" if kind == "transformers" else kind]
            results = []
            for _ in range(args.repeats):
                results.append(run_child(__file__, "--child", kind, str(path), dtype))
            extra = statistics.median(r["extra_bytes"] for r in results)
            weights = results[0]["weight_bytes"]
            fp32_bytes = fp32_bytes or weights  # the first run loads fp32
            name = "transformers from_pretrained" if kind == "transformers" else \
                f"load_checkpoint ({kind})"
            print(f"| {name} | {dtype} | {weights / 2**20:.0f} | {extra / 2**20:.0f} | "
                  f"{extra / weights:.2f}x | {extra / fp32_bytes:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
