"""Where arrays live: a device mesh from the config, and logical axis names mapped to mesh axes.

The model and the parameter descriptions name logical axes only (`TensorSpec.axes`: "embed",
"q_heads", "mlp", ...; activations: "batch", "heads", ...). This module alone knows the mesh
(`data`, `fsdp`, `tensor`, `expert`) and turns names into `PartitionSpec`s through rules
tables — one for weights (and the optimizer state, which mirrors them), one for activations,
one for the KV cache: the defaults below (`RULE_TABLES`), with a config's `mesh:` section
(`MeshConfig`) merged over them. A mesh axis is used at most once per array, and a mesh axis
whose size does not divide a dimension (e.g. tensor=8 over MQA's single KV head) is dropped for
that array, with a log line, rather than failing.

`constrain(x, axes)` puts a sharding constraint on an activation when a mesh is active
(`use_mesh`), and does nothing otherwise, so the model code runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llama_jax.errors import ConfigError
from llama_jax.quant import Int8
from llama_jax.spec import map_specs

if TYPE_CHECKING:
    from llama_jax.config import MeshConfig

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axes. Weights: FSDP shards the model width of every matrix (MLA's
# up-projections, which have none, their latent width), tensor
# parallelism the heads, the FFN width and the vocabulary (Megatron's split), expert
# parallelism the MoE experts. Activations: the batch over data x fsdp x expert (outside the
# experts, the expert axis is one more data-parallel axis), heads / FFN / vocab over tensor,
# the experts' token buffers `[B, E, C, D]` over expert (E) and data x fsdp (B: expert_batch).
# LoRA's adapters split along their weight's axes; their rank ("lora_rank") is replicated.
# The KV cache: rows over data x fsdp x expert, KV heads over tensor; MLA's latent cache is
# replicated over tensor (its one shared "head" cannot be split). A config's `mesh:`
# section overrides entries.
BATCH_AXES = ["data", "fsdp", "expert"]
# The residual stream between blocks is split over tensor along its sequence (Megatron's
# sequence parallelism): without it every device of a tensor group holds its rows' stream
# whole, which is what full remat keeps per layer (LLaMA-3 70B over tensor=8 at 8K tokens a
# row: 94 GiB a v5p chip, 21 with it). `residual_seq: null` turns it off.
# Axes whose size routinely does not divide their mesh axes, said nowhere: the residual
# stream's sequence of a decode step (one token), which sequence parallelism leaves whole.
UNSPLIT_AS_A_RULE = frozenset({"residual_seq"})
RULE_TABLES = {
    "weight_rules": ({"embed": "fsdp", "q_heads": "tensor", "kv_heads": "tensor",
                      "mlp": "tensor", "vocab": "tensor", "experts": "expert", "latent": "fsdp"},
                     ("layers", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "vocab",
                      "norm", "positions", "experts", "latent", "labels", "lora_rank")),
    "activation_rules": ({"batch": BATCH_AXES, "heads": "tensor", "kv_heads": "tensor",
                          "mlp": "tensor", "vocab": "tensor", "experts": "expert",
                          "expert_batch": ["data", "fsdp"], "residual_seq": "tensor"},
                         ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp",
                          "vocab", "experts", "expert_batch", "residual_seq")),
    "cache_rules": ({"batch": BATCH_AXES, "kv_heads": "tensor"},
                    ("batch", "kv_heads", "seq", "head_dim", "latent")),
}


_ACTIVE: contextvars.ContextVar[tuple[Mesh, MeshConfig] | None] = contextvars.ContextVar(
    "llama_jax_mesh", default=None)


def make_mesh(mesh: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of `mesh`'s sizes over `devices` (default: all), laid out along the physical
    interconnect. Devices of several TPU slices (multi-slice) split the data axis across the
    slices: its one gradient reduction per step is the traffic the data-centre network
    between slices carries well; every other axis stays inside a slice."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh.shape_for(len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        try:
            return jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=axis_types)
        except NotImplementedError:
            # An axis that is no product of whole sides of the chips' torus (8 ways on a v5p
            # slice of 4x4x4 chips): one side is split between two mesh axes.
            log.info("mesh %s splits a side of the devices' physical torus",
                     dict(zip(MESH_AXES, shape)))
            grid = mesh_utils.create_device_mesh(shape, devices,
                                                 allow_split_physical_axes=True)
            return Mesh(grid, MESH_AXES, axis_types=axis_types)
    if shape[0] % slices:
        raise ConfigError(f"mesh {dict(zip(MESH_AXES, shape))} over {slices} slices: the data "
                          f"axis spans the slices, so mesh.data must be a multiple of {slices}")
    per_slice = (shape[0] // slices, *shape[1:])
    grid = mesh_utils.create_hybrid_device_mesh(per_slice, (slices, 1, 1, 1), devices)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def spec(axes: Sequence[str | None], shape: Sequence[int], rules: tuple,
         mesh_shape: Mapping[str, int], what: str = "array") -> P:
    """The PartitionSpec of an array whose dimensions have these logical names, on a mesh of
    `mesh_shape` (`mesh.shape`, or planned sizes)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name, size in zip(axes, shape):
        kept = []
        for mesh_axis in table.get(name, ()) if name else ():
            ways = mesh_shape[mesh_axis]
            if mesh_axis in used or ways == 1:
                continue
            if size % (math.prod(mesh_shape[a] for a in kept) * ways):
                if name not in UNSPLIT_AS_A_RULE:
                    log.info("%s: mesh axis %r (size %d) does not divide %s=%d; not sharded "
                             "along it", what, mesh_axis, ways, name, size)
                continue
            kept.append(mesh_axis)
        used.update(kept)
        out.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
    return P(*out)


