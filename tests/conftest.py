"""Test setup, before jax is imported anywhere: the CPU backend with 8 simulated devices, and
XLA:CPU set to compile fast. The tests' programs are tiny, so compiling them is most of the
suite's time: the LLVM backend runs at optimisation level 0, and XLA's older loop emitters
replace its fusion emitters (that alone took the suite from 14 minutes to 7 on two cores).
They compute the same functions (every comparison has a tolerance, or compares two runs of
one program); test_default_codegen.py reruns a sample of the reference checks under the
codegen users get, and benchmarks and real runs keep XLA's defaults. Flags go into the
environment, so the processes tests start (train.py, sample.py, multi-host workers) inherit
them. A flag already in XLA_FLAGS keeps its value, and a speed flag this XLA does not know is
left out (the first process of a test session starts XLA with each one to find out)."""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before llama_jax: it sets GPU flags on CUDA

from llama_jax.xla_flags import with_flags  # noqa: E402

DEVICES = {"xla_force_host_platform_device_count": "8"}
FAST_COMPILE = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
PROBED = "LLAMA_JAX_TEST_FLAGS_PROBED"  # set once the first process has probed


def xla_knows(xla_flags: str) -> bool:
    """Whether XLA starts with these flags (it aborts on one it does not know)."""
    start = "import jax; jax.numpy.zeros(1).block_until_ready()"
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", start], env=env, capture_output=True,
                              timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), DEVICES)
if PROBED not in os.environ:  # pytest-xdist's workers inherit the controller's environment
    os.environ["XLA_FLAGS"] = with_flags(os.environ["XLA_FLAGS"], {
        flag: value for flag, value in FAST_COMPILE.items()
        if xla_knows(with_flags(os.environ["XLA_FLAGS"], {flag: value}))})
    os.environ[PROBED] = "1"
# Nothing comes from the Hugging Face Hub (lm-eval's datasets, transformers' files): the
# suite runs offline, and subprocesses inherit this.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

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
