"""Live queries of this process's devices, where the planner (`plan/hardware.py`) is arithmetic
about hardware: the memory a new allocation can still take, which the decoder and the server
check a KV cache against before allocating it."""

from __future__ import annotations

import jax


def free_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Memory a new allocation can still take on `device` (default: the first): an
    accelerator's limit less what is in use, the host's available memory for a CPU; None if
    unknown."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
