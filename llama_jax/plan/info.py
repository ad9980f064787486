"""Planner: sizes, bytes and FLOPs of a model without allocating it, and a training plan on a
device mesh.

    python -m llama_jax.plan.info PRESET_OR_CONFIG_FILE [--batch B] [--seq S] [--dtype D]
                             [--bandwidth GBPS] [--json]
                             [--mesh data=D,fsdp=F,tensor=T[,expert=E]
                              --hardware {cpu,v5e,v5p,v6e,h100,h200} --remat POLICY
                              --mfu 0.4 --compute-dtype bfloat16
                              --attention-impl {auto,xla,chunked,cudnn,splash}]

All numbers come from `llama_jax.plan.costs` and `llama_jax.plan.memory`; the formulas are printed next
to the figures. With `--mesh` (or `--hardware`) it adds per-device training memory (weights,
gradients, AdamW state, activations under the remat policy and the attention implementation as
it would run on that hardware), the KV cache of B x S tokens per device, and the step time at
the stated MFU. `--batch` is then the global batch in sequences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from llama_jax.plan import costs, hardware, memory
from llama_jax.plan.costs import format_bytes
from llama_jax.plan.serving import ServerShape
from llama_jax.parallel import sharding, topology
from llama_jax.cli import add_int8_arguments, user_errors_exit
from llama_jax.parallel.sharding import MESH_AXES
from llama_jax.config import (DTYPES, REMAT_POLICIES, MeshConfig, ModelConfig, load_sections,
                              parse_mesh)
from llama_jax.config.run import MU_DTYPES
from llama_jax.errors import ConfigError, GenerateError
from llama_jax.nn.attention.dot_product import ATTENTION_IMPLS, chosen_attention

DEFAULT_BANDWIDTH_GBPS = hardware.HARDWARE["h100"].bandwidth / 1e9


def plan(config: ModelConfig, *, batch: int, seq: int, dtype: str,
         bandwidth_gbps: float, cache_dtype: str | None = None) -> dict:
    """Everything the planner reports, as plain data (the `--json` object). The decode floor
    reads the weights as `config` stores them (`dtype`, or int8 where `config.quantize`) and
    the KV cache in `cache_dtype` (default `dtype`)."""
    counts = costs.param_counts(config)
    cache_dtype = cache_dtype or dtype
    kv_per_token = costs.kv_cache_bytes_per_token(config, cache_dtype)
    head_kv = config.H + config.v_head_dim  # one head's key and value
    step_bytes = costs.decode_bytes_per_step(config, batch, seq, dtype, cache_dtype)
    floor_s = step_bytes / (bandwidth_gbps * 1e9)
    return {
        "config": {"D": config.D, "L": config.L, "N": config.N, "K": config.K, "H": config.H,
                   "F": config.F, "V": config.V, "max_seq_len": config.max_seq_len,
                   "tie_embeddings": config.tie_embeddings, "rope_theta": config.rope_theta,
                   "rope_type": config.rope_type, "positions": config.positions,
                   "mlp": config.mlp,
                   "moe": config.moe and {"E": config.moe.n_experts, "top_k": config.moe.top_k,
                                          "M": config.expert_ffn_dim},
                   "attention": config.attention,
                   "mla": config.mla and {"Z": config.mla.kv_lora_rank,
                                          "I": config.mla.qk_rope_head_dim,
                                          "J": config.mla.qk_nope_head_dim,
                                          "Y": config.mla.v_head_dim,
                                          "Q": config.mla.q_lora_rank}},
        "n_params": counts.total,
        "n_params_embedding": counts.embedding,
        "n_params_lm_head": counts.lm_head,
        "n_params_non_embedding": counts.non_embedding,
        "n_params_matmul": counts.matmul,
        "n_params_active": counts.active,
        "weight_bytes": {d: counts.total * costs.dtype_bytes(d) for d in DTYPES},
        "weight_bytes_quantized": config.quantize and costs.weight_bytes(config, dtype),
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "quantize": config.quantize,
        "cache_dtype": cache_dtype,
        "kv_cache_bytes_per_token": kv_per_token,
        # what multi-head (K = N) and multi-query (K = 1) attention with these head widths
        # would cache, for comparison
        "kv_cache_mha_bytes_per_token": config.L * config.N * head_kv
        * costs.dtype_bytes(dtype),
        "kv_cache_mqa_bytes_per_token": config.L * head_kv * costs.dtype_bytes(dtype),
        "kv_cache_bytes": kv_per_token * batch * seq,
        "train_flops_per_token": costs.train_flops_per_token(config, seq),
        "train_flops_formula": costs.TRAIN_FLOPS_FORMULA,
        "decode_bytes_per_step": step_bytes,
        "decode_bytes_formula": costs.DECODE_BYTES_FORMULA,
        "bandwidth_gbps": bandwidth_gbps,
        "decode_floor_s_per_step": floor_s,
        "decode_floor_tokens_per_s": batch / floor_s,
    }


def plan_training(config: ModelConfig, mesh: MeshConfig, *, batch: int, seq: int, remat: str,
                  compute_dtype: str, device: hardware.Hardware, mfu: float,
                  kv_dtype: str, attention_impl: str = "auto",
                  loss_chunk: int | None = None, mu_dtype: str | None = None) -> dict:
    """Per-device memory and step time of training `config` on `mesh` of `device`s."""
    n_devices = math.prod(mesh.sizes)
    config = config.with_execution(remat=remat, compute_dtype=compute_dtype,
                                   param_dtype="float32", attention_impl=attention_impl,
                                   loss_chunk=loss_chunk)
    batch_ways = sharding.batch_shards(mesh, dict(zip(MESH_AXES, mesh.sizes)))
    if batch % batch_ways:
        raise ConfigError(f"--batch {batch} does not split over data x fsdp x expert = "
                          f"{batch_ways}")
    def planned(mesh: MeshConfig) -> memory.MemoryPlan:
        return memory.plan_memory(config, mesh, n_devices, batch=batch, seq=seq, remat=remat,
                                  kv_batch=batch, kv_dtype=kv_dtype, backend=device.backend,
                                  mu_dtype=mu_dtype)
    m = planned(mesh)
    # Over tensor parallelism each device of a tensor group holds the whole residual stream
    # unless the rules split its sequence (sequence parallelism): what that would hold
    rules = dict(mesh.activation_rules)
    sequence_parallel = None if m.mesh["tensor"] == 1 or rules.get("residual_seq") else planned(
        dataclasses.replace(mesh, activation_rules={**rules, "residual_seq": "tensor"})).training
    flops = costs.train_flops_per_token(config, seq) * batch * seq
    step_s = flops / (n_devices * device.peak_bf16_flops * mfu)
    return {"mesh": m.mesh, "devices": n_devices, "hardware": device.name,
            "device_memory_bytes": device.memory_bytes,
            "peak_flops_per_device": device.peak_bf16_flops, "remat": remat,
            "loss_chunk": loss_chunk, "mu_dtype": mu_dtype,
            "attention": chosen_attention(config, device.backend),
            "compute_dtype": compute_dtype, "weights_bytes": m.weights,
            "gradients_bytes": m.gradients, "optimizer_bytes": m.optimizer,
            "activations_bytes": m.activations, "training_bytes": m.training,
            "fits": m.training <= device.memory_bytes, "kv_cache_bytes": m.kv_cache,
            "sequence_parallel_training_bytes": sequence_parallel,
            "mfu": mfu, "step_flops": flops, "step_s": step_s,
            "tokens_per_s": batch * seq / step_s}


def render_training(t: dict, batch: int, seq: int) -> str:
    mesh = ",".join(f"{k}={v}" for k, v in t["mesh"].items())
    fits = "fits" if t["fits"] else "does NOT fit"
    return "\n".join([
        f"training plan        mesh {mesh} ({t['devices']} x {t['hardware']}: "
        f"{format_bytes(t['device_memory_bytes'])}, "
        f"{t['peak_flops_per_device'] / 1e12:,.0f} TFLOP/s each); global batch {batch} x {seq} tokens, fp32 params + AdamW"
        + (f" (first moment {t['mu_dtype']})" if t["mu_dtype"] else "") + ", "
        f"{t['compute_dtype']} compute, remat {t['remat']}, {t['attention']} attention"
        + (f", loss {t['loss_chunk']} positions at a time" if t["loss_chunk"] else ""),
        f"  per device: weights {format_bytes(t['weights_bytes'])}, gradients "
        f"{format_bytes(t['gradients_bytes'])}, optimizer {format_bytes(t['optimizer_bytes'])}, "
        f"activations {format_bytes(t['activations_bytes'])}",
        f"  total {format_bytes(t['training_bytes'])} per device: {fits} in "
        f"{format_bytes(t['device_memory_bytes'])}"
        + ("" if t["sequence_parallel_training_bytes"] is None else
           f"; {format_bytes(t['sequence_parallel_training_bytes'])} with sequence parallelism "
           f"(mesh.activation_rules: {{residual_seq: tensor}})"),
        f"  step {t['step_s']:.3f} s at {t['mfu']:.0%} MFU = {t['tokens_per_s']:,.0f} tokens/s "
        f"({t['step_flops']:.3e} FLOPs per step, {costs.TRAIN_FLOPS_FORMULA})",
        f"  decode KV cache of B={batch} x S={seq}: {format_bytes(t['kv_cache_bytes'])} per device",
    ])


def render(name: str, p: dict) -> str:
    c = p["config"]
    lines = [
        f"{name}: D={c['D']} L={c['L']} N={c['N']} K={c['K']} H={c['H']} F={c['F']} "
        f"V={c['V']} context={c['max_seq_len']} tied={c['tie_embeddings']} "
        + (f"rope_theta={c['rope_theta']:g} rope_type={c['rope_type']}"
           if c["rope_theta"] is not None else f"positions={c['positions']}")
        + (f" mlp=moe E={c['moe']['E']} top_k={c['moe']['top_k']} M={c['moe']['M']}"
           if c["moe"] else "")
        + (" attention=mla " + " ".join(f"{k}={v}" for k, v in c["mla"].items() if v)
           if c["mla"] else ""),
        f"parameters           {p['n_params']:>20,}",
        f"  embedding (V*D)    {p['n_params_embedding']:>20,}",
        f"  LM head (untied)   {p['n_params_lm_head']:>20,}",
        f"  non-embedding      {p['n_params_non_embedding']:>20,}",
        f"  active per token   {p['n_params_active']:>20,}"
        + ("" if p["n_params_active"] == p["n_params"] else "  (MoE: top_k of E routed experts)"),
        f"  in matmuls (P_mm)  {p['n_params_matmul']:>20,}  (active)",
        "weight bytes         "
        + "  ".join(f"{d} {format_bytes(b)}" for d, b in p["weight_bytes"].items())
        + (f"  {p['quantize']} {format_bytes(p['weight_bytes_quantized'])} (with scales; other "
           f"tensors {p['dtype']})" if p["quantize"] else ""),
        f"KV cache ({p['cache_dtype']})    {format_bytes(p['kv_cache_bytes_per_token'])} per token "
        + ("(L*(Z+I)*bytes: MLA's latent and RoPE key" if c["mla"] else "(2*L*K*H*bytes")
        + (", plus a 4-byte scale per vector)" if p["cache_dtype"] == "int8" else ")")
        + f"; {format_bytes(p['kv_cache_bytes'])} for B={p['batch']} x S={p['seq']}",
        f"  vs these heads as  MHA {format_bytes(p['kv_cache_mha_bytes_per_token'])}, MQA "
        f"{format_bytes(p['kv_cache_mqa_bytes_per_token'])} per token (GQA: K/N of MHA)",
        f"training FLOPs/token {p['train_flops_per_token']:,.4g} at T={p['seq']}  "
        f"[{p['train_flops_formula']}]",
        f"decode floor         {p['decode_floor_s_per_step'] * 1e3:.3f} ms/step, "
        f"{p['decode_floor_tokens_per_s']:,.1f} tokens/s at B={p['batch']}, S={p['seq']}, "
        f"{p['bandwidth_gbps']:g} GB/s  [{format_bytes(p['decode_bytes_per_step'])} per step = "
        f"{p['decode_bytes_formula']}]",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.plan.info", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("config", help="preset name (e.g. llama3-8b) or path to a config file")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch size B (default: one sequence per data-parallel device of "
                             "the training plan's mesh, else 1)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="serving: the KV cache of this many decode rows (with "
                             "--max-seq-len; default 8 when that is given)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="serving: tokens per row (default: the model's context when "
                             "--max-batch is given)")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence / context length S (default: the model's max_seq_len)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="dtype of weights and KV cache for bytes and the decode floor")
    add_int8_arguments(parser, cache_default="--dtype")  # for the bytes and the decode floor
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="memory bandwidth in GB/s for the decode floor (default: that of "
                             "--hardware, else an H100 SXM's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--mesh", help="plan training on this mesh, e.g. data=2,fsdp=32,tensor=1")
    parser.add_argument("--hardware", choices=["cpu", *hardware.HARDWARE],
                        help="device kind of the training plan (default h100; cpu: measured)")
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="dots_no_batch",
                        help="activation checkpointing policy of the training plan")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="model FLOPs utilisation assumed for the step time (default 0.4)")
    parser.add_argument("--compute-dtype", choices=DTYPES, default="bfloat16",
                        help="matmul dtype of the training plan (parameters stay fp32)")
    parser.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                        help="attention implementation of the training plan (auto: cuDNN on "
                             "GPUs, splash on TPUs, chunked on CPUs; xla: dense)")
    parser.add_argument("--loss-chunk", type=int, default=None,
                        help="the training plan's loss takes the logits of this many positions "
                             "per row at a time (default: all at once)")
    parser.add_argument("--mu-dtype", choices=MU_DTYPES, default=None,
                        help="AdamW's first moment in the training plan (default: fp32, as the "
                             "parameters and the second moment)")
    parser.add_argument("--topology", help="plan for this TPU slice or GPU node (v5p-256, "
                        "v5e-64, h100x8, ...): its hardware and device count; the mesh "
                        "defaults to fsdp over every device")
    parser.add_argument("--slices", type=int, default=1, help="with --topology: that many "
                        "TPU slices (multi-slice; the data axis spans them)")
    parser.add_argument("--compile", action="store_true", help="with --topology: also compile "
                        "the planned training step for it and print XLA's figures beside the "
                        "plan (needs libtpu or jax's CUDA plugin)")
    args = parser.parse_args(argv)
    if args.topology and args.hardware:
        parser.error("--topology names the hardware: leave out --hardware")
    if (args.compile or args.slices != 1) and not args.topology:
        parser.error("--compile and --slices need --topology")
    return args


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = load_sections(args.config)
    model = sections.model
    config = model.with_execution(quantize=args.quantize, quantize_head=args.quantize_head)
    seq = config.max_seq_len if args.seq is None else args.seq
    named = topology.parse(args.topology, args.slices) if args.topology else None
    if named is not None:
        args.hardware = named.hardware
        args.mesh = args.mesh or f"fsdp={named.n_devices}"
    device = hardware.hardware(args.hardware or "h100")
    # --mesh gives the sizes; the config's `mesh:` rules stay (as in the compiled plan).
    mesh = dataclasses.replace(sections.mesh, **dict(zip(MESH_AXES, parse_mesh(
        args.mesh).sizes))) if args.mesh else None
    batch_said = args.batch is not None
    if not batch_said:
        args.batch = sharding.batch_shards(mesh, dict(zip(MESH_AXES, mesh.sizes))) \
            if mesh is not None else 1
    if args.bandwidth is None:
        args.bandwidth = device.bandwidth / 1e9 if args.hardware else DEFAULT_BANDWIDTH_GBPS
    for flag, value in (("--batch", args.batch), ("--seq", seq), ("--bandwidth", args.bandwidth),
                        ("--loss-chunk", 1 if args.loss_chunk is None else args.loss_chunk)):
        if value <= 0:
            raise ConfigError(f"{flag}={value} must be > 0")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu={args.mfu} must be in (0, 1]")
    if named is not None and math.prod(mesh.sizes) != named.n_devices:
        raise ConfigError(f"--mesh {args.mesh} has {math.prod(mesh.sizes)} devices; "
                          f"{named.describe()}")
    result = plan(config, batch=args.batch, seq=seq, dtype=args.dtype,
                  bandwidth_gbps=args.bandwidth, cache_dtype=args.cache_dtype)
    text = render(args.config, result)
    if mesh is not None or args.hardware:
        result["training"] = plan_training(
            model, mesh or MeshConfig(data=1), batch=args.batch, seq=seq, remat=args.remat,
            compute_dtype=args.compute_dtype, device=device,
            mfu=args.mfu, kv_dtype=args.cache_dtype or args.dtype,
            attention_impl=args.attention_impl, loss_chunk=args.loss_chunk,
            mu_dtype=args.mu_dtype)
        text += "\n" + render_training(result["training"], args.batch, seq)
        if not batch_said:
            text += (f"\n  (--batch not given: one sequence per data-parallel device, "
                     f"{args.batch} in all)")
        result["training"]["batch_default"] = not batch_said
    if args.max_batch is not None or args.max_seq_len is not None:
        result["serving"] = plan_serving(
            config, 8 if args.max_batch is None else args.max_batch,
            config.max_seq_len if args.max_seq_len is None else args.max_seq_len,
            args.cache_dtype or args.dtype)
        text += "\n" + render_serving(result["serving"])
    if args.compile:
        # The one call up the layer order: the planner's command line compiles the plan it
        # printed (llama_jax.aot, above training); the planner's library never does.
        from llama_jax.aot.training import compile_planned

        report, text_report = compile_planned(
            args.config, args.topology, args.slices, batch=args.batch, seq=seq, mesh=mesh,
            remat=args.remat, compute_dtype=args.compute_dtype,
            attention_impl=args.attention_impl, loss_chunk=args.loss_chunk,
            mu_dtype=args.mu_dtype)
        result["compiled"] = report.as_dict()
        text += "\ncompiled training step\n" + text_report
    print(json.dumps(result, indent=2) if args.json else text)
    return 0 if not args.compile or report.fits else 1


def plan_serving(config: ModelConfig, max_batch: int, max_seq_len: int,
                 cache_dtype: str) -> dict:
    """The KV cache a server (`python -m llama_jax.serve`) holds at its largest, on one
    device with memory to spare."""
    page = costs.SERVING_PAGE_SIZE
    try:
        shape = ServerShape.of(config.max_seq_len,
                               page * costs.kv_cache_bytes_per_token(config, cache_dtype),
                               max_batch=max_batch, max_seq_len=max_seq_len, page_size=page)
    except GenerateError as e:
        raise ConfigError(str(e)) from None
    # The server's default prefix cache where memory is plenty (a share of the free memory
    # otherwise), in whole blocks of one prefill chunk.
    shape = shape.with_default_prefix_cache(None)
    return {"max_batch": max_batch, "max_seq_len": max_seq_len, "cache_dtype": cache_dtype,
            "kv_cache_bytes": shape.rows_bytes, "page_size": page, "kv_pages": shape.rows_pages,
            "prefill_chunk": shape.prefill_chunk, "prefix_cache_bytes": shape.prefix_bytes}


def render_serving(s: dict) -> str:
    return (f"serving KV cache     {format_bytes(s['kv_cache_bytes'])} ({s['cache_dtype']}) for "
            f"{s['max_batch']} rows of {s['max_seq_len']} tokens (--max-batch, --max-seq-len): "
            f"{s['kv_pages']} pages of {s['page_size']} positions (--kv-cache-bytes, "
            "--page-size)\n"
            f"prefix cache         at most {format_bytes(s['prefix_cache_bytes'])} "
            f"({costs.PREFIX_CACHE_ROWS_MULTIPLE}x the rows' cache, in blocks of "
            f"{s['prefill_chunk']} tokens; {costs.PREFIX_CACHE_SHARE:.0%} of the memory free "
            "after the weights and rows when less: --prefix-cache-bytes)")


if __name__ == "__main__":
    sys.exit(main())
