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
