"""The XLA flags the library sets on GPU: added only when JAX will run on CUDA, never over a flag
the user set, all off with LLAMA_JAX_GPU_FLAGS=0, and known to the installed XLA."""

import importlib.util
import os
import subprocess
import sys

import pytest

from llama_jax import xla_flags
from llama_jax.errors import ConfigError

ADDED = " ".join(f"--{name}={value}" for name, value in xla_flags.GPU_FLAGS.items())


def pretend_cuda(monkeypatch, installed: bool):
    """Makes the CUDA plugins look installed, or not, to `runs_on_cuda`."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (object() if installed else None) if name in xla_flags.CUDA_PLUGINS else real(name, *a)))


@pytest.fixture
def cuda_installed(monkeypatch):
    pretend_cuda(monkeypatch, True)


def test_flags_are_added_after_the_users_and_never_over_one_they_named():
    assert xla_flags.with_gpu_flags("") == ADDED
    mine = "--xla_force_host_platform_device_count=8  --xla_dump_to=/tmp/d"
    assert xla_flags.with_gpu_flags(mine) == f"{mine.strip()} {ADDED}"
    for name in xla_flags.GPU_FLAGS:
        for theirs in (f"--{name}=false", f"--{name}=", f"--{name}"):
            out = xla_flags.with_gpu_flags(f"--xla_dump_to=/tmp/d {theirs}")
            assert out.split().count(theirs) == 1
            assert xla_flags.named_flags(out) == {"xla_dump_to", *xla_flags.GPU_FLAGS}
            assert sum(w.startswith(f"--{name}") for w in out.split()) == 1
            assert xla_flags.without_gpu_flags(out) == f"--xla_dump_to=/tmp/d {theirs}"
    assert xla_flags.without_gpu_flags(xla_flags.with_gpu_flags(mine)) == " ".join(mine.split())


@pytest.mark.parametrize("platforms, expected", [
    (None, True), ("cuda", True), ("gpu", True), ("cuda,cpu", True), (" CUDA ", True),
    ("cpu", False), ("tpu", False), ("rocm", False)])
def test_with_a_cuda_plugin_the_flags_follow_jax_platforms(cuda_installed, platforms, expected):
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"} | (
        {} if platforms is None else {"JAX_PLATFORMS": platforms})
    xla_flags.set_gpu_flags(environ)
    assert environ["XLA_FLAGS"] == ("--xla_dump_to=/tmp/d" + f" {ADDED}" * expected)


def test_without_a_cuda_plugin_the_environment_is_untouched(monkeypatch):
    pretend_cuda(monkeypatch, False)
    for environ in ({}, {"JAX_PLATFORMS": "cuda"}, {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}):
        before = dict(environ)
        xla_flags.set_gpu_flags(environ)
        assert environ == before


def test_the_switch_turns_them_off_and_refuses_other_values(cuda_installed):
    environ = {xla_flags.SWITCH: "0"}
    xla_flags.set_gpu_flags(environ)
    assert environ == {xla_flags.SWITCH: "0"}
    with pytest.raises(ConfigError, match=f"{xla_flags.SWITCH}='off' must be 0"):
        xla_flags.set_gpu_flags({xla_flags.SWITCH: "off"})


def child(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-c", code], env=environ | env, capture_output=True,
                          text=True, timeout=300)


def test_a_bad_switch_stops_the_import_with_one_line():
    """Every CLI imports the library first: the error is one line, not a traceback."""
    env = {**os.environ, xla_flags.SWITCH: "yes"}
    done = subprocess.run([sys.executable, "-c", "import llama_jax"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr == (f"error: environment variable {xla_flags.SWITCH}='yes' must be 0 "
                           "(leave XLA_FLAGS as it is) or 1 (add the library's GPU flags)\n")


def test_import_llama_jax_sets_them_on_cuda_and_the_installed_xla_knows_them(tmp_path):
    """End to end: a process that sees a CUDA plugin gets the flags from `import llama_jax`,
    after the user's own (and none with JAX_PLATFORMS=cpu), and an XLA started with them runs
    (XLA aborts on a flag or value it does not know, as the control with a misspelt flag
    shows)."""
    (tmp_path / "jax_cuda13_plugin").mkdir()  # found by find_spec; jax itself is not started
    (tmp_path / "jax_cuda13_plugin" / "__init__.py").write_text("")
    mine = "--xla_gpu_enable_command_buffer= --xla_force_host_platform_device_count=2"
    shown_path = os.pathsep.join([str(tmp_path), *sys.path])
    shown = child("import os, llama_jax; print(os.environ['XLA_FLAGS'])", XLA_FLAGS=mine,
                  PYTHONPATH=shown_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == [*mine.split(),
                                    "--xla_gpu_enable_latency_hiding_scheduler=true"]
    on_cpu = child("import os, llama_jax; print(os.environ.get('XLA_FLAGS'))",
                   PYTHONPATH=shown_path, JAX_PLATFORMS="cpu")
    assert on_cpu.stdout.strip() == "None", on_cpu.stderr

    run = "import jax, jax.numpy as jnp; print(int(jax.jit(jnp.sum)(jnp.arange(4))))"
    for flags, ok in ((ADDED, True), (ADDED.replace("hiding", "hidding"), False)):
        ran = child(run, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        assert (ran.returncode == 0 and ran.stdout.strip() == "6") == ok, ran.stderr[-2000:]
