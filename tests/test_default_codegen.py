"""The suite compiles with XLA:CPU's fast-compile settings (conftest.py); programs users run
compile with XLA's defaults. Here a sample of the reference checks (the forward pass against
float64, cached decode against the full forward, blockwise attention's and the chunked loss's
gradients against the dense ones) reruns in a process with the defaults."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import DEVICES
from llama_jax.xla_flags import with_flags

TESTS = Path(__file__).parent
CHECKS = [
    "test_model.py::test_matches_float64_reference[gqa]",
    "test_generate.py::test_prefill_then_decode_equals_full_forward[gqa]",
    "test_attention.py::test_chunked_equals_xla_forward_and_gradients[GQA-packed]",
    "test_cross_entropy.py::test_the_chunked_loss_has_the_dense_loss_and_gradients[12-True]",
]


def test_reference_checks_pass_under_xla_default_codegen():
    # conftest keeps the values named here: XLA's defaults
    defaults = {"xla_backend_optimization_level": "3", "xla_cpu_use_fusion_emitters": "true"}
    env = dict(os.environ, XLA_FLAGS=with_flags("", defaults | DEVICES))
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(str(TESTS / check) for check in CHECKS)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=TESTS.parent)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert f"{len(CHECKS)} passed" in ran.stdout, ran.stdout[-3000:]
