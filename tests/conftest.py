"""Test setup: 8 simulated CPU devices (must be set before jax is imported anywhere)."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
