"""Downstream tasks: task heads against float64 references and transformers'
Llama*Classification models, padding on either side, the task data, fine-tuning through the
trainer (a separable task learnt; a frozen backbone bit-identical; resume == uninterrupted;
sharded == unsharded), predict, and bad input refused before anything compiles."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
import yaml

import llama_jax
from llama_jax.plan import costs
from llama_jax.training import finetune, trainer
from llama_jax.eval import predict
from llama_jax.nn import heads
from llama_jax.parallel import sharding
from llama_jax.data import tasks as task_data
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.config import ModelConfig, TaskConfig
from llama_jax.errors import ConfigError, DataError
from llama_jax.model.transformer import hidden_states
from llama_jax.spec import spec_leaves
from llama_jax.model.params import flat_paths, param_specs
from llama_jax.data.tokenizer import train_sentencepiece
from models import one_step_each_way
from reference import relative_error

REPO = Path(__file__).resolve().parent.parent
BASE = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                   max_seq_len=64, init_std=0.1)
PAD = 2
HEADS = {
    "last": dataclasses.replace(BASE, head="sequence_classification", n_labels=3, pad_id=PAD),
    "mean": dataclasses.replace(BASE, head="sequence_classification", n_labels=3, pad_id=PAD,
                                pooling="mean"),
    "regression": dataclasses.replace(BASE, head="regression", n_labels=2, pad_id=PAD),
    "token": dataclasses.replace(BASE, head="token_classification", n_labels=4, pad_id=PAD),
}
KEYWORDS = ["apple", "banana", "cherry"]
FILLER = "the a of to in is was for on with as by at from this that it we you they".split()
TEXT = [" ".join(FILLER + KEYWORDS)] * 30 + ["Numbers and words: 12 34 the cat sat."] * 10


def _tokens(seed: int, lengths: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.concatenate([[1], rng.integers(3, BASE.vocab_size, n - 1)]).astype(np.int32)
            for n in lengths]


def _padded(rows: list[np.ndarray], T: int, left: bool) -> np.ndarray:
    out = np.full((len(rows), T), PAD, np.int32)
    for i, row in enumerate(rows):
        if left:
            out[i, T - len(row):] = row
        else:
            out[i, :len(row)] = row
    return out


# ------------------------------------------------------------------------------------ heads

@pytest.mark.parametrize("name", list(HEADS))
def test_heads_match_a_float64_reference_under_right_and_left_padding(name):
    """Each row's outputs, padded on the right or on the left in a batch, equal the row alone
    through float64 head math on its hidden states: the last real token's (or the mean of the
    real tokens') state times W, per token W + b for token classification."""
    config = HEADS[name]
    params = llama_jax.init_params(config, jax.random.key(0))
    params["head"] = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(1),
                                                                        a.shape), params["head"])
    rows = _tokens(0, [11, 5, 16])
    w = np.asarray(params["head"]["w"], np.float64)
    expected = []
    for row in rows:
        h = np.asarray(hidden_states(config, params, row[None]), np.float64)[0]
        if config.head == "token_classification":
            expected.append(h @ w + np.asarray(params["head"]["b"], np.float64))
        else:
            expected.append((h.mean(0) if config.pooling == "mean" else h[-1]) @ w)
    forward = jax.jit(llama_jax.forward, static_argnums=0)
    for left in (False, True):
        out = np.asarray(forward(config, params, _padded(rows, 20, left)))
        for i, row in enumerate(rows):
            got = out[i]
            if config.head == "token_classification":
                got = got[20 - len(row):] if left else got[:len(row)]
            assert relative_error(got, expected[i]) < 1e-5, (left, i)
    shapes = {"token_classification": (3, 20, 4), "regression": (3, 2)}
    assert out.shape == shapes.get(config.head, (3, 3))


def test_pooling_picks_the_last_real_token_not_the_last_position():
    """Changing a padded row's padding-side token would change `out[-1]`; the pooled output
    only moves when the last real token changes."""
    config = HEADS["last"]
    params = llama_jax.init_params(config, jax.random.key(0))
    tokens = _padded(_tokens(1, [6, 9]), 12, left=False)
    base = np.asarray(llama_jax.forward(config, params, tokens))
    moved = tokens.copy()
    moved[0, 5] = (moved[0, 5] + 7) % BASE.vocab_size or 3  # the last real token of row 0
    changed = np.asarray(llama_jax.forward(config, params, moved))
    assert np.abs(changed[0] - base[0]).max() > 1e-4 and np.allclose(changed[1], base[1])


