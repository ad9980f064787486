"""XLA:GPU's own estimate of the programs a GPU lease ran, set against their measured times:
how far to trust the clock of a deviceless GPU compile (`llama_jax.aot.estimate.estimate_gpu`).

    python bench/gpu_clock.py DIR     # DIR: `bash bench/lease.sh`'s clock/ (gpu.json, hlo.tar.gz)

`bash bench/lease.sh` (its `clock` stage) runs bench/gpu.py with `--dump` under
`--xla_gpu_collect_cost_model_stats`: each timed run of ours leaves the optimized HLO of its
training step or decode loop (one module per decode batch, compiled in batch order). Each is
priced at the hardware table's datasheet peak and bandwidth (what a deviceless report uses),
and beside it, at the peak and copy bandwidth gpu.py measured in the same run. A decode loop's
outer while has no trip count: it is priced once, i.e. per decode step.

Prints a table (measured / estimated: the clock's calibration on this device, and the kernels
launched per step and per layer) and writes gpu_clock.json into DIR.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tarfile
from pathlib import Path

from llama_jax.aot.estimate import StepEstimate, estimate_gpu
from llama_jax.plan.hardware import HARDWARE


def modules(directory: Path) -> dict[str, list[str]]:
    """Run directory name -> its modules' texts, in compile order (XLA's module ids)."""
    found: dict[str, list[tuple[int, str]]] = {}
    with tarfile.open(directory / "hlo.tar.gz") as archive:
        for member in archive.getmembers():
            if member.isfile():
                run, name = Path(member.name).parts[-2:]
                order = int(re.search(r"module_(\d+)", name).group(1))
                text = archive.extractfile(member).read().decode()
                found.setdefault(run, []).append((order, text))
    return {run: [text for _, text in sorted(texts)] for run, texts in found.items()}


def dump_name(kind: str, run: str) -> str:
    """bench/gpu.py's directory for a run's dump."""
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", f"{kind}-{run}")


def measured(results: dict) -> dict[str, float]:
    """(dump directory[, batch]) -> measured seconds per step, of every run of ours."""
    steps = {}
    for run, r in results.get("train", {}).get("runs", {}).items():
        if "step_s" in r and run != "transformers":
            steps[dump_name("train", run)] = statistics.median(r["step_s"])
    for run, r in results.get("decode", {}).get("runs", {}).items():
        for batch, m in r.get("per_batch", {}).items() if run != "transformers" else ():
            steps[f"{dump_name('decode', run)} b{batch}"] = m["step_s"]
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    for needed in ("gpu.json", "hlo.tar.gz"):
        if not (args.directory / needed).is_file():
            print(f"gpu_clock: {args.directory / needed} is missing: DIR is the clock/ folder "
                  "`bash bench/lease.sh` wrote", file=sys.stderr)
            return 2
    results = json.loads((args.directory / "gpu.json").read_text())
    peak = results["peak"]
    chip = next((h for h in HARDWARE.values() if h.backend == "gpu"
                 and peak["device"].startswith(h.device_kinds)), None)
    if chip is None:
        print(f"gpu_clock: {args.directory / 'gpu.json'} was measured on {peak['device']!r}, "
              "not a GPU of the hardware table (llama_jax/plan/hardware.py)", file=sys.stderr)
        return 2
    layers = results["plan"]["big"]["n_layers"]
    batches = results["plan"]["decode_batches"]
    steps = measured(results)
    rows = {}
    for run, texts in sorted(modules(args.directory).items()):
        names = [run] if run.startswith("train") else [f"{run} b{b}" for b in batches]
        for name, text in zip(names, texts):
            rated = estimate_gpu(text, chip.peak_bf16_flops, chip.bandwidth)
            at_measured = estimate_gpu(text, peak["bf16_matmul_flops"], peak["copy_bytes_per_s"])
            rows[name] = row(rated, at_measured, steps.get(name), layers)
    print(f"{peak['device']}, jax {peak['jax']}: XLA:GPU's estimate (fusions by XLA's cost "
          f"model; GEMMs, cuDNN attention and copies by ours at the datasheet's "
          f"{chip.peak_bf16_flops / 1e12:.0f} TFLOP/s and {chip.bandwidth / 1e12:.2f} TB/s, and "
          f"at the {peak['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s and "
          f"{peak['copy_bytes_per_s'] / 1e12:.2f} TB/s measured) against the measured step\n"
          "| program | measured ms | estimated ms (XLA's + ours) | measured / estimated | "
          "at the measured rates | kernels per step | per layer |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        ratio = (f"{r['measured_s'] / r['estimated_s']:.2f}x / "
                 f"{r['measured_s'] / r['estimated_measured_rates_s']:.2f}x"
                 if r["measured_s"] else "-")
        print(f"| {name} | {r['measured_s'] * 1e3 if r['measured_s'] else float('nan'):.2f} | "
              f"{r['estimated_s'] * 1e3:.2f} ({r['xla_s'] * 1e3:.2f} + {r['ours_s'] * 1e3:.2f}) "
              f"| {ratio.split(' / ')[0]} | {ratio.split(' / ')[-1]} | {r['launches']:g} | "
              f"{r['launches'] / layers:.1f} |")
    (args.directory / "gpu_clock.json").write_text(json.dumps(rows, indent=1))
    return 0


def row(rated: StepEstimate, at_measured: StepEstimate, measured_s: float | None,
        layers: int) -> dict:
    return {"measured_s": measured_s, "estimated_s": rated.seconds,
            "xla_s": rated.priced_seconds, "ours_s": rated.kernel_seconds,
            "estimated_measured_rates_s": at_measured.seconds, "launches": rated.launches,
            "layers": layers, "kernels": dict(rated.kernels),
            "unknown_loops": list(rated.unknown_loops)}


if __name__ == "__main__":
    sys.exit(main())
