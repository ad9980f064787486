"""LoRA fine-tuning runs (a `lora:` section, training/step.py, nn/lora.py): the adapters learn a
chat task while the base stays frozen (no gradient, no optimizer state, not checkpointed);
resume is exact; the run loads as its merged model; a sharded step equals the single-device
step; an int8 base trains (QLoRA); bad sections are refused before anything is written."""

import dataclasses
import hashlib
import math
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import llama_jax
from llama_jax.data import chat_rows, conversations
from llama_jax.errors import ConfigError
from llama_jax.formats import workdir as run_dir
from llama_jax.model.transformer import forward
from llama_jax.nn.lora import with_adapters
from llama_jax.parallel import sharding
from llama_jax.plan import costs
from llama_jax.training import finetune, trainer

from chats import chats
from checkpoints import ROOT, tiny_checkpoint_with_tokenizer
from models import one_step_each_way

TARGETS = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]


def tree_for(root, base, **sections) -> dict:
    tree = {"init_from": str(base),
            "lora": {"rank": 8, "alpha": 32, "dropout": 0.05, "targets": TARGETS},
            "task": {"kind": "chat", "train": str(root / "train.jsonl"),
                     "val": str(root / "val.jsonl")},
            "train": {"seq_len": 128, "batch_size": 8, "micro_batches": 2, "steps": 40,
                      "learning_rate": 3e-3, "warmup_steps": 5, "log_every": 10,
                      "eval_every": 40, "checkpoint_every": 40},
            "mesh": {"data": 4, "tensor": 2}}  # the test's 8 devices; micro-batches of 4
    for name, fields in sections.items():
        tree[name] = fields if fields is None else {**tree.get(name, {}), **fields}
    return tree


def run_config(root, base, name="lora", **sections) -> llama_jax.RunConfig:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree_for(root, base, **sections)))
    return finetune.load_run_config(path)


