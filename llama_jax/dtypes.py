"""The dtypes parameters, activations and KV caches may use, by name: configs store names
(hashable, YAML-friendly) and `dtype_name` reads any dtype-like into one."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from llama_jax.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
# A KV cache may also hold int8 values with a float32 scale per cached vector.
CACHE_DTYPES = (*DTYPES, "int8")


def dtype_name(dtype: Any, field: str = "dtype", allowed: tuple[str, ...] = DTYPES) -> str:
    """The name of any dtype-like (`jnp.bfloat16`, `np.float32`, `"float16"`, `jnp.dtype(...)`)
    among `allowed` (default: the floating dtypes parameters and activations may use)."""
    try:
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in allowed:
        raise ConfigError(f"{field}={dtype!r} is not one of {', '.join(allowed)}")
    return name


def cache_dtype_name(dtype: Any, default: str) -> str:
    """A KV cache's dtype (`cache_dtype`): `default` (the compute dtype) when None."""
    return dtype_name(default if dtype is None else dtype, "cache_dtype", CACHE_DTYPES)
