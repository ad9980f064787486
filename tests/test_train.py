"""Training: the step (loss, accumulation, decay mask, schedules, non-finite skipping) and the
loop (exact resume, SIGTERM, crash while saving, metrics, bad input)."""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from llama_jax.training import metrics, trainer
from llama_jax.formats import workdir as run_dir
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.config import DataConfig, ModelConfig, MoeConfig, RunConfig, TrainConfig
from llama_jax.errors import ConfigError, DataError, TrainingError
from llama_jax.training.optim import learning_rate_schedule, make_optimizer, weight_decay_mask
from llama_jax.model.params import flat_paths
from llama_jax.training.step import init_state, objective, train_step
from reference import relative_error

REPO = Path(__file__).resolve().parent.parent
MODEL = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32,
                    max_seq_len=64)
TRAIN = TrainConfig(seq_len=32, batch_size=8, steps=6, learning_rate=3e-3, warmup_steps=2,
                    log_every=2, eval_every=3, eval_batches=2, checkpoint_every=3,
                    keep_checkpoints=5)
quiet = functools.partial(trainer.train, log=lambda _: None, progress=False)


@pytest.fixture(scope="module")
def run(corpus_dir) -> RunConfig:
    return RunConfig(model=MODEL, train=TRAIN, data=DataConfig(corpus=str(corpus_dir)))


@pytest.fixture(scope="module")
def straight(run, tmp_path_factory) -> Path:
    """The reference: steps 1..6 without interruption."""
    workdir = tmp_path_factory.mktemp("straight")
    outcome = quiet(run, workdir)
    assert outcome.step == 6 and outcome.stopped_by is None
    return workdir


def _final_params(workdir: Path):
    return load_checkpoint(workdir)[1]


def _assert_same_run(workdir: Path, reference: Path, steps: int = 6) -> None:
    """Bit-for-bit: final parameters and every logged loss."""
    chex.assert_trees_all_equal(_final_params(workdir), _final_params(reference))
    losses = [(r["step"], r["loss"]) for r in metrics.read(workdir / run_dir.METRICS)]
    assert losses == [(r["step"], r["loss"]) for r in metrics.read(reference / run_dir.METRICS)]
    assert [step for step, _ in losses] == list(range(1, steps + 1))


def _batch(seed: int, batch: int = 8, length: int = 33) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    window = rng.integers(3, MODEL.vocab_size, (batch, length))
    window[:, 0] = 1
    window[rng.random(window.shape) < 0.05] = 1  # a few packed document starts
    return jnp.asarray(window, jnp.int32)


def _step_fn(train: TrainConfig, model: ModelConfig = MODEL):
    optimizer = make_optimizer(model, train)
    state = init_state(model, optimizer, jax.random.key(0))
    loss_fn = objective(RunConfig(model, train), 1)
    return state, jax.jit(functools.partial(train_step, model, train, optimizer, loss_fn))


# An MoE whose sigmoid router's selection bias moves by a rule after every (finite) step.
MOE_MODEL = dataclasses.replace(MODEL, mlp="moe", ffn_dim=32, moe=MoeConfig(
    n_experts=4, top_k=2, router="sigmoid", bias_update_rate=0.01))


def test_loss_falls_when_overfitting_one_batch():
    state, step = _step_fn(dataclasses.replace(TRAIN, steps=60, warmup_steps=5))
    batch = _batch(0)
    losses = []
    for _ in range(60):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[0] == pytest.approx(np.log(MODEL.vocab_size), abs=0.3)  # uniform at init
    assert losses[-1] < 0.3 * losses[0]


def wq(params):
    return params["groups"][0]["attn"]["wq"]


