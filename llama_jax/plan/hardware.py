"""Peak matmul rates for MFU: a published table for accelerators, a measurement for CPUs.

MFU = model FLOPs per second / (devices × peak per device). On a CPU there is no datasheet
figure that XLA can reach, so the peak is the rate of a large jitted matmul measured on the same
machine in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_flops: float  # dense (no sparsity), per chip / GPU
    memory_bytes: int  # HBM per chip / GPU
    bandwidth: float  # HBM bytes/s
    backend: str  # the JAX backend that drives it: "cpu", "gpu" or "tpu"
    device_kinds: tuple[str, ...] = ()  # prefixes of `jax.Device.device_kind` it goes by
    # TPUs: the clock XLA:TPU's cycle estimates run at (the bf16 peak over the MXUs' multiply-
    # adds per cycle: v5p 459e12 / (2 cores x 4 MXUs x 128 x 128 x 2) = 1.75 GHz) and the
    # inter-chip interconnect's bytes/s per chip, all links together (datasheet Gbps / 8).
    clock_hz: float | None = None
    ici_bandwidth: float | None = None


def _gib(n: float) -> int:
    return round(n * 2**30)


def _clock(peak: float, cores: int, mxus: int, side: int) -> float:
    """A TPU's clock from its bf16 peak: each MXU does side x side multiply-adds a cycle."""
    return peak / (cores * mxus * side * side * 2)


# Peaks and bandwidths from vendor datasheets. A TPU's memory is what XLA:TPU lets a program
# use per chip (its "exceeds available HBM (X)" limit, read from libtpu 0.0.42 compiling for
# each generation): less than the datasheet's HBM, and the figure that decides whether a plan
# fits. "cpu" has no entry: it is measured on the machine instead.
HARDWARE = {h.name: h for h in (
    Hardware("v4", 275e12, _gib(30.75), 1200e9, "tpu", ("TPU v4",), _clock(275e12, 2, 4, 128),
             2400e9 / 8),
    Hardware("v5e", 197e12, _gib(15.75), 819e9, "tpu", ("TPU v5 lite", "TPU v5e"),
             _clock(197e12, 1, 4, 128), 1600e9 / 8),
    Hardware("v5p", 459e12, _gib(95.74), 2765e9, "tpu", ("TPU v5p", "TPU v5"),
             _clock(459e12, 2, 4, 128), 4800e9 / 8),
    Hardware("v6e", 918e12, _gib(31.25), 1640e9, "tpu", ("TPU v6 lite", "TPU v6e"),
             _clock(918e12, 1, 4, 256), 3584e9 / 8),
    Hardware("a100", 312e12, 80 << 30, 2039e9, "gpu", ("NVIDIA A100",)),
    Hardware("h100", 989e12, 80 << 30, 3350e9, "gpu", ("NVIDIA H100",)),
    Hardware("h200", 989e12, 141 << 30, 4800e9, "gpu", ("NVIDIA H200",)),
)}


def hardware(name: str) -> Hardware:
    """A planner hardware entry; "cpu" measures this machine's matmul rate and memory bandwidth
    (a few seconds)."""
    if name == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        probe = bandwidth_probe()
        return Hardware("cpu", measure_matmul_flops("float32"), memory,
                        max(probe() for _ in range(3)), "cpu")
    return HARDWARE[name]


def peak_flops_per_device(dtype: str = "float32") -> float:
    """The peak matmul rate of one of this process's devices: the table's bf16 figure for a
    known accelerator, otherwise measured."""
    kind = jax.devices()[0].device_kind
    for entry in HARDWARE.values():
        if kind.startswith(entry.device_kinds):
            return entry.peak_bf16_flops
    return measure_matmul_flops(dtype)


def bandwidth_probe(n_bytes: int = 1 << 30) -> Callable[[], float]:
    """A function that measures read bandwidth (bytes/s) once per call: a jitted `sum` over an
    fp32 array of `n_bytes` on device 0, compiled and warmed here."""
    data = jnp.ones((n_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()

    def measure() -> float:
        start = time.perf_counter()
        total(data).block_until_ready()
        return data.nbytes / (time.perf_counter() - start)

    return measure


@functools.lru_cache(maxsize=None)  # once per process: every run of a process shares a machine
def measure_matmul_flops(dtype: str = "float32", size: int = 1536, repeats: int = 3,
                         chain: int = 2) -> float:
    """Best-of-`repeats` rate of a jitted [size, size] @ [size, size] matmul on device 0, run
    `chain` times per timing. One matmul takes tens of milliseconds on a CPU, so dispatch
    overhead does not count, and the measurement costs every training run well under a
    second."""
    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.random.normal(k, (size, size), jnp.float32).astype(dtype) for k in keys)

    @jax.jit
    def matmuls(a, b):
        for _ in range(chain):
            a = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype) * 1e-3
        return a

    matmuls(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmuls(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return chain * 2 * size ** 3 / best
