"""Test setup, before jax is imported anywhere: 8 simulated CPU devices, and XLA's LLVM backend
at optimisation level 0. The tests' programs are tiny, so compiling them is most of the suite's
time, and unoptimised machine code compiles in about 60% of it; it computes the same functions
(every comparison has a tolerance, or compares two runs of one program). Benchmarks and real
runs keep XLA's default. Both are set in the environment, so the processes tests start
(train.py, sample.py, multi-host workers) inherit them."""

import os

for flag, setting in (("xla_force_host_platform_device_count", "=8"),
                      ("xla_backend_optimization_level", "=0")):
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{flag}{setting}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Nothing comes from the Hugging Face Hub (lm-eval's datasets, transformers' files): the
# suite runs offline, and subprocesses inherit this.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import sys
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
