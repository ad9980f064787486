"""Processes on localhost (gloo collectives) joined by jax.distributed train one 8-device run
with train.py, checkpoint, resume with another process count, and match a single-process run."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import chex
import jax
import pytest
import yaml

from llama_jax.training import metrics
from llama_jax.formats import workdir as run_dir
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.config import DataConfig, MeshConfig, ModelConfig, RunConfig, TrainConfig
from reference import relative_error

REPO = Path(__file__).resolve().parent.parent
RUN = dict(model=ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             multiple_of=32, max_seq_len=64),
           train=TrainConfig(seq_len=32, batch_size=8, steps=4, learning_rate=3e-3,
                             warmup_steps=1, log_every=2, eval_every=2, eval_batches=1,
                             checkpoint_every=2),
           mesh=MeshConfig(data=2, fsdp=4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _train(config: Path, workdir: Path, steps: int, processes: int) -> None:
    # The conftest's XLA flags (fast compiles) stay; only the device count is per process.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS":
           f"{flags} --xla_force_host_platform_device_count={8 // processes}".strip()}
    command = [sys.executable, str(REPO / "train.py"), "--config", str(config), "--workdir",
               str(workdir), "--steps", str(steps), "--no-progress"]
    if processes > 1:
        port = _free_port()
        command += ["--coordinator", f"localhost:{port}", "--num-processes", str(processes)]
    runs = [subprocess.Popen(command + (["--process-id", str(i)] if processes > 1 else []),
                             env=env, stderr=subprocess.PIPE, text=True)
            for i in range(processes)]
    errors = [run.communicate(timeout=300)[1] for run in runs]
    for run, stderr in zip(runs, errors):
        assert run.returncode == 0, stderr
    assert "step compiled" in errors[0]
    for stderr in errors[1:]:  # only process 0 logs (XLA's own C++ warnings aside)
        assert not any(word in stderr for word in ("corpus", "step compiled", "validation")), \
            stderr


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU multi-process test")
def test_two_processes_train_checkpoint_and_resume_like_one_with_any_count(corpus_dir, tmp_path):
    """Two processes checkpoint at step 2; the run resumed by four processes (the data position
    is one for all) ends in the uninterrupted run's (one process's) checkpoint and logs its
    losses, the two processes' first steps included. It reads a mixture of two raw corpora,
    which each process prepares into the same cache at once."""
    sources = [{"path": str(corpus_dir), "weight": 2}, {"path": str(corpus_dir / "sub"),
                                                          "weight": 1}]
    run = RunConfig(**RUN, data=DataConfig(sources=sources))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run.to_dict()))
    _train(config, tmp_path / "resumed", steps=2, processes=2)  # checkpoint at 2 ...
    assert run_dir.Checkpoints(tmp_path / "resumed", run.train).latest_step() == 2
    assert (tmp_path / "resumed" / "checkpoints" / "2" / "data_state").is_dir()
    _train(config, tmp_path / "resumed", steps=4, processes=4)  # ... restored by four
    _train(config, tmp_path / "one", steps=4, processes=1)
    (_, four), (_, one) = load_checkpoint(tmp_path / "resumed"), load_checkpoint(tmp_path / "one")
    chex.assert_trees_all_equal_structs(four, one)
    for a, b in zip(jax.tree.leaves(four), jax.tree.leaves(one)):
        assert relative_error(a, b) < 1e-5
    logged, reference = (metrics.read(tmp_path / name / run_dir.METRICS)
                         for name in ("resumed", "one"))
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for a, b in zip(logged, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
