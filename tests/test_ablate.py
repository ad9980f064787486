"""Ablation studies: study files resolve into variants (overrides of a base run config), what
must stay equal is enforced before anything trains, and equal-parameter matching."""

import math
from pathlib import Path

import pytest

from llama_jax.research import ablate
from llama_jax.research.report import compare, plot_results, validation_curve, write_results
from llama_jax.research.runner import length_batches, run_study
from llama_jax.research.study import load_study, run_key
from llama_jax.plan import costs
from llama_jax.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent

BASE = """
model: {vocab_size: 256, dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, multiple_of: 32}
train: {seq_len: 32, batch_size: 4, steps: 6}
data: {corpus: unused}
"""


def study(tmp_path, body: str):
    (tmp_path / "base.yaml").write_text(BASE)
    path = tmp_path / "study.yaml"
    path.write_text("base: base.yaml\n" + body)
    return path


def test_variants_resolve_as_overrides_of_the_base(tmp_path, capsys):
    path = study(tmp_path, "seeds: [3, 5]\nvariants:\n  rms: {}\n"
                           "  ln: {model.norm: layernorm, train.learning_rate: 1.0e-3}\n")
    s = load_study(path)
    assert s.seeds == (3, 5) and [v.name for v in s.variants] == ["rms", "ln"]
    rms, ln = s.variants
    assert (rms.run.model.norm, ln.run.model.norm) == ("rmsnorm", "layernorm")
    assert ln.run.train.learning_rate == 1e-3 and ln.for_seed(5).train.seed == 5
    # run names: stable for an unchanged variant, new for an edited one or another seed
    assert s.run_name(ln, 3) == load_study(path).run_name(ln, 3)
    assert len({s.run_name(ln, 3), s.run_name(ln, 5), s.run_name(rms, 3)}) == 3
    assert ablate.main([str(path), "--dry-run", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "seeds [0]" in out and "| ln |" in out and 'model.norm="layernorm"' in out


def test_validation_curves_sum_training_time_from_the_logged_windows():
    rows = [{"step": 2, "tokens_per_s": 100.0}, {"step": 3, "val_loss": 5.0},
            {"step": 4, "tokens_per_s": 50.0, "val_loss": 4.0}]
    # 2 steps of 10 tokens at 100/s, then 2 more at 50/s
    assert validation_curve(rows, 10) == [(30, 0.2, 5.0), (40, 0.6000000000000001, 4.0)]


@pytest.mark.parametrize("match", ["params", "active_params", "flops"])
def test_equal_parameter_matching_is_within_one_percent(match, tmp_path):
    path = study(tmp_path, f"match: {match}\nmatch_field: model.ffn_dim\nvariants:\n"
                           "  swiglu: {}\n  gelu: {model.mlp: gelu}\n  relu: {model.mlp: relu}\n"
                           "  wide: {model.dim: 96, model.n_heads: 6, model.n_kv_heads: 3}\n")
    s = load_study(path)
    measure = {"params": lambda r: costs.param_counts(r.model).total,
               "active_params": lambda r: costs.param_counts(r.model).active,
               "flops": lambda r: costs.train_flops_per_token(r.model, r.train.seq_len)}[match]
    target = measure(s.variants[0].run)
    for v in s.variants[1:]:
        assert abs(measure(v.run) / target - 1) < 0.01, (v.name, v.matched)
        assert v.matched.startswith("model.ffn_dim ")
    assert s.variants[1].run.model.ffn_dim > s.variants[0].run.model.ffn_dim  # 2 matrices


def test_a_variant_can_keep_its_widths_under_matching(tmp_path):
    """An MoE sized for equal active parameters by construction is not matched on totals."""
    path = study(tmp_path, "match: params\nmatch_field: model.ffn_dim\nvariants:\n"
                           "  dense: {}\n  moe: {model.mlp: moe, match: false, model.moe: "
                           "{n_experts: 4, top_k: 2, expert_ffn_dim: 96}}\n")
    dense, moe = load_study(path).variants
    assert moe.matched is None and moe.run.model.ffn_dim == dense.run.model.ffn_dim
    moe_counts, dense_counts = (costs.param_counts(v.run.model) for v in (moe, dense))
    assert dense.run.model.ffn_dim == 2 * 96  # so equal active parameters, but for routers
    assert moe_counts.total > 1.5 * dense_counts.total
    assert moe_counts.active - dense_counts.active == 2 * 64 * 4  # the routers [D, E]


@pytest.mark.parametrize("body, message", [
    ("variants:\n  a: {}\n  b: {data.val_fraction: 0.1}\n",
     r"variant 'b': data\.val_fraction is shared by every variant"),
    ("variants:\n  a: {}\n  b: {train.steps: 100}\n", r"variant 'b': train\.steps is shared"),
    ("variants:\n  a: {}\n  b: {train.seq_len: 64}\n", r"variant 'b': train\.seq_len is shared"),
    ("variants:\n  a: {}\n  b: {model.nrom: layernorm}\n",
     r"variant 'b': .*unknown key 'nrom' \(did you mean 'norm'\?\)"),
    ("variants:\n  a: {}\n  b: {model.norm: batchnorm}\n",
     r"variant 'b': .*norm='batchnorm' is not one of"),
    ("variants:\n  a: {}\n  b: {model.n_kv_heads: 3}\n", r"variant 'b': .*n_kv_heads=3"),
    ("variants:\n  a: {}\n  b: [model.norm]\n", r"variant 'b': expected a mapping"),
    ("seeds: 0\nvariants: {a: {}}\n", r"seeds=0 must be a positive count"),
    ("match: params\nvariants: {a: {}}\n", r"`match` and `match_field` go together"),
    ("match: loss\nmatch_field: model.dim\nvariants: {a: {}}\n", r"match='loss' is not one of"),
    ("match: params\nmatch_field: train.seed\nvariants: {a: {}, b: {}}\n",
     r"match_field train\.seed must be an integer field of the model"),
    ("variants: {}\n", r"a study needs `base:`"),
    ("varients: {a: {}}\n", r"unknown key\(s\) \['varients'\]"),
    ("variants:\n  a: {}\n  b: {match: 3}\n", r"variant 'b': match=3 must be"),
])
def test_bad_studies_are_refused_naming_the_variant(body, message, tmp_path, capsys):
    path = study(tmp_path, body)
    with pytest.raises(ConfigError, match=r"study\.yaml: " + message):
        load_study(path)
    assert ablate.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_results_and_plots_come_from_the_runs_metrics(tmp_path):
    """Fabricated metrics in each run's directory: the table's means, perplexities, speeds and
    memory are theirs, and the KV-bytes plot appears only when the variants differ in it."""
    import csv
    import json

    path = study(tmp_path, "seeds: 2\nvariants:\n  gqa: {}\n  mqa: {model.n_kv_heads: 1}\n")
    s, workdir = load_study(path), tmp_path / "out"
    finals = {("gqa", 0): 5.0, ("gqa", 1): 5.2, ("mqa", 0): 5.3, ("mqa", 1): 5.6}
    for v in s.variants:
        for seed in s.seeds:
            run = workdir / s.run_name(v, seed)
            run.mkdir(parents=True)
            rows = [{"step": 3, "loss": 6.0, "tokens_per_s": 100.0 + seed,
                     "peak_memory_bytes": 1000.0 + seed, "val_loss": 6.0},
                    {"step": 6, "loss": 5.0, "tokens_per_s": 300.0,
                     "peak_memory_bytes": 900.0, "val_loss": finals[v.name, seed]}]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = {r["variant"]: r for r in csv.DictReader(write_results(s, workdir).open())}
    assert float(rows["mqa"]["val_loss"]) == pytest.approx(5.45)
    assert float(rows["mqa"]["val_ppl"]) == pytest.approx((math.exp(5.3) + math.exp(5.6)) / 2)
    assert float(rows["mqa"]["delta_vs_base"]) == pytest.approx(0.35)
    assert float(rows["mqa"]["delta_se"]) == pytest.approx(0.05)  # per-seed 0.3 and 0.4
    assert rows["mqa"]["significance"] == "clear"
    assert float(rows["gqa"]["tokens_per_s"]) == pytest.approx(200.5)  # the median of windows
    assert int(rows["gqa"]["peak_memory_bytes"]) == 1001
    assert int(rows["mqa"]["kv_bytes_per_token"]) * 2 == int(rows["gqa"]["kv_bytes_per_token"])
    plots = plot_results(s, workdir)
    assert [p.name for p in plots] == ["loss_vs_tokens.png", "loss_vs_time.png",
                                       "loss_vs_kv_bytes.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    (tmp_path / "same").mkdir()
    same = load_study(study(tmp_path / "same",
                                   "variants:\n  a: {}\n  b: {model.norm: layernorm}\n"))
    assert "loss_vs_kv_bytes.png" not in [p.name for p in plot_results(same, workdir)]


@pytest.mark.parametrize("variant, base, expected", [
    # paired by seed: the differences 0.10 and 0.12 -> mean 0.11, SE = 0.01
    ({0: 3.10, 1: 3.32}, {0: 3.00, 1: 3.20}, (0.11, 0.01, "clear")),
    # a mean difference of 0.01 against per-seed differences of +0.1 and -0.08
    ({0: 3.10, 1: 3.12}, {0: 3.00, 1: 3.20}, (0.01, 0.09, "within noise")),
    # large, but one seed points the other way
    ({0: 3.50, 1: 3.19}, {0: 3.00, 1: 3.20}, (0.245, 0.255, "within noise")),
    # beyond 2 SE (differences 0.4, 0.4, 0.4, -0.01), but one seed points the other way
    ({0: 3.4, 1: 3.4, 2: 3.4, 3: 2.99}, {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0},
     (0.2975, 0.1025, "within noise")),
    # one seed: no spread to judge by
    ({0: 3.10}, {0: 3.00}, (0.10, None, None)),
])
def test_differences_from_the_base_are_paired_by_seed(variant, base, expected):
    got = compare(variant, base)
    delta, se, note = expected
    assert got["delta_vs_base"] == pytest.approx(delta)
    assert (got["delta_se"] is None) == (se is None)
    if se is not None:
        assert got["delta_se"] == pytest.approx(se)
    assert got["significance"] == note
    assert compare(base, base)["significance"] is None


def test_a_tiny_study_runs_and_reruns_nothing(corpus_dir, tmp_path, capsys):
    """2 variants x 2 seeds, a few steps each: one workdir per run, results that agree with
    the runs' metrics, a rerun that trains nothing, and a run without its last checkpoint
    resumed alone."""
    import json
    import shutil

    (tmp_path / "base.yaml").write_text("""
model: {vocab_size: 512, dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, multiple_of: 32,
        max_seq_len: 64}
train: {seq_len: 32, batch_size: 8, steps: 4, warmup_steps: 1, log_every: 2, eval_every: 2,
        eval_batches: 1, checkpoint_every: 2}
data: {corpus: unused}
""")  # the corpus comes from the command line (--corpus), as every run's data.corpus
    path = tmp_path / "study.yaml"
    path.write_text("base: base.yaml\nseeds: 2\neval_seq_lens: [32, 64]\nvariants:\n"
                    "  rms: {}\n  ln: {model.norm: layernorm}\n")
    corpus = str(corpus_dir)
    study, workdir, logs = load_study(path, corpus=corpus), tmp_path / "out", []
    results = run_study(study, workdir, log=logs.append)
    names = sorted(p.name for p in workdir.iterdir() if p.is_dir())
    assert len(names) == 4 and {n.split("-s")[0] for n in names} == {"rms", "ln"}
    rows = {r["variant"]: r for r in __import__("csv").DictReader(results.open())}
    for v in study.variants:
        finals = [json.loads((workdir / study.run_name(v, s) / "metrics.jsonl").read_text()
                             .splitlines()[-1])["val_loss"] for s in study.seeds]
        assert float(rows[v.name]["val_loss"]) == pytest.approx(sum(finals) / 2, rel=1e-9)
        # evaluated again at the training length: the trainer's number; at 2x: another
        assert float(rows[v.name]["val_loss_at_32"]) == pytest.approx(sum(finals) / 2,
                                                                        rel=1e-5)
        assert 0 < float(rows[v.name]["val_loss_at_64"]) < 2 * math.log(512)
        assert int(rows[v.name]["seeds"]) == 2
        assert float(rows[v.name]["val_ppl"]) == pytest.approx(
            sum(math.exp(x) for x in finals) / 2, rel=1e-9)
        # peak memory (CPU: the compiled step's footprint) holds at least the state: the
        # float32 parameters and AdamW's two moments
        peak = int(rows[v.name]["peak_memory_bytes"])
        assert peak >= 3 * 4 * costs.param_counts(v.run.model).total
    # other lengths see the same validation tokens: 1 batch of 32-token windows = 2 of 16
    assert [length_batches(study.variants[0].run, n) for n in (16, 32, 64)] == [2, 1, 1]
    base_losses, ln_losses = (
        {s: json.loads((workdir / study.run_name(v, s) / "metrics.jsonl").read_text()
                       .splitlines()[-1])["val_loss"] for s in study.seeds}
        for v in study.variants)
    assert float(rows["ln"]["delta_vs_base"]) == pytest.approx(
        compare(ln_losses, base_losses)["delta_vs_base"], rel=1e-9)
    assert rows["rms"]["significance"] == "" and rows["ln"]["significance"] in (
        "clear", "within noise")
    assert "| ln |" in (workdir / "results.md").read_text()
    for plot in ("loss_vs_tokens.png", "loss_vs_time.png"):
        assert (workdir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same tokenizer for every run
    tokenizers = {(workdir / n / "tokenizer.model").read_bytes() for n in names}
    assert len(tokenizers) == 1

    # the runs are ordinary workdirs (load_checkpoint, sample.py); results rebuild from them
    import llama_jax
    import sample
    from llama_jax.decode.generate import generate

    run = workdir / names[0]
    config, params = llama_jax.load_checkpoint(run)
    assert config.n_layers == 2
    assert sample.main(["--checkpoint", str(run), "--prompt", "The", "--temperature", "0",
                        "--max-new-tokens", "5"]) == 0
    tokenizer = llama_jax.load_tokenizer(run)
    prompt = tokenizer.encode("The")
    greedy = generate(config, params, [prompt], 5)[0]
    # sample.py prints the prompt and then the text the new tokens add to it (decoded alone,
    # SentencePiece would drop the space of the first new piece)
    continuation = tokenizer.decode(prompt + greedy)[len(tokenizer.decode(prompt)):]
    assert capsys.readouterr().out == "The" + continuation + "\n"
    csv_text = results.read_text()
    results.unlink()
    assert ablate.main(["report", str(workdir)]) == 0 and results.read_text() == csv_text

    logs.clear()
    run_study(load_study(path, corpus=corpus), workdir, log=logs.append)
    assert sum("finished, skipped" in line for line in logs) == 4
    # another study beside it with the same baseline: linked, not trained again
    other = tmp_path / "other.yaml"
    other.write_text("base: base.yaml\nseeds: [1]\nvariants:\n  same-as-rms: {}\n")
    logs.clear()
    run_study(load_study(other, corpus=corpus), tmp_path / "other", log=logs.append)
    linked = tmp_path / "other" / f"same-as-rms-{run_key(study.variants[0], 1)}"
    assert linked.resolve() == (workdir / study.run_name(study.variants[0], 1)).resolve()
    assert [line for line in logs if line.startswith("[1/1]")] == [
        f"[1/1] {linked.name}: the same run as {workdir / study.run_name(study.variants[0], 1)}"
        ", linked"]
    shutil.rmtree(workdir / study.run_name(study.variants[1], 0) / "checkpoints" / "4")
    logs.clear()
    run_study(load_study(path, corpus=corpus), workdir, log=logs.append)
    trained = [line for line in logs if line.endswith("training")]
    assert len(trained) == 1 and study.run_name(study.variants[1], 0) in trained[0]


def test_a_signal_stops_the_study_not_just_its_run(tmp_path, corpus_dir, monkeypatch):
    """SIGINT/SIGTERM stop the trainer at a checkpoint; the study must not go on to the next
    run (the user asked to stop) nor write results."""
    from llama_jax.training import trainer

    trained = []

    def interrupted(run, path, **_):
        trained.append(path.name)
        return trainer.Outcome(step=1, stopped_by="SIGTERM")

    monkeypatch.setattr(trainer, "train", interrupted)
    (tmp_path / "base.yaml").write_text(BASE.replace("corpus: unused", f"corpus: {corpus_dir}")
                                        .replace("vocab_size: 256", "vocab_size: 512"))
    path = tmp_path / "study.yaml"
    path.write_text("base: base.yaml\nseeds: 2\nvariants:\n  rms: {}\n"
                    "  ln: {model.norm: layernorm}\n")
    logs = []
    assert run_study(load_study(path), tmp_path / "out", log=logs.append) is None
    assert len(trained) == 1 and "stopped by SIGTERM" in logs[-1]
    assert not (tmp_path / "out" / "results.csv").exists()


# The run keys of the shipped studies' seed-0 runs, as their finished runs were saved: a change
# to how configs resolve or serialise would orphan them (the runner would train them again).
SHIPPED_RUN_KEYS = {
    ("attention", "mha"): "s0-8bfc4b62",
    ("attention", "gqa"): "s0-1dc98677",
    ("attention", "mqa"): "s0-7b91ae55",
    ("attention", "mla"): "s0-d433be25",
    ("ffn", "swiglu"): "s0-8bfc4b62",
    ("ffn", "geglu"): "s0-71d1b2af",
    ("ffn", "gelu"): "s0-a983e9ed",
    ("ffn", "relu"): "s0-0cbe30b7",
    ("ffn", "moe-8x172-top2"): "s0-f8ebff65",
    ("norm", "rmsnorm-pre"): "s0-8bfc4b62",
    ("norm", "layernorm-pre"): "s0-7da8812e",
    ("norm", "rmsnorm-post"): "s0-d4a220cd",
    ("norm", "layernorm-post"): "s0-a19a5e5c",
    ("norm", "layernorm-post-lr1e-3"): "s0-90dfcee0",
    ("position", "rope"): "s0-8bfc4b62",
    ("position", "sinusoidal"): "s0-48bd9475",
    ("position", "learned"): "s0-c8b87b50",
    ("position", "none"): "s0-e626fddb",
    ("position", "sinusoidal+scaled-embedding"): "s0-76b95683",
    ("transformer_vs_llama", "llama"): "s0-8bfc4b62",
    ("transformer_vs_llama", "transformer"): "s0-4aa8e3eb",
    ("transformer_vs_llama", "transformer+pre-norm"): "s0-65a80fec",
    ("transformer_vs_llama", "transformer+rmsnorm"): "s0-99750206",
    ("transformer_vs_llama", "transformer+rope"): "s0-11a9c665",
    ("transformer_vs_llama", "transformer+swiglu"): "s0-b4a3c193",
    ("transformer_vs_llama", "transformer+no-bias"): "s0-8c026da3",
    ("transformer_vs_llama", "transformer+untied"): "s0-bf1ea959",
    ("transformer_vs_llama", "pre-norm+rmsnorm"): "s0-90194c93",
    ("transformer_vs_llama", "pre-norm+rmsnorm+rope"): "s0-b181e962",
    ("transformer_vs_llama", "pre-norm+rmsnorm+rope+swiglu"): "s0-fe0a721f",
    ("transformer_vs_llama", "pre-norm+rmsnorm+rope+swiglu+no-bias"): "s0-bc00d846",
}


def test_the_shipped_studies_still_find_their_finished_runs():
    keys = {}
    for study_file in sorted((REPO / "configs" / "ablations").glob("[a-z]*.yaml")):
        for variant in load_study(str(study_file)).variants:
            keys[(study_file.stem, variant.name)] = run_key(variant, 0)
    assert keys == SHIPPED_RUN_KEYS
