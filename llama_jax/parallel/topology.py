"""Hardware this host does not have, as JAX devices a program can be compiled for.

Names are written as the cloud consoles and MaxText write them:

- TPU slices `v4-N`, `v5p-N` (N TensorCores, two per chip: a slice of N/2 chips, each one JAX
  device in megacore mode), `v5e-N` / `v5litepod-N` and `v6e-N` (N chips, one core each);
  or libtpu's own form, generation and chip grid: `v5e:2x2`, `v5p:4x4x8`. `--slices S` joins
  S such slices over the data-centre network (multi-slice).
- NVIDIA nodes `h100xG`, `h200xG` (G GPUs: 8 per host), from the target descriptions kept
  beside this module (`gpu_targets/*.txtpb`: XLA's GpuTargetConfig, the device's compute
  capability, memory and cuDNN / CUDA versions as a real device reports them).

`parse` is arithmetic (the planner uses it without any compiler); `devices` loads the compiler
for the platform: libtpu for TPUs (`pip install "jax[tpu]"`, or `TPU_LIBRARY_PATH` naming a
libtpu.so), jax's CUDA plugin for GPUs (`pip install "jax[cuda12]"`), and says how to install
it when it is missing. A 3-D slice grows from 2x2x1 chips by doubling its smallest side (the
last of equal ones): 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...; a 2-D one from 2x2: 2x4, 4x4, 4x8.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re
from pathlib import Path

import jax
from jax.experimental import topologies

from llama_jax.errors import ConfigError

GPU_TARGETS = Path(__file__).parent / "gpu_targets"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: its libtpu name, whether JAX sees a chip as one device of two cores
    (megacore), the grid's dimensions and its largest slice in chips."""

    libtpu: str
    megacore: bool
    dims: int
    max_chips: int


TPU_GENERATIONS = {
    "v4": Generation("v4", True, 3, 4096),
    "v5p": Generation("v5p", True, 3, 8192),
    "v5e": Generation("v5e", False, 2, 256),
    "v6e": Generation("v6e", False, 2, 256),
}
_ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e"}
GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named target: what to compile for, before any compiler is loaded."""

    name: str  # as written
    platform: str  # "tpu" or "gpu"
    hardware: str  # the planner's entry (plan/hardware.py): "v5p", "h100", ...
    devices_per_slice: int  # JAX devices: chips (TPU), GPUs
    slices: int = 1
    grid: tuple[int, ...] = ()  # TPU chips per side
    megacore: bool = False

    @property
    def n_devices(self) -> int:
        return self.devices_per_slice * self.slices

    @property
    def libtpu_name(self) -> str:
        return f"{TPU_GENERATIONS[self.hardware].libtpu}:{'x'.join(map(str, self.grid))}"

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Which sides of the slice close into a ring (the ICI's wraparound links), as the real
        slice has them: every side of a 3-D slice of 4x4x4 chips or more (v4, v5p), a side of
        16 chips of a 2-D one (v5e, v6e). Without them XLA:TPU compiles for an open mesh of
        chips, on which it cannot ring-all-gather across the slice: it zero-fills a full buffer
        per gather and all-reduces it instead (twice the bytes), which the real pod does not."""
        if len(self.grid) == 3:
            torus = min(self.grid) >= 4
            return (torus, torus, torus)
        return (*(side == 16 for side in self.grid), False)

    @property
    def cloud_name(self) -> str:
        """The slice as Google Cloud names its accelerator type (v5litepod-16, v5p-256)."""
        cloud = {"v5e": "v5litepod"}.get(self.hardware, self.hardware)
        return f"{cloud}-{self.devices_per_slice * (2 if self.megacore else 1)}"

    def describe(self) -> str:
        """One line: the name, what it is, and how libtpu / the CUDA plugin is asked for it."""
        if self.platform == "tpu":
            rings = "".join("w" if closed else "-" for closed in self.wrap[:len(self.grid)])
            what = f"{self.libtpu_name}{' megacore' if self.megacore else ''}, " \
                   f"{self.devices_per_slice} chips" + \
                   (f", wraparound {rings}" if any(self.wrap) else "")
        else:
            what = f"{self.devices_per_slice} x {self.hardware.upper()}, " \
                   f"{math.ceil(self.devices_per_slice / GPUS_PER_HOST)} host(s)"
        slices = f" x {self.slices} slices" if self.slices > 1 else ""
        return f"{self.name} ({what}{slices}: {self.n_devices} devices)"