def digest(directory) -> str:
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """40 steps of LoRA (every target, dropout, two micro-batches) from a tiny checkpoint (its
    outcome holds the untrained model's validation metrics too: fresh adapters, before step 1)."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_checkpoint_with_tokenizer(root / "base")
    chats(root / "train.jsonl", 96, 0)
    chats(root / "val.jsonl", 16, 1)
    before = digest(base)
    run = run_config(root, base)
    outcome = trainer.train(run, root / "run", log=lambda _: None, progress=False)
    return dict(root=root, base=base, run=run, outcome=outcome, base_digest=before)


def learned(outcome: trainer.Outcome) -> float:
    """How far a fine-tuning run's validation loss fell below its untrained model's."""
    return outcome.val_metrics_before["val_loss"] - outcome.val_loss


def test_a_lora_run_learns_while_its_base_stays_frozen(lora_run):
    """The adapters learn the task (validation loss on the assistant's tokens well below the
    untrained model's); the checkpoints hold the adapters alone, the optimizer keeps moments
    for them alone, and the base checkpoint is bit for bit what it was."""
    run, root = lora_run["run"], lora_run["root"]
    outcome = lora_run["outcome"]
    assert learned(outcome) > 0.4, (outcome.val_metrics_before, outcome.val_loss)
    _, _, stored = run_dir.latest_checkpoint(root / "run")
    _, base = llama_jax.load_checkpoint(lora_run["base"])
    paths = {f"{g}/{block}/{name}" for g, _ in enumerate(base["groups"])
             for block in ("attn", "mlp") for name in TARGETS if name in base["groups"][g][block]}
    assert set(stored) == paths and all(set(ab) == {"a", "b"} for ab in stored.values())
    adapter_elements = sum(math.prod(m.shape) for m in jax.tree.leaves(stored))
    mesh = sharding.make_mesh(run.mesh, jax.devices())
    moments = jax.tree.leaves(trainer.initializer(run, mesh).abstract.opt_state)
    assert sum(math.prod(m.shape) for m in moments) <= 2 * adapter_elements + 16
    assert adapter_elements < 0.2 * sum(w.size for w in jax.tree.leaves(base))
    assert digest(lora_run["base"]) == lora_run["base_digest"]


def test_a_lora_run_loads_as_its_merged_model(lora_run):
    """load_checkpoint(RUN) is the base with the latest adapters folded in: its logits are the
    model's with the adapters beside the frozen weights, and not the base's."""
    root, run = lora_run["root"], lora_run["run"]
    config, merged = llama_jax.load_checkpoint(root / "run")
    base_config, base = llama_jax.load_checkpoint(lora_run["base"])
    assert config == base_config == llama_jax.checkpoint_config(root / "run")
    adapters = run_dir.load_adapters(root / "run")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 24)))
    got = np.asarray(forward(config, merged, tokens), np.float64)
    want = np.asarray(forward(base_config, with_adapters(base, adapters, run.lora.scale),
                              tokens), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - np.asarray(forward(base_config, base, tokens))).max() > 1e-2


def test_a_lora_run_resumes_exactly(lora_run):
    """Stopped at step 20 and resumed (dropout masks and data order included): the adapters
    of the run that went on, bit for bit."""
    root, run = lora_run["root"], lora_run["run"]
    first = trainer.train(run, root / "resumed", stop_at=20, log=lambda _: None,
                          progress=False)
    assert first.stopped_by == "stop_at"
    trainer.train(run, root / "resumed", log=lambda _: None, progress=False)
    chex.assert_trees_all_equal(run_dir.load_adapters(root / "resumed"),
                                run_dir.load_adapters(root / "run"))


def test_the_lora_step_computes_no_weight_gradient_for_the_base(lora_run):
    """XLA's FLOP count of the compiled LoRA step against the full fine-tuning step is what
    `costs.train_flops_per_token` says: the base's backward pass computes input gradients
    only (4·P against 6·P)."""
    # short rows and small adapters: the base's matmuls dominate, as in a real model
    run = dataclasses.replace(
        lora_run["run"], mesh=llama_jax.MeshConfig(data=1),
        lora=llama_jax.LoraConfig(rank=1, targets=("wq", "wv")),
        train=dataclasses.replace(lora_run["run"].train, micro_batches=1, seq_len=64))
    full = dataclasses.replace(run, lora=None)
    mesh = sharding.make_mesh(run.mesh, jax.devices()[:1])
    flops = {name: trainer.compile_programs(r, 1, mesh, evaluate=False).step.cost_analysis()[
        "flops"] for name, r in (("lora", run), ("full", full))}
    formula = {name: costs.train_flops_per_step(r) for name, r in (("lora", run),
                                                                    ("full", full))}
    assert flops["lora"] / flops["full"] == pytest.approx(formula["lora"] / formula["full"],
                                                          abs=0.05)
    assert flops["lora"] / flops["full"] < 0.78


def test_a_sharded_lora_step_equals_the_single_device_step(lora_run):
    """The adapters placed as their weights (A along W's inputs, B along its outputs) over
    data x fsdp x tensor = 8 devices: the same step as on one device."""
    run, T = lora_run["run"], lora_run["run"].train.seq_len
    tokenizer = llama_jax.load_tokenizer(lora_run["base"])
    rows = chat_rows.pack(conversations.read_conversations(
        run.task.train, conversations.chat_template_for([]), tokenizer, T, truncate=False),
        T, True, tokenizer.eos_ids[0])
    rows = {name: v[:run.train.batch_size] for name, v in rows.items()}
    mesh_config = llama_jax.MeshConfig(data=2, fsdp=2, tensor=2)
    placed = trainer.initializer(dataclasses.replace(run, mesh=mesh_config),
                                 sharding.make_mesh(mesh_config)).params_sharding
    wq_a, wo_b = placed["0/attn/wq"]["a"].spec, placed["0/attn/wo"]["b"].spec  # [L,D,r], [L,r,D]
    assert (wq_a[1], wq_a[2], wo_b[2]) == ("fsdp", None, "fsdp"), (wq_a, wo_b)
    results = one_step_each_way(run, rows, lambda placed, mesh: (
        finetune.load_base(placed, mesh),))
    (single, loss1), (multi, loss8) = results
    assert loss8 == pytest.approx(loss1, rel=1e-5)
    chex.assert_trees_all_close(multi, single, rtol=1e-4, atol=1e-6)


def test_a_qlora_run_trains_adapters_on_an_int8_base(lora_run, tmp_path):
    """`model.quantize: int8`: the base is quantized as it loads and stays int8; the adapters
    learn on it, and the run loads as the int8 base (dequantized) plus the adapters."""
    root = lora_run["root"]
    run = run_config(root, lora_run["base"], "qlora", model={"quantize": "int8"},
                     train={"steps": 20, "eval_every": 20, "checkpoint_every": 20})
    outcome = trainer.train(run, tmp_path / "run", log=lambda _: None, progress=False)
    assert learned(outcome) > 0.2, (outcome.val_metrics_before, outcome.val_loss)
    config, merged = llama_jax.load_checkpoint(tmp_path / "run")
    assert config.quantize is None
    int8_config, int8_base = llama_jax.load_checkpoint(lora_run["base"], quantize="int8")
    adapters = run_dir.load_adapters(tmp_path / "run")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 24)))
    np.testing.assert_allclose(
        np.asarray(forward(config, merged, tokens)),
        np.asarray(forward(int8_config, with_adapters(int8_base, adapters, run.lora.scale),
                           tokens)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sections, message", [
    ({"lora": {"targets": ["wq", "w1"]}},
     r"lora.targets: 'w1' is not a weight of the model's layers \(they have"),
    ({"lora": {"targets": ["scale"]}}, r"lora.targets: 'scale' is not a matmul weight"),
    ({"lora": {"rank": 0}}, r"lora.rank=0 must be a positive integer"),
    ({"lora": {"dropout": 1.0}}, r"lora.dropout=1.0"),
    ({"train": {"freeze": "backbone"}}, r"train.freeze='backbone' must be none with lora"),
    ({"task": {"kind": "sequence_classification", "labels": 2}},
     r"lora=.* adapts a language model"),
])
def test_bad_lora_sections_are_refused_before_anything_is_written(lora_run, tmp_path,
                                                                 sections, message):
    with pytest.raises(ConfigError, match=message):
        run = run_config(tmp_path, lora_run["base"], **sections)
        trainer.train(run, tmp_path / "run", log=lambda _: None, progress=False)
    assert not (tmp_path / "run").exists()


def test_train_py_names_a_bad_lora_target_in_one_line(lora_run, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tree_for(lora_run["root"], lora_run["base"],
                                            lora={"targets": ["w1"]})))
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(path),
                           "--workdir", str(tmp_path / "run"), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: ") and \
        "lora.targets: 'w1'" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_the_shipped_chat_tune_config_loads(lora_run):
    """configs/tasks/chat-tune.yaml (make chat-tune) with init_from pointed at a test
    checkpoint: a LoRA chat run on every target."""
    run = finetune.load_run_config(ROOT / "configs" / "tasks" / "chat-tune.yaml",
                                   [f"init_from={lora_run['base']}"])
    assert run.task.kind == "chat" and run.lora.targets == tuple(TARGETS)
    mesh = sharding.make_mesh(run.mesh, jax.devices())
    trainer.check_run(run, mesh)


def test_the_planner_and_xla_count_a_lora_runs_state_alike(lora_run):
    """`train.py --compile-only` of a LoRA run: the frozen base and the adapters are its
    parameters, the adapters' moments its optimizer state, in the planner as in XLA's
    compiled step (each device's share on a data x tensor mesh)."""
    from llama_jax.aot.training import compile_training

    report = compile_training(lora_run["run"], evaluate=False)
    assert report.parameters == report.plan.weights
    assert report.optimizer == pytest.approx(report.plan.optimizer, rel=0.01)
    # fp32 gradients of the adapters alone, and their two fp32 moments
    assert 2 * report.plan.gradients == report.plan.optimizer < report.plan.weights / 3
