"""The GPU execution paths: correctness against references, then training and decode speed
against transformers (PyTorch) and the machine's own measured ceilings, in one run.

    python bench/gpu.py [--sections correctness train decode] [--plan bench|llama3-8b|tiny]
                        [--train-runs RUN ...] [--decode-runs RUN ...] [--dump DIR] [--out DIR]

Every part runs in a child process of its own (the parent never touches the device, so each
child has the whole GPU), and children that are timed against each other run one after another.
`--plan tiny` (or `--tiny`) shrinks every size for a dry run on CPU (cuDNN rows then report that
they need a GPU); `--plan llama3-8b` trains and decodes LLaMA-3-8B (random weights) instead of
the benchmark model, training only when its fp32 state fits the GPU's memory.
`--train-runs`/`--decode-runs` replace the plan's runs (TRAIN_RUNS, DECODE_RUNS below: any
"impl+field=value" or "impl:weights/cache" string). `--dump DIR` has each timed run of ours
write the optimized HLO of its training step (`jit_train_step`) or decode loop (`jit__decode`)
under DIR/RUN (XLA's own dump: the programs that ran, for pricing them afterwards with
`llama_jax.aot.estimate`).

Correctness (relative error ‖out − ref‖/‖ref‖ on random inputs, PASS when ≤ the tolerance;
everything at JAX's default matmul precision: an fp32 model's full precision is the library's
own doing, `llama_jax.nn.ops.matmul_precision`):
- attention: `dot_product_attention` under each implementation (xla and chunked in fp32 and
  bf16, cudnn in bf16) on causal and packed-document (segment ids) masks, GQA, forward output
  and the gradients of q, k, v for a random cotangent, against a float64 numpy reference on the
  same (bf16-representable) inputs;
- the model forward on a packed batch (restarting positions, segment ids) against the CPU
  forward of the same random parameters, computed by a child with JAX_PLATFORMS=cpu: fp32
  (xla, chunked, auto) and bf16 compute with fp32
  master weights (xla, chunked, cudnn) against the CPU's bf16 and fp32 logits;
- cached decode (`apply` with a KV cache: a left-padded ragged prefill, then one token per
  step) against the full forward of each row alone, under both decode implementations (scan
  over stacked layers, unrolled over per-layer ones), fp32 and bf16; for MLA
  (configs/mla-demo.yaml) absorbed and expanded decode, and absorbed against expanded;
- `generate` (greedy, jit-compiled, both decode implementations): tokens equal to the CPU's
  and their log-probabilities against the CPU's.

Speed:
- peak: a jitted 8192³ bf16 matmul on random data (median of 5 timings of 10 back-to-back
  products), and device-to-device copy bandwidth (a jitted copy of a random 2 GiB fp32 array,
  bytes read plus written, median of 5 timings of 10 copies).
- training: D=2048, L=16, N=16, K=8, F=5632, V=32000, seq 2048, batch 4, random tokens; one
  step = forward, backward, global-norm clipping (1.0) and AdamW (weight decay 0.1) with fp32
  master weights and bf16 compute. Ours: the jitted `train_step` with the state donated, under
  attention_impl cudnn (also with the remat policies attention and dots_with_attention, with
  loss_chunk 512, with AdamW's first moment stored in bf16 (mu_dtype), without the XLA flags
  the library sets on GPU ("-gpu-flags",
  LLAMA_JAX_GPU_FLAGS=0) and with XLA's dynamic-slice fusion ("+slice-fusion")), chunked and
  xla. transformers: `LlamaForCausalLM(ids, labels=ids)`
  under `torch.autocast("cuda", bfloat16)` on fp32 weights (eager, its default attention),
  backward, `clip_grad_norm_`, `torch.optim.AdamW` (default foreach), `zero_grad`, a CUDA
  synchronize per step. 3 untimed steps, then 10 timed; medians. MFU = (6·P_mm + 6·L·T·D)
  FLOPs per token (every matmul weight and the LM head; causal attention) × tokens/s ÷ the
  measured bf16 matmul peak. Peak GiB: the allocator's peak (JAX memory_stats,
  torch.cuda.max_memory_allocated).
- decode: the same model in bf16 (weights and cache; random weights exported once to a HF
  directory that both sides load), a 128-token random prompt per row, 128 new tokens, greedy,
  batch 1 and 8. Ours: `generate` under each decode implementation (with and without the
  library's GPU XLA flags; scan also with dynamic-slice fusion), and under scan with int8
  weights (quantized while loading), an int8 KV cache, and both; step ms = decode time after
  the first token / 127. transformers: `generate()` with its default dynamic cache; step
  ms = (time of 128 new tokens − time of 1) / 127. 1 compile run and 1 untimed run, then 3
  timed; medians. Floor = (weight bytes read per step + KV bytes at the mean context of 192
  tokens, int8 values and scales counted as stored) / copy bandwidth. After the table, per
  batch: what `decode_impl="auto"` picks on this GPU against the faster of scan and unrolled.

The last lines printed are the tables; `--out` (default $OUT, else .) gets gpu.json with every
number.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import llama_jax
from llama_jax import xla_flags
from llama_jax.plan import costs
from llama_jax.plan.memory import plan_memory
from llama_jax.config import MeshConfig, TrainConfig
from llama_jax.decode.decoder import cache_bytes_per_device, resolve_decode_impl
from llama_jax.decode.generate import GenerationStats
from llama_jax.shapes import bucket
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.heads import lm_head
from llama_jax.nn.attention.dot_product import Mask, dot_product_attention
from llama_jax.training.optim import make_optimizer
from llama_jax.training.step import init_state, objective, train_step

# Ours as "impl" or "impl+field=value+...": an attention implementation and settings of the
# model's execution (a remat policy, the loss a piece at a time) or of the `train:` section
# (AdamW's first moment in bf16), and transformers.
TRAIN_RUNS = ("cudnn", "cudnn+remat=attention", "cudnn+remat=dots_with_attention",
              "cudnn+loss_chunk=512", "cudnn+mu_dtype=bfloat16", "cudnn -gpu-flags",
              "cudnn +slice-fusion", "chunked", "xla", "transformers")
# Ours as "impl" or "impl:weights/cache" (int8 weights: the bf16 model quantized while loading;
# an int8 KV cache), and transformers.
DECODE_RUNS = ("scan", "unrolled", "scan -gpu-flags", "unrolled -gpu-flags",
               "scan +slice-fusion", "scan:int8/bfloat16", "scan:bfloat16/int8",
               "scan:int8/int8", "transformers")
# A run of ours may end in one of these: it then runs with that environment, to measure XLA
# settings. -gpu-flags: without the XLA flags the library sets on GPU. +slice-fusion: cuBLAS
# reads a layer's weights straight out of the stacked arrays of a scan over layers, where XLA
# otherwise copies each layer's slice out first (a candidate for the library's flags).
ENVIRONMENTS = {" -gpu-flags": {xla_flags.SWITCH: "0"},
                " +slice-fusion": {"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"}}

BIG = llama_jax.ModelConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                            ffn_dim=5632, max_seq_len=2048)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run: FULL on the GPU, TINY for a dry run on CPU."""

    attention_BTNKH: tuple[int, int, int, int, int]  # the attention checks' q/k/v shapes
    check_model: llama_jax.ModelConfig  # the GQA model of the forward and decoder checks
    check_T: int  # tokens per row of the forward checks
    check_blocks: tuple[int, int]  # chunked attention's query x key blocks in the model checks
    prompts: tuple[int, ...]  # prompt lengths of the decoder checks (a ragged batch)
    check_new: int  # tokens decoded per row in the decoder checks
    big: llama_jax.ModelConfig  # the model trained and decoded for speed
    train_batch: int
    train_seq: int
    train_steps: int  # timed; 3 untimed steps come first
    decode_prompt: int
    decode_new: int
    decode_batches: tuple[int, ...]
    decode_repeats: int
    matmul_n: int  # the n of the n³ bf16 peak matmul
    copy_bytes: int
    train_runs: tuple[str, ...] = TRAIN_RUNS
    decode_runs: tuple[str, ...] = DECODE_RUNS


