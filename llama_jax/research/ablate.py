"""Ablation studies: a study file names a base run config, variants of it (a few `--set`-style
overrides each) and seeds; every variant x seed is an ordinary training run.

    python -m llama_jax.research.ablate STUDY.yaml [--workdir DIR] [--steps N] [--seeds N] [--corpus DIR]
                                          [--dry-run]
    python -m llama_jax.research.ablate report DIR     # results and plots again, from DIR's runs

A study file (`configs/ablations/NAME.yaml`):

    base: ../demo.yaml             # a run config or preset (relative to the study file)
    seeds: [0, 1]                  # or a count: 2 -> [0, 1]
    match: params                  # optional: params | active_params | flops
    match_field: model.ffn_dim     # the width field adjusted to match the first variant
    variants:                      # the first is the baseline the others are compared with
      rmsnorm: {}
      layernorm: {model.norm: layernorm}
      moe: {model.mlp: moe, ..., match: false}   # not matched: sized as written

What must stay equal across variants — the data (corpus, tokenizer, split) and the token budget
(steps x batch x sequence length) — is checked: a variant that would change it is refused
before anything trains, naming the variant, as is an unknown field or value, or a variant the
model's own validation refuses. With `match`, each variant's `match_field` (an integer field of the
model section, such as ffn_dim) is bisected for the value whose parameter count (total or
active) or training FLOPs per token is closest to the baseline's, and the study says what it
chose.

Running (`run_study`): the study's workdir holds one tokenizer (trained once on the base
config's corpus, then given to every run as `data.tokenizer`) and one ordinary train.py workdir
per variant x seed, named `{variant}-s{seed}-{hash of the resolved config}`, so a rerun finds
its runs: finished ones are skipped, an interrupted one resumes from its last checkpoint (a
signal that stops a run stops the study). `results.csv` / `results.md` summarise the runs'
metrics.jsonl (the difference from the baseline is paired by seed: `compare`), and PNG plots
show the validation loss against training tokens and against training wall-clock (evaluation
and checkpointing excluded), one line per variant (the mean over seeds, their range shaded),
and, when the variants cache different amounts, the final loss against KV-cache bytes per
token.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from llama_jax.plan import costs
from llama_jax.data import batches
from llama_jax.data.corpus import Corpus, cache_root, find_corpus, prepare_tokenizer, tokenize_corpus
from llama_jax.formats import workdir as run_dir
from llama_jax.cli import user_errors_exit
from llama_jax.config import RunConfig, resolve_config_path
from llama_jax.training.finetune import load_run_config
from llama_jax.errors import ConfigError
from llama_jax.data.tokenizer import TOKENIZER_FILE, load_tokenizer

MATCHES = ("params", "active_params", "flops")
# Fields a variant may not override: they define the data and the token budget every variant
# shares.
FIXED_SECTIONS = ("data",)
FIXED_TRAIN = ("seq_len", "batch_size", "steps")
STUDY_KEYS = ("base", "seeds", "match", "match_field", "variants", "eval_seq_lens")
STUDY_RECORD = "study.json"  # in a study's workdir: which study file, seeds and steps it ran


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # SECTION.KEY=VALUE, the study's and the matching's
    run: RunConfig  # resolved, seed 0 of the study's seeds applied by `for_seed`
    matched: str | None = None  # what matching changed, for the report
    match: bool = True  # False: kept as written under the study's `match` (`match: false`)

    def for_seed(self, seed: int) -> RunConfig:
        return dataclasses.replace(self.run, train=dataclasses.replace(self.run.train,
                                                                      seed=seed))


@dataclasses.dataclass(frozen=True)
class Study:
    path: Path
    base: Path
    seeds: tuple[int, ...]
    variants: tuple[Variant, ...]
    match: str | None = None
    eval_seq_lens: tuple[int, ...] = ()  # extra evaluations at these lengths (e.g. 2 x T)

    def run_name(self, variant: Variant, seed: int) -> str:
        """`{variant}-{run_key}`: an edited variant gets a new run directory and an unchanged
        one is found again."""
        return f"{variant.name}-{run_key(variant, seed)}"


# Fields (section, name) added after studies had finished runs, with their defaults: a field
# left at its default stays out of the hash, so the runs of an unchanged variant keep their keys.
ADDED_FIELDS = {("model", "loss_chunk"): None, ("train", "mu_dtype"): None}


def run_key(variant: Variant, seed: int) -> str:
    """`s{seed}-{hash}`, the hash of the resolved config (without the study's shared tokenizer
    file, which lives in the study's directory): equal keys train the same run."""
    config = variant.for_seed(seed).to_dict()
    config["data"]["tokenizer"] = None
    for (section, field), default in ADDED_FIELDS.items():
        if config[section].get(field) == default:
            del config[section][field]
    resolved = json.dumps(config, sort_keys=True, default=str)
    return f"s{seed}-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"


def load_study(path: str | Path, steps: int | None = None, seeds: int | None = None,
               corpus: str | None = None) -> Study:
    """Reads and resolves a study file; every refusal names the file and the variant. `steps`,
    `seeds` and `corpus` replace the file's (and its base config's) for every variant."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read study: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(STUDY_KEYS)}")
    unknown = [k for k in tree if k not in STUDY_KEYS]
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; a study has {', '.join(STUDY_KEYS)}")
    if "base" not in tree or not isinstance(tree.get("variants"), dict) or not tree["variants"]:
        raise ConfigError(f"{path}: a study needs `base:` (a run config) and `variants:` (a "
                          "mapping of names to overrides, the first being the baseline)")
    base = resolve_config_path(tree["base"], path.parent)
    seed_list = _seeds(path, tree.get("seeds", 1) if seeds is None else seeds)
    match, field = tree.get("match"), tree.get("match_field")
    if match is not None and match not in MATCHES:
        raise ConfigError(f"{path}: match={match!r} is not one of {', '.join(MATCHES)}")
    if (match is None) != (field is None):
        raise ConfigError(f"{path}: `match` and `match_field` go together (the width field "
                          "adjusted so that variants match the baseline)")
    common = ([f"train.steps={steps}"] if steps is not None else []) + (
        [f"data.corpus={json.dumps(corpus)}"] if corpus is not None else [])
    variants = [_variant(path, base, name, overrides, common)
                for name, overrides in tree["variants"].items()]
    _check_shared(path, variants)
    if match is not None:
        section, _, key = field.partition(".")
        value = getattr(variants[0].run.model, key, None) if section == "model" else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{path}: match_field {field} must be an integer field of the "
                              f"model section (the baseline's value: {value!r})")
        target = _measure(variants[0].run, match)
        variants = [variants[0]] + [_matched(path, v, match, field, target) if v.match else v
                                    for v in variants[1:]]
    eval_seq_lens = tuple(tree.get("eval_seq_lens") or ())
    for length in eval_seq_lens:
        for v in variants:
            if not isinstance(length, int) or not 0 < length <= v.run.model.max_seq_len:
                raise ConfigError(f"{path}: eval_seq_lens {length!r} must be a positive integer "
                                  f"<= model.max_seq_len ({v.run.model.max_seq_len} in variant "
                                  f"{v.name!r})")
    return Study(path, base, seed_list, tuple(variants), match, eval_seq_lens)


def _seeds(path: Path, seeds: Any) -> tuple[int, ...]:
    if isinstance(seeds, int) and not isinstance(seeds, bool) and seeds > 0:
        return tuple(range(seeds))
    if (isinstance(seeds, list) and seeds and len(set(seeds)) == len(seeds)
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        return tuple(seeds)
    raise ConfigError(f"{path}: seeds={seeds!r} must be a positive count or a list of distinct "
                      "non-negative integers")


def _variant(path: Path, base: Path, name: str, overrides: Any,
             common: list[str]) -> Variant:
    where = f"{path}: variant {name!r}"
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{where}: expected a mapping of SECTION.KEY: VALUE overrides, got "
                          f"{overrides!r}")
    overrides = dict(overrides)
    match = overrides.pop("match", True)
    if not isinstance(match, bool):
        raise ConfigError(f"{where}: match={match!r} must be true or false (false: keep this "
                          "variant's widths as written, e.g. an MoE sized for equal active "
                          "parameters by construction)")
    sets = []
    for key, value in overrides.items():
        section, _, field = str(key).partition(".")
        if section in FIXED_SECTIONS or (section == "train" and field in FIXED_TRAIN):
            raise ConfigError(f"{where}: {key} is shared by every variant of a study (the data "
                              "and the token budget); set it in the base config")
        sets.append(f"{key}={json.dumps(value)}")
    return Variant(name, tuple(common + sets), _resolve(where, base, common + sets),
                   match=match)


def _resolve(where: str, base: Path, overrides: list[str]) -> RunConfig:
    try:
        return load_run_config(base, overrides)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_shared(path: Path, variants: list[Variant]) -> None:
    """The data and token budget of every resolved variant equal the baseline's (catches
    changes that come in through other fields)."""
    first = variants[0].run
    for v in variants[1:]:
        if v.run.data != first.data:
            raise ConfigError(f"{path}: variant {v.name!r} changes the data section")
        budget = [getattr(v.run.train, f) for f in FIXED_TRAIN]
        if budget != [getattr(first.train, f) for f in FIXED_TRAIN]:
            raise ConfigError(f"{path}: variant {v.name!r} changes the token budget")


def _measure(run: RunConfig, match: str) -> float:
    if match == "flops":
        return costs.train_flops_per_token(run.model, run.train.seq_len)
    counts = costs.param_counts(run.model)
    return counts.total if match == "params" else counts.active


def _matched(path: Path, variant: Variant, match: str, field: str, target: float) -> Variant:
    """The variant with the model field `field` set to the value whose measure is closest to
    `target`. Every measure grows with a width, so a bisection finds it."""
    where = f"{path}: variant {variant.name!r}"
    key = field.partition(".")[2]
    start = getattr(variant.run.model, key)

    def run_with(value: int) -> RunConfig | None:
        try:
            model = dataclasses.replace(variant.run.model, **{key: value})
        except ConfigError:
            return None
        return dataclasses.replace(variant.run, model=model)

    low, high = 1, max(2 * start, 2)
    while (run := run_with(high)) is not None and _measure(run, match) < target:
        low, high = high, 2 * high
    while high - low > 1:  # the measure at low is below target, at high not (or invalid)
        mid = (low + high) // 2
        run = run_with(mid)
        if run is not None and _measure(run, match) < target:
            low = mid
        else:
            high = mid
    candidates = [(abs(_measure(r, match) - target), v, r)
                  for v in (low, high) if (r := run_with(v)) is not None]
    if not candidates:
        raise ConfigError(f"{where}: no value of {field} gives a valid model")
    _, value, run = min(candidates, key=lambda c: c[:2])
    note = (f"{field} {start} -> {value} ({match} {_measure(run, match):,.0f} vs the "
            f"baseline's {target:,.0f})")
    return Variant(variant.name, variant.overrides + (f"{field}={value}",), run, note)


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
    corpus = find_corpus(base.data.corpus, base.data.val_fraction)
    prepare_tokenizer(base.data, corpus, base.model.vocab_size, workdir, log)
    study = with_tokenizer(study, workdir / TOKENIZER_FILE)
    runs = [(v, seed) for v in study.variants for seed in study.seeds]
    for i, (v, seed) in enumerate(runs, 1):
        if not _run_one(v, seed, workdir / study.run_name(v, seed), f"[{i}/{len(runs)}]", log):
            return None
    if study.eval_seq_lens:
        _evaluate_lengths(study, workdir, corpus, log)
    plot_results(study, workdir)
    return write_results(study, workdir)


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


def _evaluate_lengths(study: Study, workdir: Path, corpus: Corpus,
                      log: Callable[[str], None]) -> None:
    """`val_loss_at_{L}.json` in each run for each of the study's `eval_seq_lens`: the
    validation tokens the trainer evaluates, cut into windows of L tokens (`length_batches`),
    so that lengths differ only in how much context each token sees."""
    tokenizer = load_tokenizer(workdir / TOKENIZER_FILE)
    tokens = tokenize_corpus(corpus, tokenizer, cache_root(), log)
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
    rows = _metrics(path)
    return ((path / run_dir.CHECKPOINTS / str(run.train.steps)).is_dir() and bool(rows)
            and rows[-1].get("step") == run.train.steps and "val_loss" in rows[-1])


def _metrics(path: Path) -> list[dict]:
    file = path / run_dir.METRICS
    if not file.is_file():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def write_results(study: Study, workdir: Path) -> Path:
    """results.csv (one row per variant: costs, final validation loss and perplexity mean/std
    over seeds, difference from the baseline with its significance, tokens/s, peak memory) and
    results.md, from the runs' metrics."""
    rows, finals = [], {}
    for v in study.variants:
        finals[v.name] = {seed: m for seed in study.seeds
                          if (m := _metrics(workdir / study.run_name(v, seed)))
                          and "val_loss" in m[-1]}
        runs = finals[v.name].values()
        losses = [m[-1]["val_loss"] for m in runs]
        speeds = [r["tokens_per_s"] for m in runs for r in m if "tokens_per_s" in r]
        memory = [r["peak_memory_bytes"] for m in runs for r in m if "peak_memory_bytes" in r]
        counts = costs.param_counts(v.run.model)
        rows.append({
            "variant": v.name, "params": counts.total, "active_params": counts.active,
            "flops_per_token": costs.train_flops_per_token(v.run.model, v.run.train.seq_len),
            "kv_bytes_per_token": costs.kv_cache_bytes_per_token(v.run.model),
            "seeds": len(losses),
            **_spread("val_loss", losses),
            **_spread("val_ppl", [math.exp(x) for x in losses]),
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "peak_memory_bytes": int(max(memory)) if memory else None,
            **{f"val_loss_at_{length}": _mean_at(workdir, study, v, length)
               for length in study.eval_seq_lens},
        })
    base = study.variants[0].name
    for v, row in zip(study.variants, rows):
        row.update(compare(_final_losses(finals[v.name]), _final_losses(finals[base])))
    path = workdir / "results.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (workdir / "results.md").write_text(_markdown(rows) + "\n")
    return path