@pytest.mark.parametrize("name", list(HEADS))
def test_spec_counts_equal_the_real_leaves(name):
    config = HEADS[name]
    params = llama_jax.init_params(config, jax.random.key(0))
    assert costs.param_counts(config).total == sum(a.size for a in jax.tree.leaves(params))
    assert [s.shape for s in spec_leaves(param_specs(config))] == [
        a.shape for a in jax.tree.leaves(params)]
    assert "lm_head" not in params and costs.param_counts(config).lm_head == 0


def test_head_config_refusals():
    with pytest.raises(ConfigError, match="n_labels=3 applies only to task heads"):
        dataclasses.replace(BASE, n_labels=3)
    with pytest.raises(ConfigError, match="n_labels=None must be an integer >= 2"):
        dataclasses.replace(BASE, head="sequence_classification")
    with pytest.raises(ConfigError, match="pooling='mean' applies only to heads"):
        dataclasses.replace(BASE, head="token_classification", n_labels=2, pooling="mean")
    with pytest.raises(ConfigError, match="pad_id=300 must be a token id"):
        dataclasses.replace(BASE, head="regression", n_labels=1, pad_id=300)
    with pytest.raises(ConfigError, match="label_names=.* must be 2 distinct"):
        dataclasses.replace(BASE, head="regression", n_labels=2, label_names=("a", "a"))
    # a language model's file has no head fields (run hashes of existing studies are stable)
    assert "head" not in BASE.to_dict() and HEADS["last"].to_dict()["n_labels"] == 3


def test_generation_and_lm_training_refuse_a_task_head(tmp_path):
    with pytest.raises(llama_jax.GenerateError, match="task head"):
        llama_jax.generate(HEADS["last"], llama_jax.init_params(HEADS["last"],
                                                                 jax.random.key(0)), [[1, 5]], 2)
    run = llama_jax.RunConfig(model=HEADS["last"])
    with pytest.raises(ConfigError, match="needs a `task:` section"):
        trainer.train(run, tmp_path / "run")


# ------------------------------------------------------------------------------ transformers

HF_HEADS = {"sequence_classification": ("LlamaForSequenceClassification", {}),
            "regression": ("LlamaForSequenceClassification", {"problem_type": "regression"}),
            "token_classification": ("LlamaForTokenClassification", {})}


