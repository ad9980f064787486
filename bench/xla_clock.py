"""Ours vs MaxText 0.2.5 on XLA:TPU's own clock: the same training steps compiled deviceless for
the same v5p slices by the same jax and libtpu, priced by `llama_jax.aot.estimate` (XLA's
estimated cycles weighted by loop trip counts, splash kernels at their FLOPs), side by side.

    make bench-xla-clock                  # makes both venvs, then every row
    .venv-xla/bin/python bench/xla_clock.py --maxtext-python .venv-maxtext/bin/python \
        [--rows 8b-full 8b-saved ...] [--out /tmp/xla_clock] [--json]

Each side runs in its own Python 3.12 venv with jax[tpu] 0.12.0.1 (libtpu 0.0.50.1): ours in
`.venv-xla` (this script; the library compiled in-process, one row per child process), MaxText in
`.venv-maxtext` (`bench/xla_clock_maxtext.py`, its `train_compile` wrapped to keep the program;
the HLO text is cached in --out, `--fresh` compiles it again). Figures differ between libtpu
releases: compare only rows compiled by the same one (printed). Rows: LLaMA-3 8B on v5p-512 at
fsdp=256 under full remat and with the projections saved (ours `dots_no_batch` against
MaxText's `minimal`), LLaMA-3 70B on v5p-1024 (fsdp, and fsdp x tensor), LLaMA-3.1 8B at 32K
tokens; one sequence per chip, bf16 compute over fp32 weights and AdamW, splash attention. The
decode row compiles our LLaMA-3 8B decode step for one v5e chip against its HBM floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Row:
    preset: str  # ours; MaxText's model_name is the same name
    topology: str
    seq: int
    remat: str  # ours
    maxtext_remat: str
    mesh: dict  # ours: mesh axis -> ways (MaxText: ici_<axis>_parallelism)
    settings: tuple = ()  # ours: more SECTION.KEY=VALUE settings
    maxtext_row: str | None = None  # MaxText's compile of another row stands for this one's


ROWS = {
    "8b-full": Row("llama3-8b", "v5p-512", 8192, "full", "full", {"fsdp": 256}),
    "8b-saved": Row("llama3-8b", "v5p-512", 8192, "dots_no_batch", "minimal", {"fsdp": 256}),
    "70b-fsdp": Row("llama3-70b", "v5p-1024", 8192, "full", "full", {"fsdp": 512}),
    "70b-fsdp-tensor": Row("llama3-70b", "v5p-1024", 8192, "full", "full",
                           {"fsdp": 64, "tensor": 8}),
    # the same without sequence parallelism (our default splits the residual stream's
    # sequence over tensor between blocks, as MaxText splits its activations' width)
    "70b-fsdp-tensor-no-sp": Row("llama3-70b", "v5p-1024", 8192, "full", "full",
                                 {"fsdp": 64, "tensor": 8},
                                 ("mesh.activation_rules={residual_seq: null}",),
                                 maxtext_row="70b-fsdp-tensor"),
    "8b-32k": Row("llama3.1-8b", "v5p-512", 32768, "full", "full", {"fsdp": 256}),
}


def ours(row: Row, extra: list[str]) -> dict:
    """Our step for the row, compiled here (with `extra` SECTION.KEY=VALUE settings): the
    clock's estimate and XLA's peak per chip."""
    from llama_jax import load_run_config
    from llama_jax.aot.training import compile_training
    from llama_jax.parallel import topology

    chips = topology.parse(row.topology).n_devices
    settings = {"model.remat": row.remat, "model.param_dtype": "float32",
                "train.batch_size": chips, "train.seq_len": row.seq, "mesh.data": 1,
                **{f"mesh.{axis}": ways for axis, ways in row.mesh.items()}}
    run = load_run_config(row.preset, [f"{k}={v}" for k, v in settings.items()]
                          + list(row.settings) + extra)
    report = compile_training(run, row.topology, evaluate=False)
    step = report.programs[0]  # over the chip's memory: no clock, the bytes it needed
    return {"clock": step.clock and step.clock.as_dict(), "peak": step.total,
            "fits": report.fits, "compute": report.compute,
            "model_flops": report.model_flops, "compile_s": step.compile_s,
            "versions": report.versions}


def maxtext(row: Row, name: str, python: str, out: Path, fresh: bool) -> dict:
    """MaxText's step for the row (compiled by its driver in its venv, or read from --out),
    priced by the same estimate."""
    from llama_jax.aot.estimate import estimate
    from llama_jax.plan.hardware import HARDWARE
    from llama_jax.parallel import topology

    stem = out / f"maxtext-{name}"
    if fresh or not stem.with_suffix(".hlo.txt").exists():
        flags = [f"--ici-parallelism-{axis}={ways}" for axis, ways in row.mesh.items()]
        subprocess.run([python, str(ROOT / "bench/xla_clock_maxtext.py"), "--topology",
                        row.topology, "--model", row.preset, "--seq", str(row.seq),
                        "--per-device-batch", "1", "--remat", row.maxtext_remat, *flags,
                        "--out", str(out), "--name", stem.name], check=True)
    chip = HARDWARE[topology.parse(row.topology).hardware]
    clock = estimate(stem.with_suffix(".hlo.txt").read_text(), chip.clock_hz,
                     chip.peak_bf16_flops, chip.ici_bandwidth)
    facts = json.loads(stem.with_suffix(".json").read_text())
    return {"clock": clock.as_dict(), "peak": facts["memory_analysis"]["peak_memory_in_bytes"],
            "versions": facts["versions"], "config": facts["config"]}


DECODE_CASES = (("scan", "bfloat16", "bfloat16"), ("unrolled", "bfloat16", "bfloat16"),
                ("scan", "int8", "bfloat16"), ("unrolled", "int8", "int8"))


def decode_row() -> dict:
    """Our LLaMA-3 8B decode step (batch 1, 2048 tokens) on one v5e chip, per decoder and
    weights / cache: the clock's time over the HBM floor's."""
    from llama_jax.aot.decoding import compile_decoding
    from llama_jax.config import load_model_config

    cases = compile_decoding(load_model_config("llama3-8b"), "v5e-1", cases=DECODE_CASES)
    return {"/".join(c[:3]): {"clock": case.step.clock.as_dict(),
                              "floor_ratio": case.floor_ratio,
                              "floor_s": case.floor_bytes / case.bandwidth}
            for c, case in zip(DECODE_CASES, cases)}


def collectives(clock: dict) -> str:
    return ", ".join(f"{c['kind']} {c['count']:g}x {c['bytes'] / GIB:.1f} GiB"
                     for c in clock["collectives"])


def table(results: dict) -> str:
    versions = next((f"ours: {r['ours']['versions']}; MaxText: {r['maxtext']['versions']}"
                     for name, r in results.items() if name != "decode"), "")
    lines = [versions, "", "| row | ours s/step | MaxText s/step | ours / MaxText | ours MFU | MaxText MFU | "
             "peak GiB ours / MaxText | collective GiB ours / MaxText | ours collectives | "
             "MaxText collectives |", "|" + "---|" * 10]
    for name, r in results.items():
        if name == "decode":
            continue
        a, b = r["ours"], r["maxtext"]
        if a["clock"] is None:
            lines.append(f"| {name} | does not fit: needs {a['peak'] / GIB:.1f} GiB | "
                         f"{b['clock']['seconds']:.3f} | | | | / {b['peak'] / GIB:.1f} | | | "
                         f"{collectives(b['clock'])} |")
            continue
        ta, tb = a["clock"]["seconds"], b["clock"]["seconds"]
        flops = a["model_flops"]
        peak = a["clock"]["peak_flops"]
        bytes_a = sum(c["bytes"] for c in a["clock"]["collectives"])
        bytes_b = sum(c["bytes"] for c in b["clock"]["collectives"])
        lines.append(f"| {name} | {ta:.3f} | {tb:.3f} | {ta / tb:.3f} | "
                     f"{flops / (ta * peak):.1%} | {flops / (tb * peak):.1%} | "
                     f"{a['peak'] / GIB:.1f} / {b['peak'] / GIB:.1f} | "
                     f"{bytes_a / GIB:.1f} / {bytes_b / GIB:.1f} | {collectives(a['clock'])} | "
                     f"{collectives(b['clock'])} |")
    if "decode" in results:
        lines.append("\ndecode, llama3-8b, one v5e chip, batch 1, 2048 tokens")
        for case, d in results["decode"].items():
            lines.append(f"  {case} (decoder/weights/cache): {d['clock']['seconds'] * 1e3:.1f} ms "
                         f"per step by the clock, {d['floor_ratio']:.2f}x the HBM floor "
                         f"({d['floor_s'] * 1e3:.1f} ms)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", default=[*ROWS, "decode"],
                        choices=[*ROWS, "decode"])
    parser.add_argument("--maxtext-python", default=str(ROOT / ".venv-maxtext/bin/python"))
    parser.add_argument("--out", default="/tmp/xla_clock", help="MaxText's HLO and facts")
    parser.add_argument("--fresh", action="store_true", help="compile MaxText's rows again")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a setting of our runs (a lever to try: model.loss_chunk=2048)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one side of one row, in a process
    args = parser.parse_args()
    if args.child:
        side, name = args.child.split(":")
        print(json.dumps(decode_row() if name == "decode" else ours(ROWS[name], args.set)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.rows:
        # each compile in a process of its own: an 8B step holds gigabytes while XLA works
        mine = subprocess.run([sys.executable, __file__, "--child", f"ours:{name}",
                               *(f"--set={setting}" for setting in args.set)],
                              check=True, stdout=subprocess.PIPE, text=True).stdout
        results[name] = json.loads(mine.strip().splitlines()[-1])
        if name != "decode":
            theirs = ROWS[name].maxtext_row or name
            results[name] = {"ours": results[name],
                             "maxtext": maxtext(ROWS[theirs], theirs, args.maxtext_python, out,
                                                args.fresh)}
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)  # kept if a later row fails
    print(json.dumps(results, indent=1) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