FULL = Plan(attention_BTNKH=(2, 1024, 16, 4, 128),
            check_model=llama_jax.ModelConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8,
                                              n_kv_heads=2, ffn_dim=1536, max_seq_len=1024),
            check_T=640, check_blocks=(256, 128), prompts=(37, 20), check_new=24,
            big=BIG, train_batch=4, train_seq=2048, train_steps=10, decode_prompt=128,
            decode_new=128, decode_batches=(1, 8), decode_repeats=3, matmul_n=8192,
            copy_bytes=2 << 30)
TINY = Plan(attention_BTNKH=(2, 40, 4, 2, 16),
            check_model=llama_jax.ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4,
                                              n_kv_heads=2, ffn_dim=128, max_seq_len=256),
            check_T=48, check_blocks=(16, 8), prompts=(9, 5), check_new=6,
            big=dataclasses.replace(BIG, vocab_size=512, dim=64, n_layers=2, n_heads=4,
                                    n_kv_heads=2, ffn_dim=128, max_seq_len=256),
            train_batch=2, train_seq=64, train_steps=2, decode_prompt=16, decode_new=16,
            decode_batches=(1, 2), decode_repeats=1, matmul_n=256, copy_bytes=4 << 20)
# LLaMA-3-8B, random weights: a training step with remat at 8K context (when its state fits
# the GPU: on an H200, the planner fits only the run with AdamW's first moment in bf16 within
# the 90% of its memory the children take), decode at batch 1 and 8 from a 2K prompt.
LLAMA3_8B = dataclasses.replace(
    FULL, big=llama_jax.load_model_config("llama3-8b"), train_batch=1, train_seq=8192,
    train_steps=5, decode_prompt=2048, train_runs=(
        "cudnn+remat=full", "cudnn+remat=full+loss_chunk=1024+mu_dtype=bfloat16",
        "cudnn+remat=dots_with_attention+loss_chunk=1024", "transformers"),
    decode_runs=("scan", "unrolled", "transformers"))
PLANS = {"bench": FULL, "llama3-8b": LLAMA3_8B, "tiny": TINY}
WARMUP_STEPS = 3
FP32 = "float32"
BF16 = "bfloat16"
# Tolerances on the relative error: fp32 arithmetic in a different order; bf16 operands.
TOL = {FP32: 1e-5, BF16: 2e-2}
TOL_BF16_VS_FP32 = 5e-2  # bf16 compute against the fp32 model: bf16's rounding, not a bug


# --- shared helpers -------------------------------------------------------------------------

def relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def packed_documents(B: int, T: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids `[B, T]` of three documents per row at random cut points, and positions
    restarting at 0 in each document."""
    rng = np.random.default_rng(seed)
    segments_BT, positions_BT = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), 2, replace=False))
        segments_BT[b] = 1 + np.searchsorted(cuts, np.arange(T), side="right")
        positions_BT[b] = np.arange(T) - np.concatenate([[0], cuts])[segments_BT[b] - 1]
    return segments_BT, positions_BT


def check_models(plan: Plan) -> dict[str, llama_jax.ModelConfig]:
    mla = llama_jax.load_model_config("mla-demo")
    return {"gqa": plan.check_model,
            "mla": dataclasses.replace(mla, max_seq_len=plan.check_model.max_seq_len)}


def random_params(config: llama_jax.ModelConfig, seed: int) -> llama_jax.Params:
    """`init_params` with the constant-initialised leaves (gains, biases) made random too, so
    that every leaf matters to the comparisons."""
    params = llama_jax.init_params(config, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [
        leaf + 0.3 * jax.random.normal(k, leaf.shape, leaf.dtype) if leaf.std() == 0 else leaf
        for leaf, k in zip(leaves, keys)])


def model_inputs(plan: Plan, config: llama_jax.ModelConfig):
    """(tokens, positions, segment ids) of the forward checks: two rows of packed documents."""
    tokens_BT = np.random.default_rng(3).integers(0, config.V, (2, plan.check_T), np.int32)
    segments_BT, positions_BT = packed_documents(2, plan.check_T, seed=4)
    return tokens_BT, positions_BT, segments_BT


def check_prompts(plan: Plan, config: llama_jax.ModelConfig) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, config.V, n).tolist() for n in plan.prompts]


forward = jax.jit(llama_jax.forward, static_argnums=0)
cached = jax.jit(lambda c, p, tokens, cache: apply(c, p, tokens, cache=cache)[:2],
                 static_argnums=0)


# --- the CPU reference (a child with JAX_PLATFORMS=cpu) -------------------------------------

def cpu_references(plan: Plan, path: str) -> dict:
    """Writes to `path` (npz), per check model: its random parameters, the CPU forward logits
    in fp32 and bf16 compute, and the CPU's greedy tokens and log-probabilities."""
    arrays = {}
    for i, (name, config) in enumerate(check_models(plan).items()):
        params = random_params(config, seed=i)
        for j, leaf in enumerate(jax.tree.leaves(params)):
            arrays[f"{name}.leaf{j}"] = np.asarray(leaf)
        tokens_BT, positions_BT, segments_BT = model_inputs(plan, config)
        for dtype in (FP32, BF16):
            arrays[f"{name}.{dtype}"] = forward(
                config.with_execution(compute_dtype=dtype), params, tokens_BT,
                positions_BT=positions_BT, segment_ids_BT=segments_BT)
        tokens, logprobs = llama_jax.generate(config, params, check_prompts(plan, config),
                                              plan.check_new, stop_tokens=[],
                                              return_logprobs=True)
        arrays[f"{name}.tokens"], arrays[f"{name}.logprobs"] = np.array(tokens), np.array(logprobs)
    np.savez(path, **arrays)
    return {"backend": jax.default_backend()}


def load_params(refs, name: str, config: llama_jax.ModelConfig) -> llama_jax.Params:
    treedef = jax.tree.structure(llama_jax.abstract_params(config))
    return jax.tree.unflatten(treedef, [jnp.asarray(refs[f"{name}.leaf{j}"])
                                        for j in range(treedef.num_leaves)])


# --- correctness on the device ---------------------------------------------------------------

def row(check: str, errors: dict[str, float], tol: float) -> dict:
    """One line of the correctness table, printed as it comes; NaN never passes."""
    ok = all(e <= tol for e in errors.values())
    result = {"check": check, "errors": errors, "tol": tol, "pass": ok}
    print(format_row(result), flush=True)
    return result


def format_row(r: dict) -> str:
    errors = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
    return f"| {r['check']} | {errors} | {r['tol']:.0e} | {'PASS' if r['pass'] else 'FAIL'} |"


def runs_here(impl: str) -> bool:
    if impl == "cudnn" and jax.default_backend() != "gpu":
        print(f"| {impl} | skipped: needs an NVIDIA GPU | | |", flush=True)
        return False
    return True


def reference_attention(q_BTNH, k_BSKH, v_BSKH, visible_BTS, cot_BTNH):
    """Float64 causal attention with grouped K/V heads and its vjp for the cotangent
    `cot_BTNH`: (out, (dq, dk, dv)) in the inputs' layouts."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    G, scale = N // K, H ** -0.5

    def grouped(x_BTNH):  # [B, K, G, T, H]
        return np.asarray(x_BTNH, np.float64).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)

    def ungrouped(x_BKGTH):
        return x_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)

    q, d_out = grouped(q_BTNH), grouped(cot_BTNH)
    k, v = (np.asarray(x, np.float64).transpose(0, 2, 1, 3)[:, :, None] for x in (k_BSKH, v_BSKH))
    s = np.where(visible_BTS[:, None, None], q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = d_out @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dk = (ds.swapaxes(-1, -2) @ q).sum(2).transpose(0, 2, 1, 3)
    dv = (p.swapaxes(-1, -2) @ d_out).sum(2).transpose(0, 2, 1, 3)
    return ungrouped(p @ v), (ungrouped(ds @ k), dk, dv)


@functools.partial(jax.jit, static_argnames=("impl",))
def attention_vjp(q, k, v, mask, cot, *, impl):
    out, pullback = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, mask, impl=impl),
                            q, k, v)
    return out, pullback(cot.astype(out.dtype))


def attention_checks(plan: Plan) -> list[dict]:
    """Each implementation's output and q/k/v gradients against the float64 reference, on
    inputs rounded to bf16 once so that every dtype sees the same numbers."""
    B, T, N, K, H = plan.attention_BTNKH
    rng = np.random.default_rng(1)
    shapes = {"q": (B, T, N, H), "k": (B, T, K, H), "v": (B, T, K, H), "cot": (B, T, N, H)}
    x = {n: np.asarray(jnp.asarray(rng.standard_normal(s), BF16), np.float32)
         for n, s in shapes.items()}
    segments_BT, _ = packed_documents(B, T, seed=2)
    causal_TS = np.tril(np.ones((T, T), bool))
    masks = {"causal": (None, np.broadcast_to(causal_TS, (B, T, T))),
             "packed": (segments_BT, causal_TS & (segments_BT[:, :, None]
                                                  == segments_BT[:, None, :]))}
    rows = []
    for mask_name, (segments, visible_BTS) in masks.items():
        ref_out, ref_grads = reference_attention(x["q"], x["k"], x["v"], visible_BTS, x["cot"])
        mask = Mask.causal(B, T, None if segments is None else jnp.asarray(segments))
        for impl, dtype in (("xla", FP32), ("chunked", FP32), ("xla", BF16),
                            ("chunked", BF16), ("cudnn", BF16)):
            if not runs_here(impl):
                continue
            q, k, v, cot = (jnp.asarray(x[n], dtype) for n in ("q", "k", "v", "cot"))
            out, grads = attention_vjp(q, k, v, mask, cot, impl=impl)
            errors = {"out": relative_error(out, ref_out)}
            errors |= {f"d{n}": relative_error(g, r) for n, g, r in zip("qkv", grads, ref_grads)}
            rows.append(row(f"attention {impl} {dtype} {mask_name} vs float64 numpy", errors,
                            TOL[dtype]))
    return rows


def forward_checks(plan: Plan, name: str, config, params, refs) -> list[dict]:
    """The device's forward against the CPU's on a packed batch."""
    tokens_BT, positions_BT, segments_BT = model_inputs(plan, config)
    q_block, kv_block = plan.check_blocks
    cases = [(FP32, "xla"), (FP32, "chunked"), (FP32, "auto"),
             (BF16, "xla"), (BF16, "chunked"), (BF16, "cudnn")]
    rows = []
    for dtype, impl in cases:
        if not runs_here(impl):
            continue
        run = config.with_execution(compute_dtype=dtype, attention_impl=impl,
                                    attention_block_q=q_block, attention_block_kv=kv_block)
        logits = forward(run, params, tokens_BT, positions_BT=positions_BT,
                         segment_ids_BT=segments_BT)
        errors = {f"vs CPU {dtype}": relative_error(logits, refs[f"{name}.{dtype}"])}
        tol = TOL[dtype]
        if dtype == BF16:
            errors["vs CPU fp32"] = relative_error(logits, refs[f"{name}.{FP32}"])
            tol = TOL_BF16_VS_FP32
        rows.append(row(f"{name} forward {dtype} {impl}", errors, tol))
    return rows


def decoded_and_full_logits(plan: Plan, config, params, impl: str):
    """A left-padded ragged batch prefilled, then decoded one token per step under `impl`:
    (the decoded logits per row `[steps, V]`, the full forward's logits of that row alone)."""
    lengths, steps = plan.prompts, plan.check_new
    T = max(lengths)
    rng = np.random.default_rng(6)
    rows = [rng.integers(0, config.V, n + steps, np.int32) for n in lengths]
    layers, layout = (params, "stacked") if impl == "scan" else (unstack_layers(params),
                                                                 "per_layer")
    prompt_BT = np.zeros((len(rows), T), np.int32)
    for b, (tokens, n) in enumerate(zip(rows, lengths)):
        prompt_BT[b, T - n:] = tokens[:n]
    cache = init_cache(config, len(rows), T + steps, layout=layout,
                       start_B=jnp.asarray([T - n for n in lengths]))
    h_BTD, cache = cached(config, layers, prompt_BT, cache)
    logits = [lm_head(config, params, h_BTD)[:, -1]]
    for t in range(steps - 1):
        step_B1 = np.array([[tokens[n + t]] for tokens, n in zip(rows, lengths)], np.int32)
        h_BTD, cache = cached(config, layers, step_B1, cache)
        logits.append(lm_head(config, params, h_BTD)[:, -1])
    decoded_BSV = np.stack(logits, axis=1)
    full = [forward(config, params, tokens[None, :n + steps - 1])[0, n - 1:]
            for tokens, n in zip(rows, lengths)]
    return decoded_BSV, full


def cache_checks(plan: Plan, name: str, config, params) -> list[dict]:
    """Cached decode == full forward under both decode implementations (GQA: fp32 and bf16;
    MLA: absorbed and expanded in fp32, and absorbed == expanded)."""
    variants = ([(dtype, None) for dtype in (FP32, BF16)] if config.attention != "mla"
                else [(FP32, "absorbed"), (FP32, "expanded")])
    rows, decoded = [], {}
    for dtype, mla_decode in variants:
        run = config.with_execution(compute_dtype=dtype, **({"mla_decode": mla_decode}
                                                            if mla_decode else {}))
        for impl in ("scan", "unrolled"):
            got, full = decoded_and_full_logits(plan, run, params, impl)
            decoded[mla_decode, impl] = got
            errors = {f"row {b}": relative_error(got[b], f) for b, f in enumerate(full)}
            label = f" {mla_decode}" if mla_decode else ""
            rows.append(row(f"{name} cached decode{label} {dtype} {impl} == full forward",
                            errors, TOL[dtype]))
    if config.attention == "mla":
        errors = {impl: relative_error(decoded["absorbed", impl], decoded["expanded", impl])
                  for impl in ("scan", "unrolled")}
        rows.append(row(f"{name} absorbed == expanded decode {FP32}", errors, TOL[FP32]))
    return rows


def generate_checks(plan: Plan, name: str, config, params, refs) -> list[dict]:
    """Greedy `generate` (fp32) on the device under both decode implementations against the
    CPU's: tokens identical (the error is the fraction that differ), log-probabilities."""
    rows = []
    for impl in ("scan", "unrolled"):
        tokens, logprobs = llama_jax.generate(config, params, check_prompts(plan, config),
                                              plan.check_new, stop_tokens=[],
                                              decode_impl=impl, return_logprobs=True)
        differ = float(np.mean(np.array(tokens) != refs[f"{name}.tokens"]))
        rows.append(row(f"{name} generate {impl}: greedy tokens == CPU", {"differ": differ}, 0))
        rows.append(row(f"{name} generate {impl}: log-probs vs CPU",
                        {"logprobs": relative_error(logprobs, refs[f"{name}.logprobs"])},
                        TOL[FP32]))
    return rows


def run_checks(plan: Plan, ref_path: str) -> dict:
    print(f"device: {jax.devices()[0].device_kind}; tolerances on ‖out − ref‖/‖ref‖",
          flush=True)
    print("| check | errors | tolerance | result |\n|---|---|---|---|", flush=True)
    rows = attention_checks(plan)
    refs = np.load(ref_path)
    for name, config in check_models(plan).items():
        params = load_params(refs, name, config)
        rows += forward_checks(plan, name, config, params, refs)
        rows += cache_checks(plan, name, config, params)
        rows += generate_checks(plan, name, config, params, refs)
    return {"device": jax.devices()[0].device_kind, "rows": rows}


# --- ceilings ---------------------------------------------------------------------------------

def median_rate(fn, args, work: float, calls: int = 10, timings: int = 5) -> float:
    """`work` per call × calls / seconds of `calls` back-to-back calls; median of `timings`."""
    jax.block_until_ready(fn(*args))
    rates = []
    for _ in range(timings):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        rates.append(work * calls / (time.perf_counter() - start))
    return statistics.median(rates)


def measure_peak(plan: Plan) -> dict:
    n = plan.matmul_n
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16)
            for k in jax.random.split(jax.random.key(0), 2))
    x = jax.random.normal(jax.random.key(1), (plan.copy_bytes // 4,), jnp.float32)
    import torch
    import transformers
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "bf16_matmul_flops": median_rate(jax.jit(jnp.matmul), (a, b), 2 * n ** 3),
            "copy_bytes_per_s": median_rate(jax.jit(jnp.copy), (x,), 2 * x.nbytes),
            "memory_bytes": (jax.devices()[0].memory_stats() or {}).get("bytes_limit",
                                                                       host_memory_bytes())}


def host_memory_bytes() -> int:
    """The host's memory (the CPU backend reports no device limit)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- training -------------------------------------------------------------------------------

def run_settings(run: str) -> tuple[str, dict, dict]:
    """A run of ours, "impl+field=value+...": its attention implementation, then its settings
    of the model's execution and of the `train:` section."""
    impl, *settings = run.split("+")
    fields = {field: int(value) if value.isdigit() else value
              for field, _, value in (s.partition("=") for s in settings)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return (impl, {k: v for k, v in fields.items() if k not in train_fields},
            {k: v for k, v in fields.items() if k in train_fields})


def train_config(plan: Plan, run: str = "cudnn") -> TrainConfig:
    return TrainConfig(seq_len=plan.train_seq, batch_size=plan.train_batch, steps=10_000,
                       warmup_steps=100, **run_settings(run)[2])


def random_windows(plan: Plan) -> np.ndarray:
    """`[B, T + 1]` random tokens, BOS first: one document per row."""
    window = np.random.default_rng(0).integers(3, plan.big.V,
                                               (plan.train_batch, plan.train_seq + 1))
    window[:, 0] = 1
    return window.astype(np.int32)


def peak_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2 ** 30 or None


def run_config(plan: Plan, run: str) -> llama_jax.ModelConfig:
    """The trained model of a run of ours."""
    impl, fields, _ = run_settings(run)
    return plan.big.with_execution(compute_dtype=BF16, attention_impl=impl, **fields)


def planned_training_bytes(plan: Plan, run: str) -> int:
    """The planner's bytes for a run on one GPU: all of ours; for transformers, whose
    activations it does not model, the fp32 weights, gradients and AdamW moments alone."""
    ours = run != "transformers"
    config = run_config(plan, run) if ours else plan.big
    planned = plan_memory(config, MeshConfig(), 1, batch=plan.train_batch, seq=plan.train_seq,
                          remat=config.remat, backend="gpu",
                          mu_dtype=train_config(plan, run).mu_dtype if ours else None)
    return planned.training if ours else planned.weights + planned.gradients + planned.optimizer


def compiled_train_step(plan: Plan, run: str):
    """(the compiled step of a run of ours, with its state donated; the first state; the
    batch; the compile seconds)."""
    config = run_config(plan, run)
    train = train_config(plan, run)
    optimizer = make_optimizer(config, train)
    state = jax.jit(functools.partial(init_state, config, optimizer))(jax.random.key(0))
    loss_fn = objective(llama_jax.RunConfig(model=config, train=train), 1)  # packed windows
    step = jax.jit(functools.partial(train_step, config, train, optimizer, loss_fn),
                   donate_argnums=0)
    batch = jnp.asarray(random_windows(plan))
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - start


def train_ours(plan: Plan, run: str) -> dict:
    compiled, state, batch, compile_s = compiled_train_step(plan, run)
    times, losses = [], []
    for i in range(WARMUP_STEPS + plan.train_steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - start)
    return {"step_s": times[WARMUP_STEPS:], "compile_s": compile_s, "peak_gib": peak_gib(),
            "first_loss": losses[0], "last_loss": losses[-1]}


def train_transformers(plan: Plan) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = plan.big
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=c.V, hidden_size=c.D, intermediate_size=c.F, num_hidden_layers=c.L,
            num_attention_heads=c.N, num_key_value_heads=c.K, max_position_embeddings=c.max_seq_len,
            rms_norm_eps=c.norm_eps, tie_word_embeddings=False))
    ids = torch.as_tensor(random_windows(plan)[:, :plan.train_seq], dtype=torch.long,
                          device=device)  # labels shift inside
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    times, losses = [], []
    for _ in range(WARMUP_STEPS + plan.train_steps):
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # waits for the device
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None
    return {"step_s": times[WARMUP_STEPS:], "peak_gib": peak, "first_loss": losses[0],
            "last_loss": losses[-1], "attention": model.config._attn_implementation}