def _spread(name: str, values: list[float]) -> dict[str, float | None]:
    return {name: statistics.mean(values) if values else None,
            f"{name}_std": statistics.stdev(values) if len(values) > 1 else None}


def _final_losses(runs: dict[int, list[dict]]) -> dict[int, float]:
    return {seed: rows[-1]["val_loss"] for seed, rows in runs.items()}


def compare(losses: dict[int, float], base: dict[int, float]) -> dict[str, Any]:
    """A variant's final validation losses against the baseline's, both by seed.

    `delta_vs_base` is the difference of the means. Runs with the same seed see the same
    batches in the same order, so the difference is taken per seed (paired) where both have the
    seed, and `delta_se` is the standard error of that mean difference (std / sqrt(n)); its
    noise is the seed-to-seed change of the *difference*, not of each loss. `significance`:
    "clear" when |delta| is more than twice its standard error and every seed's difference has
    the same sign, "within noise" otherwise, None with fewer than two shared seeds (or for the
    baseline itself).
    """
    if not losses or not base:
        return {"delta_vs_base": None, "delta_se": None, "significance": None}
    delta = statistics.mean(losses.values()) - statistics.mean(base.values())
    paired = [losses[s] - base[s] for s in losses if s in base]
    if len(paired) < 2 or losses == base:
        return {"delta_vs_base": delta, "delta_se": None, "significance": None}
    se = statistics.stdev(paired) / math.sqrt(len(paired))
    same_sign = all(d > 0 for d in paired) or all(d < 0 for d in paired)
    clear = same_sign and abs(delta) > 2 * se
    return {"delta_vs_base": delta, "delta_se": se,
            "significance": "clear" if clear else "within noise"}


