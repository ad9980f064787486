"""The platform a program is compiled for: the mesh's devices, not the host's.

Every execution choice that depends on the hardware (the attention kernel, the CPU's widening of
16-bit matmuls and its int8 slicing, the decoder's layer loop, the memory a cache draws on, the
GPU compiler flags) asks `platform()`. On real hardware that is JAX's default backend, as
before. A program lowered for devices the host does not have (a TPU slice or a GPU node
described by `parallel/topology.py`) is traced inside `compiling_for(mesh)`, which makes
`platform()` answer the mesh's platform: the compiler then gets exactly the program that
hardware would run, not the CPU host's.

JAX caches traced functions by their arguments' shapes, not by anything of ours, so a function
traced for the host could be reused for the target (and back): entering and leaving a target
other than the host's clears JAX's caches. Compiling for a target is a one-off job; the host's
programs compile again afterwards. The GPU flags that `import llama_jax` puts in `XLA_FLAGS` on
a GPU host reach a GPU target's compile as options (`compiler_options`).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Iterator, Sequence

import jax
import numpy as np
from jaxlib import xla_client

from llama_jax import xla_flags

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("llama_jax_target",
                                                                      default=None)
# What jax.Device.platform says -> the backend names the library's choices use.
_PLATFORM_NAMES = {"cuda": "gpu", "rocm": "gpu"}


def platform_name(device: jax.Device) -> str:
    """"cpu", "gpu" or "tpu" for a device (CUDA and ROCm devices are "gpu")."""
    return _PLATFORM_NAMES.get(device.platform, device.platform)


def devices_of(where: jax.sharding.Mesh | Sequence[jax.Device]) -> list[jax.Device]:
    """The devices of a mesh, or the sequence itself."""
    if isinstance(where, jax.sharding.Mesh):
        return list(np.asarray(where.devices).flat)
    return list(where)


def host_platform() -> str:
    """JAX's default backend, by the names of `platform_name`."""
    return _PLATFORM_NAMES.get(jax.default_backend(), jax.default_backend())


def platform() -> str:
    """The platform being compiled for: the target of the enclosing `compiling_for`, else the
    host's (`host_platform`)."""
    target = _TARGET.get()
    return target if target is not None else host_platform()


def default_compute_dtype() -> str:
    """`compute_dtype: auto` on the platform being compiled for: bfloat16 on TPUs and GPUs
    (their matmul units' native input; parameters and optimizer stay in param_dtype), float32
    on CPUs, where XLA widens 16-bit matmuls and bfloat16 runs slower."""
    return "float32" if platform() == "cpu" else "bfloat16"


def platform_of_tree(tree) -> str:
    """The platform of the devices holding a tree's arrays (or abstract arrays with shardings);
    `platform()` for host data."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return platform_name(next(iter(sharding.device_set)))
    return platform()


def compiler_options() -> dict[str, str | bool]:
    """XLA options that a compile for the current target passes beside the process's own
    `XLA_FLAGS`: the library's GPU flags (`xla_flags`) for a GPU target compiled on a host
    whose XLA started without them. A GPU host has them in `XLA_FLAGS` already."""
    if platform() != "gpu" or host_platform() == "gpu":
        return {}
    return {name: _as_option(name, value)
            for name, value in xla_flags.added_gpu_flags().items()}


def _as_option(name: str, value: str) -> str | bool:
    """An `XLA_FLAGS` value as a compile option: booleans as bools, and a list's edits
    ("+WHILE,-FUSION", which only the flag parser reads) applied to XLA's default list."""
    if value in ("true", "false"):
        return value == "true"
    if not value.startswith(("+", "-")):
        return value
    compile_options = xla_client.CompileOptions()  # held: its parts point into it
    build_options = compile_options.executable_build_options
    defaults = str(build_options.debug_options)
    items = set(re.findall(rf"^{name}: (\w+)$", defaults, re.MULTILINE))
    for edit in value.split(","):
        (items.add if edit[0] == "+" else items.discard)(edit[1:])
    return ",".join(sorted(items))


@contextlib.contextmanager
def compiling_for(where: jax.sharding.Mesh | Sequence[jax.Device]) -> Iterator[str]:
    """A block in which `platform()` is the platform of `where`'s devices (yielded); programs
    traced and lowered in it are the target's."""
    name = platform_name(devices_of(where)[0])
    foreign = name != host_platform()
    if foreign:
        jax.clear_caches()  # nothing traced for the host is reused for the target
    token = _TARGET.set(name)
    try:
        yield name
    finally:
        _TARGET.reset(token)
        if foreign:
            jax.clear_caches()  # nor the target's traces for the host
