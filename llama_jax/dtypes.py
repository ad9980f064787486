"""The floating dtypes parameters, activations and caches may use, by name: configs store
names (hashable, YAML-friendly) and `dtype_name` reads any dtype-like into one."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from llama_jax.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: Any, field: str = "dtype") -> str:
    """The name of any dtype-like (`jnp.bfloat16`, `np.float32`, `"float16"`, `jnp.dtype(...)`)
    among the floating dtypes parameters, activations and caches may use."""
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in DTYPES:
        raise ConfigError(f"{field}={dtype!r} is not one of {', '.join(DTYPES)}")
    return name