def test_gradient_accumulation_equals_one_big_batch():
    batch = _batch(1)
    results = []
    for micro in (1, 4):
        state, step = _step_fn(dataclasses.replace(TRAIN, micro_batches=micro))
        results.append(step(state, batch))
    (one, m1), (four, m4) = results
    # (a mean of 256 positive terms summed in another order: a few float32 roundings)
    assert float(m4["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    assert relative_error(wq(four.params), wq(one.params)) < 1e-5
    chex.assert_trees_all_close(four.params, one.params, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("model", [MODEL, dataclasses.replace(
    MODEL, norm="layernorm", bias=True, positions="learned", mlp="gelu")],
    ids=["llama", "gpt2-like"])
def test_weight_decay_spares_gains_and_biases(model):
    optimizer = make_optimizer(model, dataclasses.replace(TRAIN, warmup_steps=0))
    params = init_state(model, optimizer, jax.random.key(0)).params
    params = jax.tree.map(lambda p: p + 0.5, params)  # biases start at zero: make them visible
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero, optimizer.init(params), params)
    new = flat_paths(optax.apply_updates(params, updates))
    shrink = 1 - TRAIN.learning_rate * TRAIN.weight_decay
    decayed = []
    for path, before in flat_paths(params).items():
        name = path.split("/")[-1]
        if name in ("scale", "bias") or name.startswith("b"):  # gains and biases
            np.testing.assert_array_equal(new[path], before)
        else:  # matrices and embedding tables
            np.testing.assert_allclose(new[path], before * shrink, rtol=1e-6)
            decayed.append(path)
    assert "embed/table" in decayed and "groups/0/attn/wq" in decayed


@pytest.mark.parametrize("mu_dtype", [None, "bfloat16"])
def test_adamw_matches_a_float64_reference(mu_dtype):
    """Three updates of random gradients against AdamW in float64 (decoupled decay on
    matrices, bias correction, the schedule's rates); with `mu_dtype: bfloat16` the first
    moment is stored rounded to bf16 after each update, and the second stays fp32 like the
    parameters."""
    import ml_dtypes

    train = dataclasses.replace(TRAIN, clip_norm=0.0, warmup_steps=1, mu_dtype=mu_dtype)
    optimizer = make_optimizer(MODEL, train)
    params = init_state(MODEL, optimizer, jax.random.key(0)).params
    opt_state = optimizer.init(params)
    paths = flat_paths(params)
    p64 = {k: np.asarray(v, np.float64) for k, v in paths.items()}
    m64 = {k: np.zeros_like(v) for k, v in p64.items()}
    v64 = {k: np.zeros_like(v) for k, v in p64.items()}
    decays = flat_paths(weight_decay_mask(MODEL))
    lr = learning_rate_schedule(train)
    rng = np.random.default_rng(0)
    for t in range(1, 4):
        grad_tree = jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), params)
        grads = flat_paths(grad_tree)
        updates, opt_state = optimizer.update(grad_tree, opt_state, params)
        params = optax.apply_updates(params, updates)
        rate = float(lr(t - 1))
        for k, g in grads.items():
            m = train.b1 * np.float64(m64[k]) + (1 - train.b1) * np.float64(g)
            v64[k] = train.b2 * v64[k] + (1 - train.b2) * np.float64(g) ** 2
            step = (m / (1 - train.b1 ** t)) / (np.sqrt(v64[k] / (1 - train.b2 ** t)) + train.eps)
            p64[k] -= rate * (step + (train.weight_decay * p64[k] if decays[k] else 0))
            m64[k] = m.astype(ml_dtypes.bfloat16) if mu_dtype else m
    moments = {leaf.dtype for leaf in jax.tree.leaves(opt_state) if leaf.ndim > 1}
    assert moments == {jnp.dtype(mu_dtype or "float32"), jnp.dtype("float32")}
    for k, got in flat_paths(params).items():
        assert relative_error(got, p64[k]) < 1e-6, k


def test_schedules():
    base = dict(steps=100, learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    cosine = learning_rate_schedule(TrainConfig(**base, schedule="cosine"))
    assert float(cosine(0)) == 0 and float(cosine(5)) == pytest.approx(0.5)
    assert float(cosine(10)) == pytest.approx(1.0)
    assert float(cosine(55)) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)  # half-way down
    assert float(cosine(100)) == pytest.approx(0.1)
    wsd = learning_rate_schedule(TrainConfig(**base, schedule="wsd", decay_fraction=0.2))
    assert [float(wsd(s)) for s in (10, 50, 80)] == pytest.approx([1.0, 1.0, 1.0])
    assert float(wsd(90)) == pytest.approx(0.55) and float(wsd(100)) == pytest.approx(0.1)
    constant = learning_rate_schedule(TrainConfig(**base, schedule="constant"))
    assert float(constant(5)) == pytest.approx(0.5) and float(constant(99)) == 1.0


