"""Running a study (`run_study`): the study's workdir holds one tokenizer (trained once on the
base config's corpus, then given to every run as `data.tokenizer`) and one ordinary train.py
workdir per variant x seed, named `{variant}-s{seed}-{hash of the resolved config}`, so a rerun
finds its runs: finished ones are skipped, an interrupted one resumes from its last checkpoint
(a signal that stops a run stops the study), and a finished run of another study beside it with
the same config and tokenizer is linked, not trained again. Runs are evaluated again at the
study's `eval_seq_lens`; then the results are written (`research.report`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

from llama_jax.config import RunConfig
from llama_jax.data import batches
from llama_jax.data.corpus import corpus_tokenizer, corpus_tokens
from llama_jax.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from llama_jax.errors import ConfigError
from llama_jax.formats import workdir as run_dir
from llama_jax.research.report import plot_results, read_metrics, write_results
from llama_jax.research.study import Study, Variant, load_study, run_key

STUDY_RECORD = "study.json"  # in a study's workdir: which study file, seeds and steps it ran


def with_tokenizer(study: Study, tokenizer: Path) -> Study:
    """Every variant reading the study's one tokenizer."""
    def given(v: Variant) -> Variant:
        run = dataclasses.replace(v.run, data=dataclasses.replace(v.run.data,
                                                                 tokenizer=str(tokenizer)))
        return dataclasses.replace(v, run=run)
    return dataclasses.replace(study, variants=tuple(given(v) for v in study.variants))


