"""Compile MaxText's training step for a TPU slice on a CPU-only machine; save HLO + XLA's analyses.

    bash bench/xla_clock_venv.sh .venv-maxtext
    .venv-maxtext/bin/python bench/xla_clock_maxtext.py --topology v5p-512 --model llama3-8b \
        --seq 8192 --per-device-batch 1 --remat full --out /tmp/xla_clock [--name maxtext-8b-full]
    .venv-maxtext/bin/python bench/xla_clock_maxtext.py --topology v5p-1024 --model llama3-70b \
        --seq 8192 --per-device-batch 1 --remat full --out /tmp/xla_clock --name maxtext-70b-fsdp

Runs under its own venv (jax[tpu]==0.12.0.1 + maxtext==0.2.5, see bench/xla_clock_venv.sh), not
the llama_jax environment. The point is a reference program: MaxText's LLaMA training step as
XLA:TPU (libtpu) optimizes it for the named slice, so our own program can be compared with it on
the same compiler's cost estimates. No TPU is needed: libtpu compiles against a topology
description (`jax.experimental.topologies.get_topology_desc`), which MaxText's `train_compile`
builds from `compile_topology`.

Writes `OUT/NAME.hlo.txt` (the optimized, SPMD-partitioned per-chip HLO: `compiled.as_text()`) and
`OUT/NAME.json` (memory_analysis byte counts, cost_analysis, collective op counts in the HLO,
compile seconds, the MaxText settings that matter, package versions).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import time

# Mesh axes that get a `--ici-parallelism-AXIS N` flag, passed on as MaxText's `ici_AXIS_parallelism`.
ICI_AXES = ("data", "fsdp", "fsdp_transpose", "sequence", "context", "tensor", "tensor_sequence",
            "expert", "pipeline")
# ` op(` instructions, plus XLA:TPU's reduce-scatter, which it emits as a kCustom fusion calling an
# `%all-reduce-scatter...` computation (an all-reduce + dynamic-slice, itself counted under that name).
COLLECTIVE = re.compile(r" ((?:all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?)\("
                        r"|calls=%(all-reduce-scatter)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="v5p-512", help="MaxText compile_topology, e.g. v5p-512")
    p.add_argument("--slices", type=int, default=1, help="compile_topology_num_slices")
    p.add_argument("--model", default="llama3-8b", help="MaxText model_name")
    p.add_argument("--seq", type=int, default=8192, help="max_target_length")
    p.add_argument("--per-device-batch", type=float, default=1, help="per_device_batch_size")
    p.add_argument("--remat", default="full", help="remat_policy (full, minimal, ...)")
    p.add_argument("--attention", default="flash", help="attention kernel (flash = Pallas splash)")
    for axis in ICI_AXES:
        p.add_argument(f"--ici-parallelism-{axis.replace('_', '-')}", type=int, dest=f"ici_{axis}",
                       help=f"ici_{axis}_parallelism (MaxText default: fsdp=-1 i.e. the rest, others 1)")
    p.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                   help="any other MaxText config override; repeatable")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--name", help="output file stem (default maxtext-<model>-<remat>)")
    return p.parse_args()


def maxtext_overrides(a: argparse.Namespace) -> list[str]:
    """MaxText `key=value` overrides for base.yml. Synthetic data, so no dataset or tokenizer is read.
    MaxText always sets XLA_FLAGS=--xla_dump_to=<dump_hlo_local_dir> (unless XLA_FLAGS is already set),
    default /tmp/xla_dump shared by every run; point it next to the outputs instead. The dump holds
    XLA:TPU's buffer assignment and memory-usage report, which explain the peak."""
    kv = [f"compile_topology={a.topology}", f"compile_topology_num_slices={a.slices}",
          "dataset_type=synthetic", f"model_name={a.model}", f"per_device_batch_size={a.per_device_batch:g}",
          f"max_target_length={a.seq}", f"attention={a.attention}", f"remat_policy={a.remat}",
          f"run_name={a.name}", f"dump_hlo_local_dir={os.path.join(a.out, a.name + '.xla_dump')}/"]
    kv += [f"ici_{axis}_parallelism={getattr(a, f'ici_{axis}')}" for axis in ICI_AXES
           if getattr(a, f"ici_{axis}") is not None]
    return kv + a.extra


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("jax", "jaxlib", "libtpu", "maxtext", "flax", "optax"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def count_collectives(hlo: str) -> dict:
    """Collective instructions in the HLO text: totals, and per computation (fusion bodies, while
    loop bodies of the scanned layers, ...), so a count inside a loop body can be read as per-layer."""
    total, per_comp, comp = {}, {}, None
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY %")):  # a computation header: [ENTRY ]%name (params) -> ... {
            comp = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
        elif m := COLLECTIVE.search(line):
            op = m.group(1) or "fusion:" + m.group(2)
            total[op] = total.get(op, 0) + 1
            per_comp.setdefault(comp, {}).setdefault(op, 0)
            per_comp[comp][op] += 1
    return {"total": total, "per_computation": per_comp}


def main() -> None:
    a = parse_args()
    a.name = a.name or f"maxtext-{a.model}-{a.remat}"
    os.makedirs(a.out, exist_ok=True)

    # libtpu reads these when it initializes; without a TPU (and without a GCE metadata server) it
    # needs to be told the accelerator type and that it is alone, or it stalls querying metadata.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", a.topology)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu takes /tmp/libtpu_lockfile so two processes don't share real chips; with none here, let a
    # compile run beside another libtpu process (e.g. our own deviceless compile) instead of aborting.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    import maxtext
    from maxtext.trainers.pre_train import train_compile

    # train_compile.main compiles, prints the analyses and drops the Compiled object. Wrap its
    # jit_and_compile (looked up as a module global at call time) to keep the object, the time the
    # trace+lower+compile took, and the resolved config it was compiled with.
    kept = {}
    original = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        start = time.perf_counter()
        kept["compiled"] = original(*args, **kwargs)
        kept["seconds"] = time.perf_counter() - start
        kept["config"], kept["mesh"] = args[8], args[3]
        return kept["compiled"]

    train_compile.jit_and_compile = keep

    base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    overrides = maxtext_overrides(a)
    start = time.perf_counter()
    train_compile.main([sys.argv[0], base_yml, *overrides])
    total_seconds = time.perf_counter() - start

    compiled, config, mesh = kept["compiled"], kept["config"], kept["mesh"]
    hlo = compiled.as_text()
    with open(os.path.join(a.out, f"{a.name}.hlo.txt"), "w") as f:
        f.write(hlo)

    mem = compiled.memory_analysis()
    memory = {k: getattr(mem, k) for k in dir(mem) if k.endswith("_in_bytes")}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per program
    report = {
        "name": a.name,
        "maxtext_overrides": overrides,
        "config": {k: str(getattr(config, k, None)) for k in (
            "model_name", "dtype", "weight_dtype", "remat_policy", "attention", "scan_layers",
            "per_device_batch_size", "global_batch_size_to_train_on", "max_target_length",
            "opt_type", "shard_mode")},
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))),
        "num_devices": int(mesh.devices.size),
        "memory_analysis": memory,
        "cost_analysis": {k: float(v) for k, v in cost.items()},
        "collectives": count_collectives(hlo),
        "compile_seconds": kept["seconds"],  # trace + lower + XLA:TPU compile of the train step
        "total_seconds": total_seconds,  # also config parsing and abstract state construction
        "versions": versions(),
    }
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    peak = memory.get("peak_memory_in_bytes")
    print(f"{a.name}: compile {kept['seconds']:.0f}s, peak/chip "
          f"{peak / 2**30 if peak else float('nan'):.2f} GiB, flops {cost.get('flops', 0):.4g}, "
          f"optimal_seconds {cost.get('optimal_seconds', float('nan')):.4g} -> {a.out}/{a.name}.*")


if __name__ == "__main__":
    main()
