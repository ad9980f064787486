"""Multi-host runs: one process per host, joined into one global mesh by `jax.distributed`.

On TPU pods and under SLURM JAX finds the coordinator by itself; elsewhere (e.g. several CPU
or GPU hosts, or two processes on one machine) pass the coordinator's `host:port`, the number
of processes and this process's id. CPU processes exchange collectives through gloo.
"""

from __future__ import annotations

import os

import jax

from llama_jax.errors import ConfigError


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Joins the run's processes; a no-op for a single process outside a cluster."""
    if coordinator is None and num_processes is None and process_id is None:
        if _in_cluster():
            jax.distributed.initialize()  # TPU pod / SLURM: everything auto-detected
        return
    if coordinator is None or num_processes is None or process_id is None:
        raise ConfigError("a multi-process run needs --coordinator HOST:PORT, --num-processes N "
                          "and --process-id I (all three)")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id} is not in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)


def _in_cluster() -> bool:
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") + 1
    return slurm_tasks > 1 or tpu_hosts > 1