def param_shardings(specs, mesh: Mesh, mesh_config: MeshConfig):
    """A NamedSharding per parameter of a tree of TensorSpecs (`params.param_specs`), from
    its logical axes and the weight rules. An axis name the rules do not know is an error (a
    new component's typo would otherwise leave its tensors silently replicated)."""
    known = RULE_TABLES["weight_rules"][1]

    def placed(s) -> NamedSharding | Int8:
        unknown = [a for a in s.axes if a not in known]
        if unknown:
            raise ValueError(f"tensor with axes {s.axes}: logical axis name(s) {unknown} are "
                             f"not weight axes ({', '.join(known)})")

        def sharding(shape) -> NamedSharding:
            return NamedSharding(mesh, spec(s.axes, shape, mesh_config.weight_rules, mesh.shape,
                                            "/".join(s.axes)))
        # An int8 weight's scales split like its values, except along the axes they are shared
        # by (size 1).
        return Int8(sharding(s.shape), sharding(s.scale_shape)) if s.dtype == "int8" else \
            sharding(s.shape)
    return map_specs(placed, specs)


def batch_shards(mesh_config: MeshConfig, mesh_shape: Mapping[str, int]) -> int:
    """Into how many parts the batch rule splits a batch (data x fsdp by default)."""
    return math.prod(mesh_shape[a] for a in dict(mesh_config.activation_rules).get("batch", ()))


