"""The XLA flags the library sets when it runs on an NVIDIA GPU, and the rules for overriding them.

XLA reads `XLA_FLAGS` once, when JAX starts its first backend, so `import llama_jax` adds the
flags below to the environment then (`set_gpu_flags`): import llama_jax before anything asks
JAX for a device. They are added only when JAX will run on CUDA: a CUDA plugin
(`jax-cuda12-plugin`, `jax-cuda13-plugin`) is installed and `JAX_PLATFORMS`, if set, names
`cuda` or `gpu` (on a host with a CUDA plugin but no GPU they are added too, and do nothing).
Elsewhere the environment is left as it was.

Overriding, flag by flag: a flag you name in `XLA_FLAGS` yourself keeps your value, whatever it
is (`XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false`). All of them:
`LLAMA_JAX_GPU_FLAGS=0` leaves `XLA_FLAGS` alone.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

from llama_jax.errors import ConfigError

# flag name -> value, without the leading "--"
GPU_FLAGS = {
    # XLA's default schedule issues each collective where its operands are ready and waits at
    # once; the latency-hiding scheduler moves the wait as late as the result allows, so the
    # FSDP all-gathers and gradient reduce-scatters overlap the layers' matmuls. Off by default
    # in XLA; NVIDIA's JAX-Toolbox and MaxText turn it on for GPU training.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # XLA's default command buffers (CUDA graphs) hold fusions and library calls but not loops:
    # a while loop (the decoder's token loop, the scan over layers) then returns to the host on
    # every iteration to launch its body and read its condition. With WHILE and CONDITIONAL
    # the whole loop is one graph the GPU runs on its own. "+" adds to XLA's default set.
    "xla_gpu_enable_command_buffer": "+WHILE,+CONDITIONAL",
}
SWITCH = "LLAMA_JAX_GPU_FLAGS"  # "0": leave XLA_FLAGS alone; "1" (the default): add GPU_FLAGS
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def named_flags(xla_flags: str) -> set[str]:
    """The flag names an `XLA_FLAGS` string sets (`--name=value` or a bare `--name`; words
    split at whitespace, as XLA splits them)."""
    return {word[2:].partition("=")[0] for word in xla_flags.split() if word.startswith("--")}


def with_flags(xla_flags: str, flags: dict[str, str]) -> str:
    """`xla_flags` with each of `flags` (name -> value) it does not name added after it."""
    named = named_flags(xla_flags)
    added = [f"--{name}={value}" for name, value in flags.items() if name not in named]
    return " ".join([xla_flags.strip(), *added]).strip()


def with_gpu_flags(xla_flags: str) -> str:
    """`xla_flags` with each of GPU_FLAGS it does not name added after it."""
    return with_flags(xla_flags, GPU_FLAGS)


def without_gpu_flags(xla_flags: str) -> str:
    """`xla_flags` less the words `with_gpu_flags` adds (the same flag with another value
    stays): the flags of a process that ran `import llama_jax`, for one that must not get them."""
    added = {f"--{name}={value}" for name, value in GPU_FLAGS.items()}
    return " ".join(word for word in xla_flags.split() if word not in added)


def runs_on_cuda(environ: MutableMapping[str, str]) -> bool:
    """Whether JAX will start its CUDA backend: a CUDA plugin is installed and `JAX_PLATFORMS`
    (when set) lets JAX use it."""
    platforms = {p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",")} - {""}
    if platforms and not platforms & {"cuda", "gpu"}:
        return False
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def added_gpu_flags(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The GPU flags the library adds to a CUDA compile (name -> value): GPU_FLAGS less those
    `XLA_FLAGS` names; none when `LLAMA_JAX_GPU_FLAGS=0`."""
    switch = environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ConfigError(f"environment variable {SWITCH}={switch!r} must be 0 (leave "
                          "XLA_FLAGS as it is) or 1 (add the library's GPU flags)")
    named = named_flags(environ.get("XLA_FLAGS", ""))
    return {} if switch == "0" else {k: v for k, v in GPU_FLAGS.items() if k not in named}


def set_gpu_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds GPU_FLAGS to `environ["XLA_FLAGS"]` when JAX will run on CUDA, keeping every flag
    the user set; does nothing when `LLAMA_JAX_GPU_FLAGS=0`. (A compile for a GPU target from
    another host passes them to the compiler instead: `parallel.target.compiler_options`.)"""
    added = added_gpu_flags(environ)
    if added and runs_on_cuda(environ):
        environ["XLA_FLAGS"] = with_flags(environ.get("XLA_FLAGS", ""), added)
