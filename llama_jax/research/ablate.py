"""Ablation studies: a study file names a base run config, variants of it (a few `--set`-style
overrides each) and seeds; every variant x seed is an ordinary training run.

    python -m llama_jax.research.ablate STUDY.yaml [--workdir DIR] [--steps N] [--seeds N] [--corpus DIR]
                                          [--dry-run]
    python -m llama_jax.research.ablate report DIR     # results and plots again, from DIR's runs

This module is the command line; the work is done by `study.py` (reading and resolving the study
file: variants, seeds, matching, run keys), `runner.py` (training what is not finished yet in the
study's workdir, runs/ablations/NAME by default) and `report.py` (the results tables and plots).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llama_jax.cli import user_errors_exit
from llama_jax.errors import ConfigError
from llama_jax.research.report import describe, plot_results, write_results
from llama_jax.research.runner import recorded_study, run_study
from llama_jax.research.study import load_study


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.research.ablate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="a study file (configs/ablations/NAME.yaml)")
    parser.add_argument("--workdir", help="the study's directory (default: runs/ablations/NAME)")
    parser.add_argument("--steps", type=int, help="train.steps for every run")
    parser.add_argument("--seeds", type=int, help="use seeds 0..N-1 instead of the file's")
    parser.add_argument("--corpus", help="data.corpus for every run (a directory or glob of "
                        "text files; default: the base config's)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved variants and their costs; train nothing")
    return parser.parse_args(argv)


def report(workdir: Path) -> Path:
    """Rebuilds results.csv, results.md and the plots of a study's workdir from its runs."""
    study = recorded_study(workdir)
    plot_results(study, workdir)
    return write_results(study, workdir)


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        if len(argv) != 2:
            raise ConfigError("usage: python -m llama_jax.research.ablate report DIR")
        results = report(Path(argv[1]))
        print((results.parent / "results.md").read_text())
        return 0
    args = parse_args(argv)
    study = load_study(args.study, steps=args.steps, seeds=args.seeds, corpus=args.corpus)
    print(f"study {study.path}: base {study.base}, seeds {list(study.seeds)}"
          + (f", matched on {study.match}" if study.match else ""))
    print(describe(study))
    if args.dry_run:
        return 0
    workdir = Path(args.workdir or Path("runs") / "ablations" / study.path.stem)
    results = run_study(study, workdir)
    if results is None:
        return 1
    print((results.parent / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