def grid_of(chips: int, dims: int) -> tuple[int, ...]:
    """The chip grid of a slice of `chips` (see the module docstring); 1 chip is 1x1."""
    if chips == 1 and dims == 2:
        return (1, 1)
    grid = [2, 2] + [1] * (dims - 2)
    while math.prod(grid) < chips:
        smallest = min(grid)
        last = max(i for i, side in enumerate(grid) if side == smallest)
        grid[last] *= 2
    return tuple(grid)


def parse(name: str, slices: int = 1) -> Topology:
    """The target `name` stands for, `slices` times (a `ConfigError` naming what is wrong)."""
    if slices < 1:
        raise ConfigError(f"--slices {slices} must be >= 1")
    text = name.strip().lower()
    gpu = re.fullmatch(r"([a-z]\d+)x(\d+)", text)
    if gpu:
        return _gpu(name, gpu.group(1), int(gpu.group(2)), slices)
    grid = re.fullmatch(r"(v\w+?):(\d+(?:x\d+)+)", text)
    if grid:
        generation = _generation(name, grid.group(1))
        sides = tuple(int(s) for s in grid.group(2).split("x"))
        if len(sides) != TPU_GENERATIONS[generation].dims:
            raise ConfigError(f"topology {name!r}: {generation} slices are "
                              f"{TPU_GENERATIONS[generation].dims}-D grids of chips")
        return _tpu(name, generation, sides, slices)
    sized = re.fullmatch(r"(v\w+?)-(\d+)", text)
    if not sized:
        raise ConfigError(f"topology {name!r}: expected a TPU slice (v4-8, v5e-256, v5p-1024, "
                          f"v6e-64, or v5p:4x4x8) or a GPU node ({', '.join(gpu_names())})")
    generation = _generation(name, sized.group(1))
    spec, count = TPU_GENERATIONS[generation], int(sized.group(2))
    chips = count // 2 if spec.megacore else count
    smallest = 4 if spec.dims == 3 else 1  # chips; 2-D slices skip 2 (1x1, then 2x2)
    power_of_two = chips >= 1 and not chips & (chips - 1)
    if (spec.megacore and count % 2) or not power_of_two or chips == 2 or \
            not smallest <= chips <= spec.max_chips:
        per_chip = 2 if spec.megacore else 1
        sizes = f"{smallest * per_chip}" if spec.dims == 3 else "1, 4"
        raise ConfigError(f"topology {name!r}: {generation}-N names a slice of N "
                          f"{'TensorCores (2 per chip)' if spec.megacore else 'chips'}; N is "
                          f"{sizes} or a larger power of two up to {spec.max_chips * per_chip}")
    return _tpu(name, generation, grid_of(chips, spec.dims), slices)


def _generation(name: str, text: str) -> str:
    generation = _ALIASES.get(text, text)
    if generation not in TPU_GENERATIONS:
        raise ConfigError(f"topology {name!r}: unknown TPU generation {text!r} (known: "
                          f"{', '.join(TPU_GENERATIONS)})")
    return generation


def _tpu(name: str, generation: str, grid: tuple[int, ...], slices: int) -> Topology:
    return Topology(name, "tpu", generation, math.prod(grid), slices, grid,
                    TPU_GENERATIONS[generation].megacore)


def gpu_names() -> list[str]:
    """The GPU kinds with a target description, as `<kind>xG` examples."""
    return [f"{p.stem}x{GPUS_PER_HOST}" for p in sorted(GPU_TARGETS.glob("*.txtpb"))]


