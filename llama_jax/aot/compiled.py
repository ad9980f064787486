"""What the compiler says of one program per device: its memory, or that it does not fit.

`memory_analysis()` gives arguments, outputs (less those aliased to donated arguments),
temporaries and, on TPUs, the peak of the buffer assignment (`peak_memory_in_bytes`): the
figure that decides whether the program fits. Arguments + outputs + temporaries overstate a
TPU's peak (XLA reuses argument buffers and frees temporaries as it goes: by 8-10 GiB per chip
at LLaMA-3 8B/70B scale), so the peak is used where the backend reports one. A program that
does not fit fails to compile with RESOURCE_EXHAUSTED and the bytes it needed: that is a
result here, not an error.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable

import jax

from llama_jax.aot.estimate import CUSTOM_CALL_TARGET, StepEstimate, estimate, estimate_gpu
from llama_jax.plan.costs import format_bytes
from llama_jax.plan.hardware import Hardware

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# XLA:TPU's out-of-memory messages: "... required for HLO temporaries (400.00G) exceeds
# available HBM (30.75G)" and "Used 120.50G of 95.74G hbm. Exceeded hbm capacity by ..."
_OOM = (re.compile(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
        re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"))
# The compile option under which XLA:GPU writes its fusions' estimated times into the program.
GPU_COST_OPTION = "xla_gpu_collect_cost_model_stats"


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's bytes per device, or what it needed when it did not fit."""

    name: str  # "train step", "evaluation", ...
    compile_s: float
    arguments: int = 0
    outputs: int = 0  # not aliased to a donated argument
    temporaries: int = 0
    peak: int | None = None  # XLA's peak per device, where the backend reports one
    needed: int | None = None  # when it did not fit: what XLA said it needed ...
    available: int | None = None  # ... of what it allows
    error: str | None = None  # the compiler's message, when it did not fit
    custom_calls: tuple[str, ...] = ()  # the kernels XLA calls out to (Mosaic's
    # tpu_custom_call, cuDNN's __cudnn$fmha...), sorted, each once
    clock: StepEstimate | None = None  # XLA's own estimate of the program (aot/estimate)

    @property
    def fits(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict:
        """Its fields, the clock's with its derived figures (seconds, cycles)."""
        return dataclasses.asdict(self) | {"total": self.total,
                                           "clock": self.clock and self.clock.as_dict()}

    @property
    def total(self) -> int:
        """The program's bytes per device: XLA's peak, else arguments + outputs + temporaries
        (the backend reports no peak), else (did not fit) what it needed."""
        if not self.fits:
            return self.needed or 0
        return self.peak or self.arguments + self.outputs + self.temporaries

    def verdict(self, limit: int | None) -> str:
        """"fits (X of Y per device)" or "does not fit: needs X of Y per chip"."""
        if not self.fits:
            if self.needed is None:
                return f"does not fit: {self.error}"
            return (f"does not fit: needs {format_bytes(self.needed)} of "
                    f"{format_bytes(self.available)} per chip")
        return f"fits ({format_bytes(self.total)}" + \
            (f" of {format_bytes(limit)} per device)" if limit else " per device)")


    def report_lines(self, limit: int | None, model_flops: float | None = None) -> list[str]:
        """"NAME: compiled in S s; <verdict>", the compiler's message when it did not fit, and
        its clock's estimate (with an MFU from `model_flops` per device per call)."""
        lines = [f"{self.name}: compiled in {self.compile_s:.1f} s; {self.verdict(limit)}"]
        if not self.fits and self.error:
            lines.append(f"  XLA: {self.error}")
        if self.clock is not None:
            lines += ["  " + line for line in self.clock.report_lines(model_flops)]
        return lines


def compile_program(name: str, lower: Callable[[], jax.stages.Lowered],
                    options: dict[str, str], platform: str, device: Hardware | None = None,
                    ) -> tuple[ProgramMemory, jax.stages.Compiled | None]:
    """Lowers and compiles one program for `platform`, timing it: its memory (and, for a TPU or
    GPU `device` of the hardware table, XLA's estimate of its time) and the executable, or (did
    not fit in the device's memory) what it needed and None."""
    if platform == "gpu" and device is not None:  # XLA:GPU prices its fusions when asked
        options = {**options, GPU_COST_OPTION: True}
    start = time.perf_counter()
    try:
        compiled = lower().compile(options)
    except jax.errors.JaxRuntimeError as e:
        message = str(e)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        return out_of_memory(name, time.perf_counter() - start, message), None
    return of_compiled(name, time.perf_counter() - start, compiled, platform, device), compiled


def custom_calls(hlo_text: str) -> tuple[str, ...]:
    """The custom-call targets an HLO module's text names."""
    return tuple(sorted(set(CUSTOM_CALL_TARGET.findall(hlo_text))))


def of_compiled(name: str, compile_s: float, compiled: jax.stages.Compiled,
                platform: str, device: Hardware | None = None) -> ProgramMemory:
    text = compiled.as_text() or ""
    calls = custom_calls(text)
    clock = None
    if platform == "tpu" and device is not None and device.clock_hz:
        clock = estimate(text, device.clock_hz, device.peak_bf16_flops, device.ici_bandwidth)
    elif platform == "gpu" and device is not None:
        clock = estimate_gpu(text, device.peak_bf16_flops, device.bandwidth)
    stats = compiled.memory_analysis()
    if stats is None:
        return ProgramMemory(name, compile_s, custom_calls=calls, clock=clock)
    # XLA:CPU's figure is not a peak of the host's memory: there the total is the sum
    peak = (getattr(stats, "peak_memory_in_bytes", 0) or None) if platform != "cpu" else None
    return ProgramMemory(name, compile_s, arguments=stats.argument_size_in_bytes,
                         outputs=stats.output_size_in_bytes - stats.alias_size_in_bytes,
                         temporaries=stats.temp_size_in_bytes, peak=peak,
                         custom_calls=calls, clock=clock)


def out_of_memory(name: str, compile_s: float, message: str) -> ProgramMemory:
    """The failed compile's figures, read from XLA's message (its first line kept)."""
    line = next((ln.strip() for ln in message.splitlines() if "RESOURCE_EXHAUSTED" in ln),
                message.strip().splitlines()[0])
    for pattern in _OOM:
        found = pattern.search(message)
        if found:
            needed, unit, available, unit2 = found.groups()
            return ProgramMemory(name, compile_s, needed=round(float(needed) * _UNITS[unit]),
                                 available=round(float(available) * _UNITS[unit2]), error=line)
    return ProgramMemory(name, compile_s, error=line)