def validation_curve(rows: list[dict], tokens_per_step: int) -> list[tuple[int, float, float]]:
    """`(tokens, training seconds, val_loss)` at each evaluation of a run's metrics; seconds
    summed from the logged tokens/s of each window."""
    curve, seconds, last_logged = [], 0.0, 0
    for row in rows:
        if "tokens_per_s" in row:
            seconds += (row["step"] - last_logged) * tokens_per_step / row["tokens_per_s"]
            last_logged = row["step"]
        if "val_loss" in row:
            curve.append((row["step"] * tokens_per_step, seconds, row["val_loss"]))
    return curve


def plot_results(study: Study, workdir: Path) -> list[Path]:
    """loss_vs_tokens.png and loss_vs_time.png in `workdir`, and loss_vs_kv_bytes.png (final
    validation loss against KV-cache bytes per token) when the variants cache different
    amounts."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    curves = {}
    for v in study.variants:
        tokens_per_step = v.run.train.batch_size * v.run.train.seq_len
        runs = [validation_curve(_metrics(workdir / study.run_name(v, seed)), tokens_per_step)
                for seed in study.seeds]
        if runs := [c for c in runs if c]:
            curves[v.name] = runs
    paths = [_plot_curves(plt, study.path.stem, curves, axis, label, workdir / name)
             for axis, label, name in ((0, "training tokens", "loss_vs_tokens.png"),
                                       (1, "training time (s)", "loss_vs_time.png"))]
    kv_bytes = {v.name: costs.kv_cache_bytes_per_token(v.run.model) for v in study.variants}
    if len(set(kv_bytes.values())) > 1:
        finals = {name: [c[-1][2] for c in runs] for name, runs in curves.items()}
        paths.append(_plot_kv_bytes(plt, study.path.stem, finals, kv_bytes,
                                    workdir / "loss_vs_kv_bytes.png"))
    return paths


def _plot_curves(plt, title: str, curves: dict[str, list], axis: int, label: str,
                 path: Path) -> Path:
    """One line per variant: the mean over seeds of the validation loss at each evaluation,
    against tokens (axis 0) or seconds (axis 1); the seeds' range shaded."""
    import numpy as np

    fig, ax = _axes(plt, len(curves))
    for name, runs in curves.items():
        n = min(len(c) for c in runs)
        x = np.mean([[p[axis] for p in c[:n]] for c in runs], axis=0)
        loss = np.array([[p[2] for p in c[:n]] for c in runs])
        (line,) = ax.plot(x, loss.mean(0), marker="o", markersize=3, label=name)
        if len(runs) > 1:
            ax.fill_between(x, loss.min(0), loss.max(0), color=line.get_color(), alpha=0.2)
    ax.set_xlabel(label)
    return _finish(plt, fig, ax, title, path)


