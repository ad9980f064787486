"""Test setup, before jax is imported anywhere: 8 simulated CPU devices, and XLA:CPU set to
compile fast. The tests' programs are tiny, so compiling them is most of the suite's time: the
LLVM backend runs at optimisation level 0, and XLA's older loop emitters replace its fusion
emitters (that alone took the suite from 14 minutes to 7 on two cores). They compute the same functions (every
comparison has a tolerance, or compares two runs of one program); test_default_codegen.py
reruns a sample of the reference checks under the codegen users get, and benchmarks and real
runs keep XLA's default. Flags go into the environment, so the processes tests start
(train.py, sample.py, multi-host workers) inherit them; a flag already in XLA_FLAGS is kept
as it is, and a speed flag this XLA does not know is left out."""

import os
import subprocess
import sys

from llama_jax.xla_flags import named_flags

DEVICES = ("xla_force_host_platform_device_count", "8")
FAST_COMPILE = (("xla_backend_optimization_level", "0"), ("xla_cpu_use_fusion_emitters", "false"))


def with_flags(xla_flags: str, flags) -> str:
    named = named_flags(xla_flags)
    return " ".join([xla_flags, *(f"--{f}={v}" for f, v in flags if f not in named)]).strip()


def xla_knows(xla_flags: str) -> bool:
    """Whether XLA starts with these flags (it aborts on one it does not know)."""
    start = "import jax; jax.numpy.zeros(1).block_until_ready()"
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", start], env=env, capture_output=True,
                          timeout=120).returncode == 0


if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # Not set yet in this process tree (pytest-xdist's workers and the processes tests start
    # inherit the controller's environment, so only the first process probes).
    flags = with_flags(os.environ.get("XLA_FLAGS", ""), [DEVICES, *FAST_COMPILE])
    os.environ["XLA_FLAGS"] = (flags if xla_knows(flags)
                               else with_flags(os.environ.get("XLA_FLAGS", ""), [DEVICES]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Nothing comes from the Hugging Face Hub (lm-eval's datasets, transformers' files): the
# suite runs offline, and subprocesses inherit this.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from pathlib import Path

# The entry points (train.py, sample.py) live at the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from corpus import make_corpus  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    """Token caches of this test session go to a temporary directory."""
    os.environ["LLAMA_JAX_CACHE"] = str(tmp_path_factory.mktemp("llama_jax_cache"))


@pytest.fixture(scope="module", autouse=True)
def fresh_compilation_caches():
    """Each test module leaves its compiled programs behind: XLA:CPU maps memory for every
    executable, and the whole suite's in one process would pass vm.max_map_count (65530
    mappings) and segfault while compiling."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))
