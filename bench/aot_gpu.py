"""The deviceless GPU compile against the device's own, run on a lent GPU (`bash bench/lease.sh
aot`): the same training step compiled (1) on the device, (2) on the same machine without it
(JAX_PLATFORMS=cpu, jax's CUDA plugin and the device's own target description, which this
script saves), and (3) from the description kept in the repository
(llama_jax/parallel/gpu_targets/). Are the programs the same (custom calls, memory per
device)? The saved description can replace the repository's.

    python bench/aot_gpu.py --out DIR [--config configs/llama3.2-1b.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RUN = ["train.batch_size=8", "train.seq_len=2048", "model.compute_dtype=bfloat16",
       "model.param_dtype=float32", "model.remat=full", "mesh.data=1"]


def report(config: str, topology: str | None, gpu_target: str | None) -> dict:
    from llama_jax import compile_training, load_run_config

    result = compile_training(load_run_config(config, RUN), topology, evaluate=False,
                              gpu_target=gpu_target)
    step = result.programs[0]
    return {"target": result.target, "attention": result.attention, "peak": step.peak,
            "arguments": step.arguments, "temporaries": step.temporaries,
            "total": step.total, "custom_calls": step.custom_calls,
            "options": {k: str(v) for k, v in result.compiler_options.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="configs/llama3.2-1b.yaml")
    parser.add_argument("--deviceless", help="(internal) compile for this topology without "
                        "the device, from --gpu-target's description or the repository's")
    parser.add_argument("--gpu-target", help="(internal) a target description file")
    args = parser.parse_args()
    out = Path(args.out)
    if args.deviceless:
        text = Path(args.gpu_target).read_text() if args.gpu_target else None
        print(json.dumps(report(args.config, args.deviceless, text)))
        return 0
    import jax
    from jaxlib import xla_client

    out.mkdir(parents=True, exist_ok=True)
    own = out / "target_config.txtpb"
    own.write_text(str(xla_client.get_topology_for_devices(jax.devices()).target_config))
    kind = "h200" if "H200" in jax.devices()[0].device_kind else "h100"
    results = {"device": report(args.config, None, None)}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name, extra in (("deviceless, the device's description", ["--gpu-target", str(own)]),
                        ("deviceless, the repository's description", [])):
        done = subprocess.run([sys.executable, __file__, "--out", args.out, "--config",
                               args.config, "--deviceless", f"{kind}x1", *extra], env=env,
                              capture_output=True, text=True, timeout=900)
        results[name] = json.loads(done.stdout) if done.returncode == 0 else {
            "failed": done.stderr[-2000:]}
    (out / "aot_gpu.json").write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        print(f"{name}: " + ("failed" if "failed" in r else
                             f"total {r['total'] / 2**30:.2f} GiB (peak {r['peak']}), custom "
                             f"calls {sorted(r['custom_calls'])}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
