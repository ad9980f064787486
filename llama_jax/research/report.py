"""A study's results, from its runs' metrics.jsonl: `results.csv` / `results.md` (one row per
variant: costs, the final validation loss and perplexity over seeds, the difference from the
baseline paired by seed — `compare` — tokens/s and peak memory), and PNG plots of the
validation loss against training tokens and against training wall-clock (evaluation and
checkpointing excluded), one line per variant (the mean over seeds, their range shaded), and,
when the variants cache different amounts, the final loss against KV-cache bytes per token.
Also the `--dry-run` table of the variants' costs (`describe`).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from llama_jax.formats import workdir as run_dir
from llama_jax.plan import costs
from llama_jax.research.study import Study, Variant


def read_metrics(path: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl; none before the run has logged."""
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
                          if (m := read_metrics(workdir / study.run_name(v, seed)))
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
        runs = [validation_curve(read_metrics(workdir / study.run_name(v, seed)), tokens_per_step)
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