@pytest.mark.parametrize("head", list(HF_HEADS))
def test_llama_classification_checkpoints_match_transformers_and_export_back(head, tmp_path):
    """transformers' model on a right-padded batch (with its attention mask) and ours on the
    loaded checkpoint agree to 1e-4 (fp32); our export loads back with the same scores."""
    torch = pytest.importorskip("torch")
    import transformers

    from checkpoints import HF_BASE, enlarge_weights

    architecture, extra = HF_HEADS[head]
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**HF_BASE, num_key_value_heads=2, pad_token_id=0,
                                         num_labels=3,
                                         id2label={0: "neg", 1: "neu", 2: "pos"}, **extra)
    model = getattr(transformers, architecture)(hf_config).eval()
    enlarge_weights(model)
    model.save_pretrained(tmp_path / "hf")
    config, params = load_checkpoint(tmp_path / "hf")
    assert (config.head, config.n_labels, config.pad_id) == (head, 3, 0)
    assert config.label_names == ("neg", "neu", "pos")
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 128, (3, 12))
    mask = np.zeros_like(tokens)
    for i, n in enumerate([12, 7, 3]):
        tokens[i, n:], mask[i, :n] = 0, 1
    ours = np.asarray(llama_jax.forward(config, params, tokens))

    def theirs(m):
        with torch.no_grad():
            out = m(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
        return out * mask[..., None] if out.ndim == 3 else out

    expected = theirs(model)
    assert relative_error(ours * (mask[..., None] if ours.ndim == 3 else 1), expected) < 1e-4
    llama_jax.export_hf(config, params, tmp_path / "out")
    back = getattr(transformers, architecture).from_pretrained(tmp_path / "out").eval()
    assert back.config.problem_type == extra.get("problem_type", "single_label_classification"
                                                 if head != "token_classification" else None)
    np.testing.assert_array_equal(theirs(back), expected)


# -------------------------------------------------------------------------------- task data

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    (root / "tokenizer.model").write_bytes(train_sentencepiece(TEXT, 300))
    return root


def test_word_labels_go_to_each_words_first_token(tokenizer_dir, tmp_path):
    tokenizer = llama_jax.load_tokenizer(tokenizer_dir)
    task = TaskConfig(kind="token_classification", train="x", labels=["O", "FRUIT"])
    file = tmp_path / "t.jsonl"
    file.write_text(json.dumps({"text": "the bananas of cherry", "labels": ["O", "FRUIT", "O",
                                                                          1]}) + "\n")
    [example] = task_data.read_examples(file, task, HEADS["token"], tokenizer, 64)
    pieces = [tokenizer.encode(w, bos=False) for w in ("the", " bananas", " of", " cherry")]
    assert example["tokens"].tolist() == [tokenizer.bos_id] + sum(pieces, [])
    first = np.cumsum([1] + [len(p) for p in pieces[:-1]])
    expected = np.full(first[-1] + 1, -1)
    expected[first] = [0, 1, 0, 1]
    assert example["labels"].tolist() == expected.tolist()
    batch = task_data.padded(example, "token_classification", 32, PAD)
    assert batch["labels"][:len(expected)].tolist() == expected.tolist()
    assert batch["labels"][len(expected):].tolist() == [-1] * (32 - len(expected))


def test_metrics_equal_scikit_learn():
    """Accuracy and macro-F1 from summed confusion matrices equal scikit-learn's on the same
    predictions (classes that never occur are left out, as scikit-learn does)."""
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(0)
    true, guess = rng.integers(0, 4, 200), rng.integers(0, 5, 200)  # class 4 only predicted
    confusion = np.zeros((6, 6))
    np.add.at(confusion, (true, guess), 1)
    assert heads.accuracy(confusion) == pytest.approx(accuracy_score(true, guess))
    assert heads.macro_f1(confusion) == pytest.approx(f1_score(true, guess, average="macro"))
    sums = {"loss_sum": 6.0, "count": 3.0, "squared_error_O": np.array([1.0, 2.0])}
    assert heads.task_metrics("regression", sums) == {"loss": 2.0,
                                                      "rmse": pytest.approx(np.sqrt(3 / 6))}


# ------------------------------------------------------------------------------ fine-tuning

def _separable(path: Path, n: int, seed: int, label_of=None) -> Path:
    """Filler words and one keyword, the class, at the end (what `last` pooling reads)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        y = int(rng.integers(3))
        words = list(rng.choice(FILLER, int(rng.integers(1, 5)))) + [KEYWORDS[y]]
        lines.append(json.dumps({"text": " ".join(words),
                                 "label": label_of(y) if label_of else KEYWORDS[y]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def pretrained(tokenizer_dir, tmp_path_factory) -> Path:
    """A (random) language model checkpoint with its tokenizer: what init_from reads."""
    root = tmp_path_factory.mktemp("lm") / "lm"
    llama_jax.save_native(BASE, llama_jax.init_params(BASE, jax.random.key(0)), root)
    (root / "tokenizer.model").write_bytes((tokenizer_dir / "tokenizer.model").read_bytes())
    return root


@pytest.fixture(scope="module")
def task_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("task")
    return {"train": _separable(root / "train.jsonl", 192, 0),
            "val": _separable(root / "val.jsonl", 48, 1, label_of=lambda y: y)}


def _config_file(tmp_path: Path, pretrained: Path, task_files: dict, **train) -> Path:
    tree = {"init_from": str(pretrained),
            "task": {"kind": "sequence_classification", "train": str(task_files["train"]),
                     "val": str(task_files["val"]), "labels": KEYWORDS},
            "train": {"seq_len": 32, "batch_size": 16, "steps": 40, "learning_rate": 3e-3,
                      "warmup_steps": 4, "log_every": 10, "eval_every": 20,
                      "checkpoint_every": 20, **train}}
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture(scope="module")
def finetuned(pretrained, task_files, tmp_path_factory):
    """Full and head-only fine-tuning runs of 40 steps each."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, train in (("full", {}), ("head", {"freeze": "backbone", "learning_rate": 3e-2})):
        run = finetune.load_run_config(_config_file(root, pretrained, task_files, **train))
        outcome = trainer.train(run, root / name, log=lambda _: None, progress=False)
        out[name] = (run, root / name, outcome)
    return out


@pytest.mark.parametrize("name", ["full", "head"])
def test_fine_tuning_learns_a_separable_task(name, finetuned):
    run, _, outcome = finetuned[name]
    assert run.model.pad_id == 2 and run.model.label_names == tuple(KEYWORDS)
    assert outcome.val_metrics["val_accuracy"] >= 0.9
    assert outcome.val_metrics["val_macro_f1"] >= 0.9
    assert outcome.val_loss < 0.5


def test_a_frozen_backbone_stays_bit_identical(finetuned, pretrained):
    _, start = load_checkpoint(pretrained)
    _, head_only = load_checkpoint(finetuned["head"][1])
    _, full = load_checkpoint(finetuned["full"][1])
    backbone = flat_paths({k: v for k, v in start.items() if k != "lm_head"})
    for path, leaf in backbone.items():
        np.testing.assert_array_equal(np.asarray(flat_paths(head_only)[path]), leaf)
        assert not np.array_equal(np.asarray(flat_paths(full)[path]), leaf), path
    assert "lm_head" not in head_only and head_only["head"]["w"].shape == (BASE.dim, 3)


def test_fine_tuning_starts_from_a_hugging_face_checkpoint(tokenizer_dir, task_files, tmp_path):
    """init_from a transformers LlamaForCausalLM directory (with data.tokenizer): the first
    state holds its weights as load_checkpoint reads them, without its LM head, and a new
    head."""
    torch = pytest.importorskip("torch")
    import transformers

    from checkpoints import HF_BASE

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**HF_BASE, "vocab_size": 300}, num_key_value_heads=2))
    model.save_pretrained(tmp_path / "hf")
    config = _config_file(tmp_path, tmp_path / "hf", task_files)
    tree = yaml.safe_load(config.read_text())
    tree["data"] = {"tokenizer": str(tokenizer_dir / "tokenizer.model")}
    config.write_text(yaml.safe_dump(tree))
    run = finetune.load_run_config(config)
    assert (run.model.dim, run.model.head, run.model.pad_id) == (64, "sequence_classification", 2)
    mesh = sharding.make_mesh(run.mesh, jax.devices()[:1])
    params = trainer.initializer(run, mesh).init(jax.random.key(0)).params
    _, hf = load_checkpoint(tmp_path / "hf")
    assert set(params) == {"embed", "groups", "final_norm", "head"}
    for path, leaf in flat_paths({k: v for k, v in hf.items() if k != "lm_head"}).items():
        np.testing.assert_array_equal(np.asarray(flat_paths(params)[path]), np.asarray(leaf))