def _plot_kv_bytes(plt, title: str, finals: dict[str, list[float]], kv_bytes: dict[str, int],
                   path: Path) -> Path:
    """Each variant's final validation loss (mean, the seeds' range as the error bar) at its
    KV-cache bytes per token."""
    fig, ax = _axes(plt, len(finals))
    for name, losses in finals.items():
        mean = statistics.mean(losses)
        ax.errorbar([kv_bytes[name]], [mean], yerr=[[mean - min(losses)], [max(losses) - mean]],
                    fmt="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV-cache bytes per token (all layers)")
    return _finish(plt, fig, ax, title, path)


def _axes(plt, n_variants: int):
    """A figure whose colours stay distinct up to 20 variants (the default cycle repeats
    after 10)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.set_prop_cycle(color=plt.get_cmap("tab10" if n_variants <= 10 else "tab20").colors)
    return fig, ax


def _finish(plt, fig, ax, title: str, path: Path) -> Path:
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no runs finished yet: an empty plot, no legend
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _mean_at(workdir: Path, study: Study, v: Variant, length: int) -> float | None:
    values = [json.loads(f.read_text())["val_loss"] for seed in study.seeds
              if (f := workdir / study.run_name(v, seed) / f"val_loss_at_{length}.json")
              .is_file()]
    return statistics.mean(values) if values else None


def _markdown(rows: list[dict]) -> str:
    def number(x, fmt):
        return "—" if x is None else format(x, fmt)

    def spread(r, name, fmt):
        std = r[f"{name}_std"]
        return number(r[name], fmt) + ("" if std is None else f" ± {std:{fmt}}")

    extra = [k for k in rows[0] if k.startswith("val_loss_at_")]
    lines = ["| variant | params | active | FLOPs/token | KV bytes/token | val loss (± std) | "
             "val ppl | vs base (± SE) | significance | seeds | tokens/s | peak memory |"
             + "".join(f" val loss at {k.rpartition('_')[2]} |" for k in extra),
             "|---|" + "---:|" * 11 + "---:|" * len(extra)]
    for r in rows:
        delta = number(r["delta_vs_base"], "+.4f") + (
            "" if r["delta_se"] is None else f" ± {r['delta_se']:.4f}")
        memory = ("—" if r["peak_memory_bytes"] is None
                  else f"{r['peak_memory_bytes'] / 2**20:,.0f} MiB")
        lines.append(
            f"| {r['variant']} | {r['params']:,} | {r['active_params']:,} | "
            f"{r['flops_per_token']:,.3g} | {r['kv_bytes_per_token']:,} | "
            f"{spread(r, 'val_loss', '.4f')} | {spread(r, 'val_ppl', '.1f')} | {delta} | "
            f"{r['significance'] or '—'} | {r['seeds']} | {number(r['tokens_per_s'], ',.0f')} | "
            f"{memory} |" + "".join(f" {number(r[k], '.4f')} |"
                                                  for k in extra))
    return "\n".join(lines)


def describe(study: Study) -> str:
    """The `--dry-run` table: one row per variant."""
    rows = ["| variant | params | active | FLOPs/token | KV bytes/token | overrides |",
            "|---|---|---|---|---|---|"]
    for v in study.variants:
        model, counts = v.run.model, costs.param_counts(v.run.model)
        flops = costs.train_flops_per_token(model, v.run.train.seq_len)
        sets = ", ".join(v.overrides) or "(baseline)"
        if v.matched:
            sets += f"; matched: {v.matched}"
        rows.append(f"| {v.name} | {counts.total:,} | {counts.active:,} | {flops:,.3g} | "
                    f"{costs.kv_cache_bytes_per_token(model)} | {sets} |")
    return "\n".join(rows)


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
    record = workdir / STUDY_RECORD
    if not record.is_file():
        raise ConfigError(f"{workdir}: no {STUDY_RECORD}; not the workdir of a study run")
    ran = json.loads(record.read_text())
    study = load_study(ran["study"], steps=ran["steps"], seeds=len(ran["seeds"]),
                       corpus=ran.get("corpus"))  # None: the base config's
    study = dataclasses.replace(study, seeds=tuple(ran["seeds"]))
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