# --- decode ---------------------------------------------------------------------------------

def export_decode_model(plan: Plan, hf_dir: str) -> dict:
    config = plan.big.with_execution(param_dtype=BF16, compute_dtype=BF16)
    llama_jax.export_hf(config, llama_jax.init_params(config, jax.random.key(0)), hf_dir)
    return {"params": costs.param_counts(config).total}


def decode_prompts(plan: Plan, batch: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, plan.big.V, (batch, plan.decode_prompt))


def decode_case(run: str) -> tuple[str, str | None, str]:
    """(decode impl, quantize, cache dtype) of a run "impl[:weights/cache]"."""
    impl, _, case = run.partition(":")
    weights, cache_dtype = (case or f"{BF16}/{BF16}").split("/")
    return impl, "int8" if weights == "int8" else None, cache_dtype


def decode_ours(plan: Plan, run: str, hf_dir: str) -> dict:
    impl, quantize, cache_dtype = decode_case(run)
    config, params = llama_jax.load_checkpoint(hf_dir, dtype=BF16, quantize=quantize)
    auto = {b: auto_choice(plan, config, params, b, cache_dtype) for b in plan.decode_batches}
    results = {}
    for batch in plan.decode_batches:
        prompts = decode_prompts(plan, batch).tolist()
        warm = GenerationStats()
        for _ in range(2):  # the first compiles
            llama_jax.generate(config, params, prompts, plan.decode_new, stop_tokens=[],
                               decode_impl=impl, cache_dtype=cache_dtype, stats=warm)
        walls, steps = [], []
        for _ in range(plan.decode_repeats):
            stats = GenerationStats()
            start = time.perf_counter()
            llama_jax.generate(config, params, prompts, plan.decode_new, stop_tokens=[],
                               decode_impl=impl, cache_dtype=cache_dtype, stats=stats)
            walls.append(time.perf_counter() - start)
            steps.append(stats.decode_s / (plan.decode_new - 1))
        results[batch] = {"step_s": statistics.median(steps), "wall_s": statistics.median(walls),
                          "compile_s": warm.compile_s, "auto": auto[batch]}
    return results