def test_a_task_run_resumes_exactly(finetuned, pretrained, task_files, tmp_path):
    run, reference, _ = finetuned["full"]
    first = trainer.train(run, tmp_path / "run", stop_at=20, log=lambda _: None,
                          progress=False)
    assert first.stopped_by == "stop_at"
    trainer.train(run, tmp_path / "run", log=lambda _: None, progress=False)
    chex.assert_trees_all_equal(load_checkpoint(tmp_path / "run")[1],
                                load_checkpoint(reference)[1])


def test_a_sharded_task_step_equals_the_single_device_step(finetuned):
    run = dataclasses.replace(finetuned["full"][0], init_from=None)
    batch = task_data.val_batches(
        [{"tokens": t, "label": i % 3} for i, t in enumerate(_tokens(3, [5, 9, 16, 12] * 4))],
        "sequence_classification", 32, PAD, 16)[0]
    results = one_step_each_way(run, batch)
    (single, loss1), (multi, loss8) = results
    assert loss8 == pytest.approx(loss1, rel=1e-5)
    chex.assert_trees_all_close(multi, single, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["doc", "doc-head"])
def test_the_shipped_task_configs_load(name, pretrained):
    """configs/tasks/ (the demo task) with init_from pointed at a test checkpoint."""
    run = finetune.load_run_config(REPO / "configs" / "tasks" / f"{name}.yaml",
                                   [f"init_from={pretrained}"])
    assert (run.model.head, run.model.n_labels, run.model.dim) == (
        "sequence_classification", 7, BASE.dim)
    assert run.train.freeze == ("backbone" if name == "doc-head" else "none")


def test_a_frozen_backbone_has_no_backward_pass(finetuned):
    """XLA's FLOP count of the compiled head-only step is about a third of the full step's
    (the forward pass alone), as `costs.train_flops_per_token` says."""
    flops = {}
    for name in ("full", "head"):
        run = dataclasses.replace(finetuned[name][0], init_from=None)
        mesh = sharding.make_mesh(run.mesh, jax.devices()[:1])
        programs = trainer.compile_programs(run, 1, mesh, evaluate=False)
        flops[name] = programs.step.cost_analysis()["flops"]
    run = finetuned["head"][0]
    formula = {name: costs.train_flops_per_token(run.model, run.train.seq_len,
                                                 frozen_backbone=name == "head")
               for name in flops}
    assert flops["head"] / flops["full"] == pytest.approx(formula["head"] / formula["full"],
                                                          abs=0.1)
    assert flops["head"] / flops["full"] < 0.45