@pytest.mark.parametrize("model", [MODEL, MOE_MODEL], ids=["dense", "moe"])
def test_non_finite_step_is_skipped_and_counted(model):
    state, step = _step_fn(TRAIN, model)
    state, _ = step(state, _batch(2))
    before = jax.tree.map(np.asarray, state)
    final_norm = state.params["final_norm"]["scale"].at[0].set(jnp.nan)
    poisoned = state.replace(params={**state.params, "final_norm": {"scale": final_norm}})
    after, m = step(poisoned, _batch(3))
    assert not np.isfinite(float(m["loss"])) and int(m["nonfinite_in_row"]) == 1
    assert int(after.step) == int(before.step) + 1
    # untouched: no update, no moment change
    chex.assert_trees_all_equal(after.params["groups"], before.params["groups"])
    chex.assert_trees_all_equal(after.opt_state.inner_state, before.opt_state.inner_state)


def test_training_stops_after_too_many_non_finite_steps(run, tmp_path):
    exploding = dataclasses.replace(run, model=dataclasses.replace(MODEL, init_std=1e30),
                                    train=dataclasses.replace(TRAIN, max_nonfinite=2))
    with pytest.raises(TrainingError, match="non-finite for 2 steps in a row"):
        quiet(exploding, tmp_path)
    assert not any((tmp_path / run_dir.CHECKPOINTS).iterdir())  # nothing non-finite saved


def test_stop_and_resume_equals_training_straight_through(run, straight, tmp_path):
    first = quiet(run, tmp_path, stop_at=4)  # checkpoints at 3 (periodic) and 4 (stop)
    assert first.step == 4 and first.stopped_by == "stop_at"
    second = quiet(run, tmp_path)
    assert second.step == 6 and second.stopped_by is None
    _assert_same_run(tmp_path, straight)


def test_a_checkpoint_with_per_process_data_files_resumes_exactly(run, straight, tmp_path):
    """A checkpoint written before the data position was saved once (grain's files, one per
    process of a 3-process run) resumes where it stood."""
    quiet(run, tmp_path, stop_at=4)
    step = tmp_path / run_dir.CHECKPOINTS / "4"
    position = json.loads((step / "data_state" / "metadata").read_text())
    assert position == {"next_index": 4}
    shutil.rmtree(step / "data_state")
    (step / "data").mkdir()
    for i in range(3):
        (step / "data" / f"process_{i}-of-3.json").write_text(json.dumps(position))
    quiet(run, tmp_path)
    _assert_same_run(tmp_path, straight)


def test_a_bf16_first_moment_is_checkpointed_and_resumes_exactly(run, tmp_path):
    bf16 = dataclasses.replace(run, train=dataclasses.replace(TRAIN, mu_dtype="bfloat16"))
    quiet(bf16, tmp_path / "straight")
    quiet(bf16, tmp_path / "resumed", stop_at=4)
    quiet(bf16, tmp_path / "resumed")
    _assert_same_run(tmp_path / "resumed", tmp_path / "straight")


def test_sigterm_saves_a_checkpoint_and_the_run_resumes_exactly(run, straight, tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run.to_dict()))
    command = [sys.executable, str(REPO / "train.py"), "--config", str(tmp_path / "run.yaml"),
               "--workdir", str(tmp_path / "w"), "--no-progress"]
    process = subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "w" / run_dir.METRICS
    deadline = time.time() + 120
    while not (log.is_file() and log.read_text().count("\n") >= 1) and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "stopped by SIGTERM" in stderr
    stopped_at = run_dir.Checkpoints(tmp_path / "w", TRAIN).latest_step()
    logged = [r["step"] for r in metrics.read(log)]
    assert stopped_at == logged[-1] and stopped_at < 6
    quiet(run, tmp_path / "w")
    _assert_same_run(tmp_path / "w", straight)


CRASH_WHILE_SAVING = """
import os, sys
sys.path.insert(0, {repo!r})
import yaml
from llama_jax.training import trainer
from llama_jax.formats import workdir
from llama_jax.config import RunConfig

save = workdir.Checkpoints.save
def save_then_die(self, step, *args):
    save(self, step, *args)  # asynchronous: the write is in flight
    if step == 6:
        os._exit(17)
workdir.Checkpoints.save = save_then_die
run = RunConfig.from_tree(yaml.safe_load(open({config!r})), "run.yaml")
trainer.train(run, __import__("pathlib").Path({workdir!r}), progress=False)
"""