def auto_choice(plan: Plan, config, params, batch: int, cache_dtype: str) -> str:
    """What decode_impl="auto" picks for this batch (`generate`'s buckets and cache reserve),
    with the decoder's copy of these weights not yet made."""
    slots = bucket(plan.decode_prompt) + bucket(plan.decode_new)
    reserve = cache_bytes_per_device(config, params, bucket(batch, 1), slots, cache_dtype, None)
    return resolve_decode_impl("auto", params, reserve)


def decode_transformers(plan: Plan, hf_dir: str) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.bfloat16).to(device).eval()

    def wall(ids, new: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    results = {}
    for batch in plan.decode_batches:
        ids = torch.as_tensor(decode_prompts(plan, batch), device=device)
        for _ in range(2):
            wall(ids, plan.decode_new)
        walls = [(wall(ids, plan.decode_new), wall(ids, 1)) for _ in range(plan.decode_repeats)]
        full, first = (statistics.median(w) for w in zip(*walls))
        results[batch] = {"step_s": (full - first) / (plan.decode_new - 1), "wall_s": full,
                          "compile_s": None}
    return {"per_batch": results, "attention": model.config._attn_implementation}


# --- the parent: children, tables --------------------------------------------------------------

WORKERS = {
    "cpu-ref": cpu_references, "checks": run_checks, "peak": measure_peak,
    "train": lambda plan, impl: (train_transformers(plan) if impl == "transformers"
                                 else train_ours(plan, impl)),
    "export": export_decode_model,
    "decode": lambda plan, impl, hf_dir: (decode_transformers(plan, hf_dir)
                                          if impl == "transformers"
                                          else {"per_batch": decode_ours(plan, impl, hf_dir)}),
}


def run_worker(kind: str, args: list[str], plan: Plan, result_path: str) -> None:
    """In the child: runs `kind` and writes its JSON result (or the error) to `result_path`."""
    try:
        result = WORKERS[kind](plan, *args)
        result["xla_flags"] = os.environ.get("XLA_FLAGS")  # as `import llama_jax` left them
    except Exception as e:  # an OOM or a backend refusal is a result to report
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    Path(result_path).write_text(json.dumps(result))


# The programs `--dump` keeps: the training step and the decode loop.
DUMPED_MODULES = "jit_train_step|jit__decode"


def dump_flags(directory: Path) -> str:
    """XLA flags that write the optimized HLO of DUMPED_MODULES under `directory`."""
    return (f"--xla_dump_to={directory} --xla_dump_hlo_as_text "
            f"--xla_dump_hlo_module_re={DUMPED_MODULES}")


def child(kind: str, *args: str, plan: str, cpu: bool = False,
          run_env: dict | None = None) -> dict:
    """Runs a worker in a fresh process (its output goes to ours) and returns its result.
    `run_env` adds to our environment; its XLA_FLAGS add to ours."""
    run_env = run_env or {}
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9", **run_env}
    if run_env.get(xla_flags.SWITCH) == "0":  # ours has them, from `import llama_jax`
        env["XLA_FLAGS"] = xla_flags.without_gpu_flags(os.environ.get("XLA_FLAGS", ""))
    if "XLA_FLAGS" in run_env:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {run_env['XLA_FLAGS']}".strip()
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--worker", kind, *args, "--result", str(result)]
        code = subprocess.run(command + ["--plan", plan], env=env).returncode
        if not result.exists():
            return {"error": f"worker {kind} {' '.join(args)} exited with {code}"}
        return json.loads(result.read_text())


def run_child(kind: str, run: str, *args: str, plan: str, dump: Path | None) -> dict:
    """`child` for one run of TRAIN_RUNS or DECODE_RUNS, in the environment it names; with
    `dump`, a run of ours writes its programs under dump/KIND-RUN."""
    base, env = split_run(run)
    if dump is not None and base != "transformers":
        directory = dump / re.sub(r"[^A-Za-z0-9_.=-]", "_", f"{kind}-{run}")
        env = {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {dump_flags(directory)}"}
    return child(kind, base, *args, plan=plan, run_env=env)


def split_run(run: str) -> tuple[str, dict]:
    """A run without its ENVIRONMENTS suffix, and that environment."""
    for suffix, env in ENVIRONMENTS.items():
        if run.endswith(suffix):
            return run.removesuffix(suffix), env
    return run, {}


def correctness(name: str, tmp: str) -> dict:
    ref_path = str(Path(tmp) / "cpu_refs.npz")
    refs = child("cpu-ref", ref_path, plan=name, cpu=True)
    return refs if "error" in refs else child("checks", ref_path, plan=name)


def training(name: str, plan: Plan, peak: dict, dump: Path | None) -> dict:
    if "error" in peak:
        return {"error": f"no matmul peak measured: {peak['error']}"}
    runs = {}
    for run in plan.train_runs:
        planned = planned_training_bytes(plan, split_run(run)[0])
        runs[run] = (run_child("train", run, plan=name, dump=dump) if planned <= peak["memory_bytes"] else
                     {"error": f"planned {planned / 2 ** 30:.0f} GiB (weights, gradients, "
                               f"AdamW moments, activations) > the device's "
                               f"{peak['memory_bytes'] / 2 ** 30:.0f} GiB: not run"})
    flops = costs.train_flops_per_token(plan.big, plan.train_seq)
    tokens = plan.train_batch * plan.train_seq
    for r in runs.values():
        if "error" not in r:
            r["tokens_per_s"] = tokens / statistics.median(r["step_s"])
            r["mfu"] = flops * r["tokens_per_s"] / peak["bf16_matmul_flops"]
    return {"flops_per_token": flops, "tokens_per_step": tokens, "runs": runs}


def decoding(name: str, plan: Plan, peak: dict, tmp: str, dump: Path | None) -> dict:
    if "error" in peak:
        return {"error": f"no bandwidth measured: {peak['error']}"}
    hf_dir = str(Path(tmp) / "hf")
    exported = child("export", hf_dir, plan=name)
    if "error" in exported:
        return exported
    runs = {run: run_child("decode", run, hf_dir, plan=name, dump=dump)
            for run in plan.decode_runs}
    context = plan.decode_prompt + plan.decode_new // 2

    def floor_s(run: str, batch: int) -> float:
        _, quantize, cache_dtype = decode_case(run)
        config = plan.big.with_execution(quantize=quantize)
        return (costs.decode_bytes_per_step(config, batch, context, BF16, cache_dtype)
                / peak["copy_bytes_per_s"])
    floors = {run: {b: floor_s(run, b) for b in plan.decode_batches}
              for run in plan.decode_runs}
    return {"floor_s": floors, "context": context, "runs": runs}


def print_header(results: dict, plan: Plan) -> None:
    peak = results.get("peak", {})
    versions = ", ".join(f"{name} {peak[name]}" for name in ("jax", "torch", "transformers")
                         if peak.get(name))  # known once a timed section ran
    print(f"\n### {peak.get('device') or results.get('correctness', {}).get('device')}"
          + (f": {versions}" if versions else ""))
    if "bf16_matmul_flops" in peak:
        print(f"bf16 {plan.matmul_n}³ matmul {peak['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s; "
              f"copy {peak['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
        print(f"XLA_FLAGS after `import llama_jax`: {peak.get('xla_flags')}")


def print_correctness(checks: dict, plan: Plan) -> None:
    if "error" in checks:
        print(f"correctness: {checks['error']}")
        return
    rows = checks["rows"]
    print(f"\ncorrectness: {sum(r['pass'] for r in rows)}/{len(rows)} pass\n"
          "| check | errors | tolerance | result |\n|---|---|---|---|")
    for r in rows:
        print(format_row(r))


def print_training(training: dict, plan: Plan) -> None:
    if "error" in training:
        print(f"training: {training['error']}")
        return
    c = plan.big
    print(f"\ntraining D={c.D} L={c.L} N={c.N} K={c.K} F={c.F} V={c.V}, batch "
          f"{plan.train_batch} x seq {plan.train_seq}, bf16 compute / fp32 masters, AdamW; "
          f"MFU = (6·P_mm + 6·L·T·D) = {training['flops_per_token'] / 1e9:.2f} GFLOP/token "
          "× tok/s / measured bf16 peak\n"
          "| implementation | tok/s | step ms (min-max) | MFU | vs transformers | peak GiB "
          "| compile s | loss first→last |\n|---|---|---|---|---|---|---|---|")
    runs = training["runs"]
    theirs = runs.get("transformers", {}).get("tokens_per_s")
    for impl, r in runs.items():
        if "error" in r:
            print(f"| {impl} | {r['error']} | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / theirs:.2f}x" if theirs else "-"
        name = f"transformers ({r['attention']}, autocast)" if impl == "transformers" else impl
        compile_s = f"{r['compile_s']:.0f}" if "compile_s" in r else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] else "-"
        print(f"| {name} | {r['tokens_per_s']:.0f} | {statistics.median(r['step_s']) * 1e3:.0f} "
              f"({min(r['step_s']) * 1e3:.0f}-{max(r['step_s']) * 1e3:.0f}) | {r['mfu']:.1%} | "
              f"{ratio} | {peak} | {compile_s} | {r['first_loss']:.2f}→{r['last_loss']:.2f} |")


def base_run(run: str) -> str | None:
    """The decode run a run's step is compared with: itself in the default environment, or
    bf16 scan for an int8 one."""
    base, env = split_run(run)
    if env:
        return base
    return "scan" if ":" in run else None


def print_decode(decode: dict, plan: Plan) -> None:
    if "error" in decode:
        print(f"decode: {decode['error']}")
        return
    print(f"\ndecode bf16 weights and cache (int8 where a run names it: weights/cache), prompt "
          f"{plan.decode_prompt}, {plan.decode_new} new "
          f"tokens, greedy; floor = (weights + KV at context {decode['context']}) / copy "
          "bandwidth; base: scan bf16 for int8 runs, the same run without its -/+ setting\n"
          "| batch | implementation | step ms | floor ms | % of floor | vs transformers "
          "(step) | step vs base | tok/s (whole call) | compile s |\n"
          "|---|---|---|---|---|---|---|---|---|")
    runs = decode["runs"]

    def step_s(run: str, batch: int) -> float | None:
        return runs.get(run, {}).get("per_batch", {}).get(str(batch), {}).get("step_s")
    for batch in plan.decode_batches:
        theirs = step_s("transformers", batch)
        for run, r in runs.items():
            if "error" in r:
                print(f"| {batch} | {run} | {r['error']} | | | | | | |")
                continue
            m = r["per_batch"][str(batch)]
            name = f"transformers ({r['attention']})" if run == "transformers" else run
            ratio = f"{theirs / m['step_s']:.2f}x" if theirs else "-"
            base = step_s(base_run(run), batch) if base_run(run) in runs else None
            vs_base = f"{m['step_s'] / base:.2f}x" if base else "-"
            floor = decode["floor_s"].get(run, {}).get(batch)
            floors = (f"{floor * 1e3:.2f} | {floor / m['step_s']:.0%}" if floor is not None
                      else "- | -")
            compile_s = f"{m['compile_s']:.1f}" if m["compile_s"] is not None else "-"
            print(f"| {batch} | {name} | {m['step_s'] * 1e3:.2f} | {floors} | {ratio} | "
                  f"{vs_base} | {batch * plan.decode_new / m['wall_s']:.0f} | {compile_s} |")
    for batch in plan.decode_batches:  # is "auto" the faster decoder here?
        measured = {run: step_s(run, batch) for run in ("scan", "unrolled")}
        picks = {runs[run]["per_batch"][str(batch)].get("auto") for run in measured
                 if step_s(run, batch) is not None}
        if None not in measured.values():
            print(f"batch {batch}: decode_impl='auto' picks {', '.join(sorted(picks))}; "
                  f"faster here: {min(measured, key=measured.get)}")


PRINTERS = {"correctness": print_correctness, "train": print_training, "decode": print_decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=["correctness", "train", "decode"],
                        choices=["correctness", "train", "decode"])
    parser.add_argument("--plan", default="bench", choices=list(PLANS),
                        help="bench: the benchmark model (default); llama3-8b: LLaMA-3-8B's "
                             "training step and decode; tiny: toy sizes, for a CPU dry run")
    parser.add_argument("--tiny", action="store_true", help="the same as --plan tiny")
    parser.add_argument("--train-runs", nargs="+", help="instead of the plan's training runs")
    parser.add_argument("--decode-runs", nargs="+", help="instead of the plan's decode runs")
    parser.add_argument("--dump", type=Path, help="write each timed run's optimized HLO here")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    name = "tiny" if args.tiny else args.plan
    plan = PLANS[name]
    if args.worker:
        run_worker(args.worker[0], args.worker[1:], plan, args.result)
        return

    plan = dataclasses.replace(plan, train_runs=tuple(args.train_runs or plan.train_runs),
                               decode_runs=tuple(args.decode_runs or plan.decode_runs))
    results: dict = {"plan": dataclasses.asdict(plan)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sections = {
            "correctness": lambda: correctness(name, tmp),
            "train": lambda: training(name, plan, results["peak"], args.dump),
            "decode": lambda: decoding(name, plan, results["peak"], tmp, args.dump)}
        for section in args.sections:
            if section != "correctness" and "peak" not in results:
                results["peak"] = child("peak", plan=name)
            results[section] = sections[section]()
            # Kept after each section: a run cut short still leaves what it measured.
            (out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
            PRINTERS[section](results[section], plan)
    print_header(results, plan)
    for section in args.sections:
        PRINTERS[section](results[section], plan)


if __name__ == "__main__":
    main()
