"""The planner against XLA:TPU: training runs of the planner's worked plans (and an MoE, an MLA
model, 405B) compiled for their v5p slices on this CPU, XLA's peak bytes per chip beside the
planned bytes, and the two fits / does-not-fit verdicts.

    python bench/pods.py                 # every row, a markdown table (docs/scale-out.md)
    python bench/pods.py --rows 8b-8k 70b-8k-tp8 --json

Each row compiles in a process of its own (an 8B step holds ~2.5 GB of host memory while XLA
compiles it, 70B more), through `llama_jax.aot.training.compile_training` with the step alone
(no evaluation program). Needs libtpu (`make test-pods` installs it; TPU_LIBRARY_PATH).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
# bf16 compute over fp32 parameters and AdamW, as the planner's worked plans
EXECUTION = ["model.compute_dtype=bfloat16", "model.param_dtype=float32", "mesh.data=1"]
ROWS = {
    "8b-8k": ("configs/llama3-8b.yaml", "v5p-512", 256, 8192,
              {"fsdp": 256}, "dots_no_batch"),
    "8b-32k": ("configs/llama3.1-8b.yaml", "v5p-512", 256, 32768, {"fsdp": 256}, "full"),
    "70b-8k": ("configs/llama3-70b.yaml", "v5p-1024", 512, 8192, {"fsdp": 512}, "full"),
    "70b-8k-tp8": ("configs/llama3-70b.yaml", "v5p-1024", 512, 8192,
                   {"fsdp": 64, "tensor": 8}, "full"),
    "70b-32k": ("configs/llama3.1-70b.yaml", "v5p-1024", 512, 32768, {"fsdp": 512}, "full"),
    "70b-32k-tp8": ("configs/llama3.1-70b.yaml", "v5p-1024", 512, 32768,
                    {"fsdp": 64, "tensor": 8}, "full"),
    # over the memory: a v5e chip's 15.75 GiB, and 8 sequences of 32K per tensor group held
    # whole between blocks (sequence parallelism off)
    "8b-8k-v5e": ("configs/llama3-8b.yaml", "v5e-256", 256, 8192,
                  {"fsdp": 256}, "dots_no_batch"),
    "70b-32k-tp8-no-sp": ("configs/llama3.1-70b.yaml", "v5p-1024", 512, 32768,
                          {"fsdp": 64, "tensor": 8}, "full"),
    "405b-8k": ("configs/llama3.1-405b.yaml", "v5p-2048", 1024, 8192, {"fsdp": 1024},
                "full"),
    "mixtral-4k": ("configs/mixtral-8x7b.yaml", "v5p-256", 128, 4096,
                   {"fsdp": 16, "expert": 8}, "full"),
    "mla-4k": ("configs/deepseek-v2-lite.yaml", "v5p-128", 64, 4096,
               {"fsdp": 8, "expert": 8}, "full"),
}

# More settings of a row
SETTINGS = {"70b-32k-tp8-no-sp": ("mesh.activation_rules={residual_seq: null}",)}


def overrides(row: str) -> list[str]:
    _, _, batch, seq, mesh, remat = ROWS[row]
    return [*EXECUTION, f"train.batch_size={batch}", f"train.seq_len={seq}",
            f"model.max_seq_len={max(seq, 8192)}", f"model.remat={remat}",
            *(f"mesh.{axis}={ways}" for axis, ways in mesh.items()), *SETTINGS.get(row, ())]


def compile_row(row: str) -> dict:
    """One row, compiled in this process: the report's figures."""
    from llama_jax import load_run_config
    from llama_jax.aot.training import compile_training

    config, topology = ROWS[row][:2]
    report = compile_training(load_run_config(config, overrides(row)), topology,
                              evaluate=False)
    step, plan = report.programs[0], report.plan
    return {"row": row, "config": config, "topology": topology, "mesh": report.mesh,
            "attention": report.attention, "versions": report.versions,
            "xla_peak": step.total, "xla_fits": step.fits, "xla_error": step.error,
            "xla_available": step.available or report.limit, "compile_s": step.compile_s,
            "planned": plan.training, "planned_fits": plan.training <= report.limit,
            "plan": {"weights": plan.weights, "gradients": plan.gradients,
                     "optimizer": plan.optimizer, "activations": plan.activations}}


def run_row(row: str, timeout: float = 1800) -> dict:
    """One row in a fresh process."""
    result = subprocess.run([sys.executable, __file__, "--rows", row, "--json", "--here"],
                            cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        return {"row": row, "failed": result.stderr[-3000:]}
    return json.loads(result.stdout)[0]


def markdown(results: list[dict]) -> str:
    lines = ["| run | topology, mesh | remat | XLA peak GiB per chip | planned GiB | "
             "XLA / planned | XLA:TPU | planner | compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        config, _, batch, seq, mesh, remat = ROWS[r["row"]]
        if "failed" in r:
            lines.append(f"| {Path(config).stem}, {batch} x {seq} | failed: "
                         f"{r['failed'].strip().splitlines()[-1]} |")
            continue
        xla = "fits" if r["xla_fits"] else "does not fit"
        planner = "fits" if r["planned_fits"] else "does not fit"
        lines.append(
            f"| {Path(config).stem}, {batch} x {seq} | {r['topology']}, "
            f"{','.join(f'{k}={v}' for k, v in mesh.items())}"
            f"{''.join(f'; {s}' for s in SETTINGS.get(r['row'], ()))} | {remat} | "
            f"{r['xla_peak'] / GIB:.1f} of {r['xla_available'] / GIB:.2f} | "
            f"{r['planned'] / GIB:.1f} | {r['xla_peak'] / r['planned']:.2f} | {xla} | "
            f"{planner} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--here", action="store_true", help="compile in this process")
    args = parser.parse_args()
    results = []
    for row in args.rows:
        results.append(compile_row(row) if args.here else run_row(row))
        print(json.dumps(results[-1]), file=sys.stderr)  # each row as it comes
    print(json.dumps(results, indent=1) if args.json else markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