def _gpu(name: str, kind: str, count: int, slices: int) -> Topology:
    if not (GPU_TARGETS / f"{kind}.txtpb").is_file():
        raise ConfigError(f"topology {name!r}: no target description for {kind!r} GPUs "
                          f"(known: {', '.join(gpu_names())})")
    if slices != 1:
        raise ConfigError(f"topology {name!r}: --slices is for TPU slices; name the GPUs "
                          f"instead ({kind}x{count * slices})")
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise ConfigError(f"topology {name!r}: {count} GPUs: up to {GPUS_PER_HOST} on one "
                          f"host, or whole hosts of {GPUS_PER_HOST}")
    return Topology(name, "gpu", kind, count, 1)


def devices(topology: Topology, gpu_target: str | None = None) -> list:
    """Compile-only JAX devices of `topology` (loads libtpu or the CUDA plugin). `gpu_target`:
    a GPU target description to use instead of the repository's (a real device's own)."""

    if topology.platform == "tpu":
        _require(_tpu_compiler_found(), "compiling for a TPU needs libtpu: pip install "
                 "'jax[tpu]' (the version matching jax), or set TPU_LIBRARY_PATH to a libtpu.so")
        options = {"num_slices": topology.slices} if topology.slices > 1 else {}
        options["wrap"] = topology.wrap
        if topology.megacore:
            options["chip_config_name"] = "megacore"
        if topology.devices_per_slice == 1:
            options["chips_per_host_bounds"] = (1, 1, 1)  # the default host is 2x2 chips
        if not _tpu_host():
            # libtpu probes the host for the TPU it runs on and prints half a screen of
            # warnings when there is none; told, it does not. The compiled program follows
            # the topology asked for, whatever these say (checked: each generation's memory
            # limit is its own under another generation's name).
            os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.cloud_name)
            os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
            # Compile-only: no chips to guard, so several processes may load libtpu at once
            # (its lockfile otherwise refuses the second).
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return list(topologies.get_topology_desc(topology.libtpu_name, "tpu",
                                                 **options).devices)
    _require(cuda_plugin() is not None, "compiling for an NVIDIA GPU needs jax's CUDA plugin: "
             "pip install 'jax[cuda12]' (the version matching jax)")
    hosts = math.ceil(topology.devices_per_slice / GPUS_PER_HOST)
    per_host = topology.devices_per_slice // hosts
    config = gpu_target or (GPU_TARGETS / f"{topology.hardware}.txtpb").read_text()
    return list(topologies.get_topology_desc(platform="cuda", topology_name="",
                                             target_config=config,
                                             topology=f"1x{hosts}x{per_host}").devices)


def _require(found: bool, message: str) -> None:
    if not found:
        raise ConfigError(message)


def _tpu_host() -> bool:
    """Whether this host has TPU chips (their device files, as libtpu finds them)."""
    return any(Path("/dev").glob("accel[0-9]*")) or any(Path("/dev/vfio").glob("[0-9]*"))


def _tpu_compiler_found() -> bool:
    return (Path(os.environ.get("TPU_LIBRARY_PATH", "")).is_file()
            or importlib.util.find_spec("libtpu") is not None)


def cuda_plugin() -> str | None:
    """The name of the installed CUDA plugin module, if any."""
    return next((name for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")
                 if importlib.util.find_spec(name) is not None), None)


def compiler_versions(platform: str) -> dict[str, str]:
    """The packages that decide the compiled program: jax, jaxlib and the target's compiler
    (libtpu, the CUDA plugin); a different version compiles a different program."""

    versions = {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib")}
    package = {"tpu": "libtpu", "gpu": (cuda_plugin() or "").replace("_", "-")}[platform]
    try:
        versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        versions[package] = _libtpu_at_path() or "not installed"
    return versions


def _libtpu_at_path() -> str | None:
    """The version of the libtpu that TPU_LIBRARY_PATH names, from the metadata pip left beside
    it (`pip install --target DIR libtpu`: DIR/libtpu/libtpu.so, DIR/libtpu-V.dist-info), else
    its path."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if not path:
        return None
    found = sorted(Path(path).parent.parent.glob("libtpu-*.dist-info"))
    return found[-1].name[len("libtpu-"):-len(".dist-info")] if found else path
