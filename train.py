"""Pretrain a LLaMA on a text corpus (by default the Python documentation from Debian's
python3.11-doc package), or fine-tune one on a downstream task.

    python train.py --config configs/demo.yaml [--set train.learning_rate=1e-3 ...]
                    [--workdir runs/demo] [--steps N] [--corpus DIR_OR_GLOB]

A config with a `task:` section and `init_from: CHECKPOINT` fine-tunes that checkpoint with a
task head (llama_jax/training/finetune.py); `--set init_from=DIR` overrides the checkpoint.

Several processes (one per host) form one run with `--coordinator HOST:PORT --num-processes N
--process-id I` (auto-detected on TPU pods and under SLURM); each reads only its share of every
batch, process 0 logs, all write the checkpoints.

The workdir receives checkpoints, the resolved config, the tokenizer, metrics.jsonl and
TensorBoard event files. Rerunning with the same workdir resumes from its latest checkpoint;
SIGTERM or Ctrl-C saves a checkpoint and stops.

    python train.py --config C --compile-only [--topology v5p-256 [--slices N]] [--json]

compiles the training step and evaluation for a TPU slice or GPU node (names in
llama_jax/parallel/topology.py; default: this host's devices) without reading data or
touching a workdir, and prints per device what XLA holds beside the planner's figure; the exit
status is 1 when a program does not fit (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax

from llama_jax.parallel import distributed
from llama_jax.cli import user_errors_exit
from llama_jax.config.run import CHAT
from llama_jax import load_run_config
from llama_jax.training.trainer import train
from llama_jax.aot.training import compile_training, render


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a config file or preset name")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), e.g. train.steps=100")
    parser.add_argument("--workdir", help="run directory (default: runs/<config name>)")
    parser.add_argument("--steps", type=int, help="same as --set train.steps=N")
    parser.add_argument("--corpus", help="same as --set data.corpus=PATH")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--coordinator", help="multi-process runs: the coordinator's HOST:PORT "
                        "(auto-detected on TPU pods and under SLURM)")
    parser.add_argument("--num-processes", type=int, help="multi-process runs: process count")
    parser.add_argument("--process-id", type=int, help="multi-process runs: this process's id")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the step and evaluation, report their memory per device "
                             "and exit (no data, no workdir)")
    parser.add_argument("--topology", help="with --compile-only: compile for this TPU slice or "
                        "GPU node (v5e-256, v5p-1024, v6e-64, v4-8, v5p:4x4x8, h100x8, ...)")
    parser.add_argument("--slices", type=int, default=1,
                        help="with --topology: that many TPU slices (multi-slice)")
    parser.add_argument("--json", action="store_true",
                        help="with --compile-only: print the report as one JSON object")
    args = parser.parse_args(argv)
    if not args.compile_only:
        for flag, given in (("--topology", args.topology), ("--slices", args.slices != 1),
                            ("--json", args.json)):
            if given:
                parser.error(f"{flag} needs --compile-only")
    return args


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.compile_only:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.corpus is not None:
        overrides.append(f"data.corpus={args.corpus!r}")
    run = load_run_config(args.config, overrides)
    if args.compile_only:
        return compile_only(run, args)
    workdir = Path(args.workdir or Path("runs") / Path(args.config).stem)
    def log(message: str) -> None:
        if jax.process_index() == 0:
            print(message, file=sys.stderr)

    outcome = train(run, workdir, log=log, progress=not args.no_progress)
    if run.task is not None and run.task.kind == CHAT:
        if outcome.val_loss is not None:
            before = outcome.val_metrics_before.get("val_loss")
            log(f"validation loss on the assistant's tokens {outcome.val_loss:.4f} nats/token "
                f"(perplexity {math.exp(outcome.val_loss):.2f})"
                + ("" if before is None else f"; {before:.4f} before fine-tuning"))
        next_step = f"Chat with: python sample.py --checkpoint {workdir} --chat"
    elif run.task is not None:
        if outcome.val_metrics:
            log("validation " + ", ".join(f"{name[4:]} {value:.4f}"
                                          for name, value in outcome.val_metrics.items()))
        next_step = f"Predict with: python -m llama_jax.eval.predict --checkpoint {workdir} " \
                    "--input FILE.jsonl"
    else:
        if outcome.val_loss is not None:
            log(f"validation loss {outcome.val_loss:.4f} nats/token (perplexity "
                f"{math.exp(outcome.val_loss):.2f}); unigram entropy of the validation set "
                f"{outcome.val_unigram_entropy:.4f}")
        next_step = f"Sample with: python sample.py --checkpoint {workdir} --prompt 'The'"
    if outcome.stopped_by is None:
        log(f"done: step {outcome.step}, {outcome.tokens_per_s:,.0f} tokens/s. {next_step}")
    return 0


def compile_only(run, args: argparse.Namespace) -> int:
    """The report of `--compile-only` on stdout (progress on stderr); 1 if a program does not
    fit."""
    report = compile_training(run, args.topology, args.slices,
                              log=lambda line: print(line, file=sys.stderr))
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report, run))
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