def batch_sharding(mesh: Mesh, mesh_config: MeshConfig, ndim: int = 2) -> NamedSharding:
    """Token batches `[B, ...]`: rows over the activation rule for "batch"."""
    return NamedSharding(mesh, P(dict(mesh_config.activation_rules).get("batch") or None,
                                 *[None] * (ndim - 1)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


@contextlib.contextmanager
def use_mesh(mesh: Mesh, mesh_config: MeshConfig) -> Iterator[None]:
    """Activates `constrain` for code traced inside the block. It is read at trace time and is
    not part of jit's cache key: a function already traced for the same arguments is not traced
    again under other rules, so jit a fresh function (or pass the rules as a static argument,
    as the decoder does) per rule set."""
    token = _ACTIVE.set((mesh, mesh_config))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def placed(placement: tuple[Mesh, MeshConfig] | None):
    """`use_mesh(*placement)`, or nothing when None: the mesh and rules a program is traced
    under. The decoders pass them as static arguments of their jitted functions, so that jit's
    own trace cache tells apart the same shapes compiled under different rules."""
    return use_mesh(*placement) if placement else contextlib.nullcontext()


def constrain(x: jax.Array, axes: Sequence[str | None],
              table: str = "activation_rules") -> jax.Array:
    """`with_sharding_constraint` by logical axes (of activations, or `table="cache_rules"`),
    when a mesh is active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, mesh_config = active
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, spec(axes, x.shape, getattr(mesh_config, table), mesh.shape)))


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing `use_mesh`, if any: code traced under it is partitioned."""
    active = _ACTIVE.get()
    return None if active is None else active[0]


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of `tree` are laid out on, if they are spread over one."""
    for leaf in jax.tree.leaves(tree):
        placed = getattr(leaf, "sharding", None)
        if isinstance(placed, NamedSharding) and placed.mesh.size > 1:
            return placed.mesh
    return None


def shard_ways(partition: P, mesh_shape: Mapping[str, int]) -> int:
    """Into how many pieces a PartitionSpec cuts an array."""
    names = [n for entry in partition if entry for n in
             ((entry,) if isinstance(entry, str) else entry)]
    return math.prod(mesh_shape[n] for n in names)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of the arrays in `tree`: a shard of each sharded array or
    abstract array (`jax.ShapeDtypeStruct` with a sharding), the whole of a host array."""
    def nbytes(x):
        placed = getattr(x, "sharding", None)
        shape = placed.shard_shape(x.shape) if placed is not None else np.shape(x)
        return math.prod(shape) * np.dtype(x.dtype).itemsize
    return sum(nbytes(x) for x in jax.tree.leaves(tree))


def optimizer_state_shardings(optimizer, abstract_params, params_sharding,
                              mesh: Mesh):
    """The optimizer state laid out like the parameters it mirrors (moments), scalars
    replicated. Explicit, because `jit(optimizer.init)` on an Auto mesh may replicate it."""
    state = jax.eval_shape(optimizer.init, abstract_params)
    # A frozen tensor has no state (`optax.multi_transform` leaves an empty MaskedNode).
    masked = optax.transforms.MaskedNode
    return optax.tree_utils.tree_map_params(
        optimizer, lambda leaf, s: leaf if isinstance(leaf, masked) else s, state,
        params_sharding, transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, masked))


def activation_ways(axis: str, size: int) -> int:
    """Into how many pieces the active mesh's activation rules cut a dimension named `axis` of
    `size` (1 without a mesh)."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh, mesh_config = active
    return shard_ways(spec((axis,), (size,), mesh_config.activation_rules, mesh.shape),
                      mesh.shape)


def per_shard(fn: Callable, in_axes: Sequence[Sequence[str | None]],
              out_axes: Sequence[str | None], table: str = "activation_rules") -> Callable:
    """`fn` run on each device's shard (`jax.shard_map`) when a mesh is active, and `fn` itself
    otherwise: for kernels XLA cannot partition (Pallas calls). Inputs and the output are laid
    out by their logical axes; `fn` must be correct on any shard of them (e.g. per row and
    head)."""
    active = _ACTIVE.get()
    if active is None:
        return fn
    mesh, mesh_config = active
    rules = getattr(mesh_config, table)

    def sharded(*args):
        out_shape = jax.eval_shape(fn, *args).shape
        in_specs = tuple(spec(axes, a.shape, rules, mesh.shape) for axes, a in zip(in_axes, args))
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                             out_specs=spec(out_axes, out_shape, rules, mesh.shape),
                             check_vma=False)(*args)
    return sharded