def test_a_crash_while_saving_keeps_the_previous_checkpoint(run, straight, tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run.to_dict()))
    script = CRASH_WHILE_SAVING.format(repo=str(REPO), config=str(tmp_path / "run.yaml"),
                                       workdir=str(tmp_path / "w"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 17, result.stderr
    checkpoints = run_dir.Checkpoints(tmp_path / "w", TRAIN)
    assert checkpoints.latest_step() in (3, 6)  # 6 only if the write won the race
    checkpoints.close()
    if (tmp_path / "w" / run_dir.CHECKPOINTS / "6").exists():
        pytest.skip("the step-6 write finished before the process died; nothing to check")
    outcome = quiet(run, tmp_path / "w")  # resumes from step 3
    assert outcome.step == 6
    _assert_same_run(tmp_path / "w", straight)


def test_metrics_and_tensorboard_files(straight):
    records = metrics.read(straight / run_dir.METRICS)
    assert all(np.isfinite(r["loss"]) for r in records)
    with_rates = [r["step"] for r in records if "tokens_per_s" in r]
    assert with_rates == [2, 4, 6]
    assert all(0 < r["mfu"] < 1 and r["lr"] > 0 for r in records if "mfu" in r)
    evaluated = {r["step"]: r for r in records if "val_loss" in r}
    assert sorted(evaluated) == [3, 6]
    assert evaluated[6]["val_ppl"] == pytest.approx(np.exp(evaluated[6]["val_loss"]))
    assert evaluated[6]["val_loss"] < np.log(MODEL.vocab_size)
    assert list((straight / run_dir.TENSORBOARD).glob("events.out.tfevents.*"))
    assert run_dir.run_config(straight) == RunConfig.from_tree(
        yaml.safe_load((straight / run_dir.CONFIG).read_text()), "x")
    assert (straight / "tokenizer.model").is_file()


def test_rerunning_a_finished_run_does_nothing(run, straight):
    before = sorted(p.name for p in (straight / run_dir.CHECKPOINTS).iterdir())
    assert quiet(run, straight).step == 6
    assert sorted(p.name for p in (straight / run_dir.CHECKPOINTS).iterdir()) == before


@pytest.mark.parametrize("change, error, match", [
    (dict(train=dict(seq_len=128)), ConfigError, r"train.seq_len=128 exceeds .*max_seq_len=64"),
    (dict(train=dict(batch_size=4)), ConfigError, r"do not split across the 8 batch shards"),
    (dict(train=dict(micro_batches=2, batch_size=8)), ConfigError, "4 sequences per micro"),
    (dict(data=dict(corpus="/nonexistent/corpus")), DataError, "no such directory"),
    (dict(model=dict(vocab_size=256)), DataError, "training the tokenizer .* failed: .*"
                                                  "Vocabulary size is smaller"),
    (dict(model=dict(attention_impl="cudnn")), ConfigError,
     "attention_impl='cudnn' needs an NVIDIA GPU; the backend is 'cpu'"),
])
def test_bad_input_fails_before_compiling(run, tmp_path, monkeypatch, change, error, match):
    monkeypatch.setattr(trainer, "compile_programs", lambda *a: pytest.fail("compiled"))
    sections = {name: dataclasses.replace(getattr(run, name), **fields)
                for name, fields in change.items()}
    with pytest.raises(error, match=match):
        quiet(dataclasses.replace(run, **sections), tmp_path)


def test_a_given_tokenizer_must_fit_the_model(run, straight, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "compile_programs", lambda *a: pytest.fail("compiled"))
    small = dataclasses.replace(
        run, model=dataclasses.replace(MODEL, vocab_size=300),
        data=dataclasses.replace(run.data, tokenizer=str(straight / "tokenizer.model")))
    with pytest.raises(DataError, match="has 512 tokens, more than model.vocab_size=300"):
        quiet(small, tmp_path)


def test_a_workdir_of_another_run_is_refused_and_kept(run, straight, monkeypatch):
    monkeypatch.setattr(trainer, "compile_programs", lambda *a: pytest.fail("compiled"))
    files = {p: p.stat().st_mtime_ns for p in straight.rglob("*") if p.is_file()}
    other = dataclasses.replace(run, train=dataclasses.replace(TRAIN, learning_rate=1e-3))
    with pytest.raises(ConfigError, match=r"different config \(train.learning_rate: 0.003 -> "
                                          r"0.001\)"):
        quiet(other, straight)
    assert {p: p.stat().st_mtime_ns for p in straight.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("stored, error", [
    ("model: [1\n", "cannot read run config: while parsing"),
    ("- 1\n", "expected a mapping at the top level, got list")])
def test_a_workdir_whose_run_config_is_unreadable_is_refused(run, tmp_path, stored, error):
    """Checkpoints beside a config.yaml that does not read as a run config: refused, naming
    the file, before anything in the workdir changes."""
    (tmp_path / run_dir.CHECKPOINTS / "5").mkdir(parents=True)
    (tmp_path / run_dir.CONFIG).write_text(stored)
    with pytest.raises(ConfigError, match=f"holds an unreadable run config: "
                                          f"{tmp_path / run_dir.CONFIG}: {error}"):
        run_dir.claim(tmp_path, run)
    assert (tmp_path / run_dir.CONFIG).read_text() == stored


def test_empty_and_unreadable_corpora(run, straight, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (empty / name).write_text("  \n")
    with pytest.raises(DataError, match="empty: the training documents are empty"):
        quiet(dataclasses.replace(run, data=DataConfig(corpus=str(empty))), tmp_path / "w1")
    broken = tmp_path / "broken"
    shutil.copytree(run.data.corpus, broken)
    (broken / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    given = DataConfig(corpus=str(broken), tokenizer=str(straight / "tokenizer.model"))
    with pytest.raises(DataError, match=r"latin1.txt: line 1: not UTF-8"):
        quiet(dataclasses.replace(run, data=given), tmp_path / "w2")


def test_cli_reports_bad_input_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", "tiny", "--workdir",
         str(tmp_path / "w"), "--set", "train.learnig_rate=1"],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {REPO / 'configs' / 'tiny.yaml'}: train: unknown key 'learnig_rate' "
        "(did you mean 'learning_rate'?); known keys: " + ", ".join(
            f.name for f in dataclasses.fields(TrainConfig))]


def test_loss_on_packed_documents_with_z_loss_matches_an_independent_cross_entropy():
    """The training loss (packed documents, a scored-target mask, z-loss) against a float64
    cross-entropy computed from the model's plain logits, document by document."""
    from llama_jax.training.step import loss_sums
    import reference as ref

    params = llama_jax_init(MODEL)
    window = np.asarray(_batch(4, batch=2, length=33))
    total, (sums, _) = jax.jit(loss_sums, static_argnums=(0, 3, 4))(
        MODEL, params, window, 1, 1e-2)
    ce_sum, count = sums["loss_sum"], sums["count"]
    want_ce, want_z, n = 0.0, 0.0, 0
    for row in window:
        starts = [i for i, t in enumerate(row[:-1]) if t == 1] + [len(row) - 1]
        for begin, end in zip(starts, starts[1:]):  # each document alone, from its BOS
            doc = row[begin:end + 1]
            logits = ref.forward(MODEL, params, doc[None, :-1])[0]
            log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            for t, target in enumerate(doc[1:]):
                if target == 1:  # the next document's BOS is not a target
                    continue
                want_ce += log_z[t] - logits[t, target]
                want_z += log_z[t] ** 2
                n += 1
    assert int(count) == n
    assert float(ce_sum) == pytest.approx(want_ce, rel=1e-5)
    assert float(total) == pytest.approx(want_ce + 1e-2 * want_z, rel=1e-5)


def llama_jax_init(model):
    from llama_jax import init_params
    return init_params(model, jax.random.key(5))


def test_a_workdir_from_the_flat_layout_loads_and_refuses_to_resume(run, straight, tmp_path):
    """Checkpoints written before the component tree (a flat `layers` tree of LLaMA tensors):
    load_checkpoint migrates them; resuming training is refused with one clear message."""
    import orbax.checkpoint as ocp
    from llama_jax.formats.legacy import legacy_target

    old = tmp_path / "old"
    shutil.copytree(straight, old)
    params = _final_params(straight)
    legacy = jax.tree.map(np.asarray, legacy_target(params))
    params_dir = (old / run_dir.CHECKPOINTS / "6" / "params").absolute()
    shutil.rmtree(params_dir)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(params_dir, legacy)
    checkpointer.wait_until_finished()
    _, loaded = load_checkpoint(old)
    chex.assert_trees_all_equal(loaded, params)
    longer = dataclasses.replace(run, train=dataclasses.replace(TRAIN, steps=8))
    with pytest.raises(TrainingError, match=r"written by llama_jax 0\.1 .* its weights "
                                                    r"load .*`python -m llama_jax\.formats\.convert"):
        quiet(longer, old)


def test_the_transformer_recipe_trains_with_train_py(corpus_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", "transformer", "--workdir",
         str(tmp_path / "w"), "--corpus", str(corpus_dir), "--steps", "4", "--no-progress",
         "--set", "model.vocab_size=512", "--set", "model.dim=32", "--set", "model.n_layers=2",
         "--set", "model.ffn_dim=64", "--set", "train.batch_size=8", "--set",
         "train.seq_len=32", "--set", "train.eval_every=4", "--set", "train.eval_batches=1",
         "--set", "train.warmup_steps=1"],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    config, params = load_checkpoint(tmp_path / "w")
    assert (config.norm_position, config.positions, config.mlp) == ("post", "sinusoidal", "relu")
    assert "final_norm" not in params and "b_up" in params["groups"][0]["mlp"]
    losses = [r["loss"] for r in metrics.read(tmp_path / "w" / run_dir.METRICS)]
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_an_moe_run_logs_its_router_metrics_and_resumes_exactly(corpus_dir, tmp_path):
    """DeepSeek-style routing (sigmoid, the selection bias updated after every step, a shared
    expert, a dense first layer) with capacity drops: metrics.jsonl carries the MoE statistics
    of the training batches and of validation, and stopping and resuming equals training
    straight through bit for bit (the bias is part of the checkpointed parameters)."""
    model = dataclasses.replace(MODEL, n_layers=3, mlp="moe", ffn_dim=32, moe=MoeConfig(
        n_experts=4, top_k=2, router="sigmoid", n_shared_experts=1, first_dense_layers=1,
        capacity_factor=1.0, router_z_loss_weight=1e-3, bias_update_rate=0.01))
    run = RunConfig(model=model, train=dataclasses.replace(TRAIN, steps=4, eval_every=2,
                                                           checkpoint_every=2),
                    data=DataConfig(corpus=str(corpus_dir)))
    quiet(run, tmp_path / "straight")
    quiet(run, tmp_path / "resumed", stop_at=2)
    quiet(run, tmp_path / "resumed")
    _assert_same_run(tmp_path / "resumed", tmp_path / "straight", steps=4)
    records = {r["step"]: r for r in metrics.read(tmp_path / "straight" / run_dir.METRICS)}
    for step in (2, 4):
        r = records[step]
        for prefix in ("", "val_"):
            share = (r[prefix + "moe_min_load_share"], r[prefix + "moe_max_load_share"])
            assert 0 <= share[0] <= 0.25 <= share[1] <= 1  # 1/E when balanced
            assert 0 < r[prefix + "moe_dropped_fraction"] < 0.5
            assert 0 < r[prefix + "moe_router_entropy"] <= np.log(4) + 1e-6
            assert r[prefix + "moe_load_balancing_loss"] > 0
    bias = load_checkpoint(tmp_path / "straight")[1]["groups"][1]["mlp"]["selection_bias"]
    assert np.abs(np.asarray(bias)).max() > 0  # moved by the rule (its gradient is zero)


def test_a_mixture_logs_each_source_and_resumes_exactly(run, corpus_dir, tmp_path):
    """Two sources (the corpus, raw; a prepared dataset of its sub/ directory, 1:3): the
    validation metrics per source and overall, and stop + resume == straight through."""
    from llama_jax.data.prepare import prepare

    quiet(run, tmp_path / "first", stop_at=1)  # a tokenizer of the corpus
    tokenizer = shutil.copy(tmp_path / "first" / "tokenizer.model", tmp_path / "tok.model")
    prepared = tmp_path / "sub-prepared"
    prepare([str(corpus_dir / "sub")], tokenizer, prepared, val_fraction=0.3,
            log=lambda _: None, progress=False)
    sources = [{"path": str(corpus_dir), "weight": 1, "name": "all"},
               {"path": str(prepared), "weight": 3, "name": "sub"}]
    mixed = dataclasses.replace(run, data=DataConfig(sources=sources, tokenizer=str(tokenizer)))
    straight_dir = tmp_path / "straight"
    quiet(mixed, straight_dir)
    records = metrics.read(straight_dir / run_dir.METRICS)
    evaluated = [r for r in records if "val_loss" in r]
    assert evaluated and all({"val_loss_all", "val_loss_sub", "val_ppl_sub"} <= r.keys()
                             for r in evaluated)
    for r in evaluated:  # the overall loss lies between the sources'
        low, high = sorted((r["val_loss_all"], r["val_loss_sub"]))
        assert low <= r["val_loss"] <= high
    quiet(mixed, tmp_path / "resumed", stop_at=4)
    quiet(mixed, tmp_path / "resumed")
    _assert_same_run(tmp_path / "resumed", straight_dir)