def test_predict_prints_the_models_probabilities(finetuned, task_files):
    """Each line's probabilities are the softmax of the forward pass on that example alone;
    the file's accuracy goes to stderr."""
    _, workdir, _ = finetuned["full"]
    out = subprocess.run([sys.executable, "-m", "llama_jax.eval.predict", "--checkpoint",
                          str(workdir), "--input", str(task_files["val"]), "--batch-size", "5"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    config, params = load_checkpoint(workdir)
    tokenizer = llama_jax.load_tokenizer(workdir)
    records = [json.loads(line) for line in task_files["val"].read_text().splitlines()]
    assert len(lines) == len(records) == 48
    tokens = _padded([np.asarray(tokenizer.encode(r["text"])) for r in records], 32, left=False)
    probabilities = np.asarray(jax.nn.softmax(llama_jax.forward(config, params, tokens)))
    correct = 0
    for line, record, expected in zip(lines, records, probabilities):
        np.testing.assert_allclose([line["probabilities"][k] for k in KEYWORDS], expected,
                                   atol=2e-6)
        assert line["label"] == KEYWORDS[int(np.argmax(expected))]
        correct += line["label"] == KEYWORDS[record["label"]]
    assert f"accuracy {correct / 48:.4f}" in out.stderr


def test_predict_without_a_pad_id_runs_each_example_unpadded():
    """A model without a pad id (HF's pad_token_id null) would pool padding: predict then
    gives each example's outputs alone."""
    config = dataclasses.replace(HEADS["last"], pad_id=None)
    params = llama_jax.init_params(config, jax.random.key(0))
    examples = [{"tokens": row} for row in _tokens(2, [5, 11, 3])]
    for example, output in zip(examples, predict.predict(config, params, examples, 8)):
        np.testing.assert_allclose(
            output, llama_jax.forward(config, params, example["tokens"][None])[0], atol=1e-6)


# -------------------------------------------------------------------------------- bad input

def _refused(monkeypatch, config: Path, match: str, error=DataError):
    monkeypatch.setattr(trainer, "compile_programs", lambda *a: pytest.fail("compiled"))
    run = finetune.load_run_config(config)
    with pytest.raises(error, match=match):
        trainer.train(run, config.parent / "run", log=lambda _: None, progress=False)


def test_a_label_outside_the_heads_range_is_refused(pretrained, task_files, tmp_path,
                                                     monkeypatch):
    bad = _separable(tmp_path / "bad.jsonl", 20, 0, label_of=lambda y: y)
    bad.write_text(bad.read_text() + json.dumps({"text": "x y", "label": 3}) + "\n")
    files = {**task_files, "train": bad}
    _refused(monkeypatch, _config_file(tmp_path, pretrained, files),
             rf"{bad}:21: label 3 is outside the head's 3 labels")
    bad.write_text(json.dumps({"text": "x y", "label": "durian"}) + "\n")
    _refused(monkeypatch, _config_file(tmp_path, pretrained, files),
             r"label 'durian' is outside the head's 3 labels \(expected one of \['apple'")


def test_a_missing_text_field_is_refused(pretrained, task_files, tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"txt": "apple", "label": 0}) + "\n")
    _refused(monkeypatch, _config_file(tmp_path, pretrained, {**task_files, "val": bad}),
             rf"{bad}:1: missing field 'text'")


def test_a_task_whose_head_does_not_match_the_checkpoint_is_refused(finetuned, task_files,
                                                                    tmp_path):
    """A fine-tuned run has a 3-label head: a 4-label task (or a regression) from it is
    refused when the config is read, before anything is loaded or compiled."""
    config = _config_file(tmp_path, finetuned["full"][1], task_files)
    tree = yaml.safe_load(config.read_text())
    tree["task"]["labels"] = KEYWORDS + ["durian"]
    config.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=r"task 'sequence_classification' with 4 output\(s\) "
                                          r"does not match the head of init_from"):
        finetune.load_run_config(config)
    tree["model"] = {"dim": 64}
    tree["task"]["labels"] = KEYWORDS
    config.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match="model.dim=64, but the init_from checkpoint"):
        finetune.load_run_config(config)


def test_the_cli_prints_one_line_for_bad_task_input(pretrained, task_files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    config = _config_file(tmp_path, pretrained, {**task_files, "train": bad})
    out = subprocess.run([sys.executable, "train.py", "--config", str(config), "--workdir",
                          str(tmp_path / "run"), "--no-progress"], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:1: not a JSON object")