def run_study(study: Study, workdir: Path,
              log: Callable[[str], None] = print) -> Path | None:
    """Trains every variant x seed not finished yet (see the module docstring); returns the
    path of results.csv, or None when a signal (SIGINT, SIGTERM) stopped a run: the study stops
    there too, the run checkpointed where it stood."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / STUDY_RECORD).write_text(json.dumps({
        "study": str(study.path.resolve()), "seeds": list(study.seeds),
        "steps": study.variants[0].run.train.steps,
        "corpus": study.variants[0].run.data.corpus}, indent=2))
    base = study.variants[0].run
    corpus_tokenizer(base.data, base.model.vocab_size, workdir, log)
    study = with_tokenizer(study, workdir / TOKENIZER_FILE)
    runs = [(v, seed) for v in study.variants for seed in study.seeds]
    for i, (v, seed) in enumerate(runs, 1):
        if not _run_one(v, seed, workdir / study.run_name(v, seed), f"[{i}/{len(runs)}]", log):
            return None
    if study.eval_seq_lens:
        _evaluate_lengths(study, workdir, log)
    plot_results(study, workdir)
    return write_results(study, workdir)


def recorded_study(workdir: Path) -> Study:
    """The study that ran in `workdir`, as it ran (its study file, seeds, steps and corpus, from
    the record `run_study` left there)."""
    record = workdir / STUDY_RECORD
    if not record.is_file():
        raise ConfigError(f"{workdir}: no {STUDY_RECORD}; not the workdir of a study run")
    ran = json.loads(record.read_text())
    study = load_study(ran["study"], steps=ran["steps"], seeds=len(ran["seeds"]),
                       corpus=ran.get("corpus"))  # None: the base config's
    return dataclasses.replace(study, seeds=tuple(ran["seeds"]))


def _run_one(v: Variant, seed: int, path: Path, counter: str,
             log: Callable[[str], None]) -> bool:
    """Trains (or resumes, or links, or skips) one run; False when a signal stopped it."""
    from llama_jax.training.trainer import train

    run = v.for_seed(seed)
    done = _finished(path, run)
    if not (done or os.path.lexists(path)) and (
            same := _same_run(path.parent, run_key(v, seed), run)):
        path.symlink_to(Path("..") / same.parent.name / same.name)
        log(f"{counter} {path.name}: the same run as {same}, linked")
        return True
    log(f"{counter} {path.name}: " + ("finished, skipped" if done else "training"))
    if done:
        return True
    outcome = train(run, path, log=lambda _: None, progress=False)
    if outcome.stopped_by:
        log(f"{counter} {path.name}: stopped by {outcome.stopped_by} at step {outcome.step} "
            "(checkpoint saved); rerun the same command to resume the study")
        return False
    memory = ("" if outcome.peak_memory_bytes is None
              else f", {outcome.peak_memory_bytes / 2**20:,.0f} MiB peak")
    log(f"{counter} {path.name}: val_loss {outcome.val_loss:.4f}, "
        f"{outcome.tokens_per_s:,.0f} tokens/s" + memory)
    return True


def _evaluate_lengths(study: Study, workdir: Path, log: Callable[[str], None]) -> None:
    """`val_loss_at_{L}.json` in each run for each of the study's `eval_seq_lens`: the
    validation tokens the trainer evaluates, cut into windows of L tokens (`length_batches`),
    so that lengths differ only in how much context each token sees."""
    tokenizer = load_tokenizer(workdir / TOKENIZER_FILE)
    data = study.variants[0].run.data
    tokens = corpus_tokens(data.corpora[0].path, data.val_fraction, tokenizer, log)
    for v in study.variants:
        for seed, length in ((s, n) for s in study.seeds for n in study.eval_seq_lens):
            path, batches = workdir / study.run_name(v, seed), length_batches(v.run, length)
            extra = path / f"val_loss_at_{length}.json"
            if extra.is_file() and json.loads(extra.read_text()).get("batches") == batches:
                continue
            loss = validation_loss(path, tokens.val, length, v.run.train.batch_size, batches,
                                   tokenizer.bos_id)
            extra.write_text(json.dumps({"seq_len": length, "batches": batches,
                                         "val_loss": loss}))


def length_batches(run: RunConfig, length: int) -> int:
    """Batches of `length`-token windows over the trainer's validation tokens (train.eval_batches
    batches of train.seq_len)."""
    return max(1, run.train.eval_batches * run.train.seq_len // length)


def validation_loss(run_path: Path, val_tokens, seq_len: int, batch_size: int,
                    n_batches: int, bos_id: int) -> float:
    """Mean validation cross-entropy of a finished run's parameters on windows of `seq_len`
    tokens (as the trainer evaluates: packed documents, positions restarting at each)."""
    import jax

    from llama_jax.formats.checkpoint import load_checkpoint
    from llama_jax.training.step import loss_sums

    config, params = load_checkpoint(run_path)
    evaluate = jax.jit(lambda p, w: loss_sums(config, p, w, bos_id, 0.0)[1][0])
    total = count = 0.0
    for window in batches.val_batches(val_tokens, seq_len, batch_size, n_batches):
        sums = evaluate(params, window)
        total, count = total + float(sums["loss_sum"]), count + float(sums["count"])
    return total / count


def _same_run(workdir: Path, key: str, run: RunConfig) -> Path | None:
    """A finished run of another study beside this one (in the same parent directory) with the
    same resolved config and the same tokenizer file: the shipped studies share their baseline,
    which then trains once. Training is deterministic given both, so it is the same run."""
    tokenizer = (workdir / TOKENIZER_FILE).read_bytes()
    for other in sorted(workdir.parent.glob(f"*/*-{key}")):
        if (other.parent != workdir and not other.is_symlink() and _finished(other, run)
                and (other / TOKENIZER_FILE).is_file()
                and (other / TOKENIZER_FILE).read_bytes() == tokenizer):
            return other
    return None


def _finished(path: Path, run: RunConfig) -> bool:
    """Its last step is checkpointed and evaluated (a run missing its last checkpoint resumes
    from the one before)."""
    rows = read_metrics(path)
    return ((path / run_dir.CHECKPOINTS / str(run.train.steps)).is_dir() and bool(rows)
            and rows[-1].get("step") == run.train.steps and "val_loss" in rows[-1])
