"""The compiler's own clock: a compiled program's time per step as XLA prices it, deviceless.

XLA:TPU writes `estimated_cycles` into the backend config of every top-level instruction of its
optimized HLO (fusions, copies, broadcasts: the work its cost model prices). Summed as they
stand they undercount a scanned model badly: a while loop's body is written once, so a 32-layer
scan is priced as one layer (about 1/11 of the step). Here each computation is weighted by the
trip counts of the loops that run it (a scan's condition compares its counter with a constant),
and the cycles become seconds at the chip's clock (`plan.hardware.Hardware.clock_hz`).

What the model does not price, and what this adds (labelled as ours in every report):
- Mosaic kernels (`tpu_custom_call`: splash attention) are priced at ~0. Each splash kernel is
  added at its matmuls' FLOPs at the chip's bf16 peak: forward 2 matmuls, dq 3, dkv 4 (each
  `2·B·N·T·S·H·½`, causal), its shape read from the forward kernel's output.
- Collectives get no cycles. They are listed by kind with their bytes per step and a time at
  the chip's ICI bandwidth (`Hardware.ici_bandwidth`, all links together): a ring's
  `(n-1)/n` of the buffer for all-gather and all-to-all, twice that for all-reduce,
  `(n-1)` shards for reduce-scatter, the buffer for a collective permute. They are not added to
  the step's time: XLA overlaps most of them with compute.

XLA:GPU prices its fusions when asked (`--xla_gpu_collect_cost_model_stats`, which compile-only
GPU reports set): each fusion's backend config then carries a `reification_cost` whose
`exec_time_us` is its performance model's time (`estimate_gpu`). Its library calls it does not
price usefully, and this adds them (ours): GEMMs (cuBLAS calls and XLA's Triton GEMM fusions,
which its models price 10x apart) at the larger of their FLOPs at the bf16 peak and their
operands' and result's bytes at the HBM bandwidth; cuDNN flash attention at its matmuls' FLOPs
(forward 2, backward 5: the scores recomputed, dP, dV, dQ, dK); copies at their bytes; scatter
fusions at what they read but the array they update in place, and their updates (XLA's models
price a scatter as rewriting the whole array: a decode step's KV-cache write of 2 KiB as a
layer's 4 MiB cache, 11% of LLaMA-3 8B's batch-1 step on an H100). For Triton
fusions XLA's indexing cost model is taken (its default model prices a [16, 2048] softmax at
85 ms). A GPU estimate also counts the kernels a call launches (`launches`): every executed
instruction that does work.

Conditionals count their most expensive branch. A loop runs its body the trip count XLA:GPU
writes on it (`known_trip_count`) or, failing that, what its counter says: the constant its
condition compares it with, less its first value, over the step its body adds (XLA:TPU's
windowed einsums step by 2); a loop with neither counts once (reported in `unknown_loops`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections import defaultdict
from typing import Iterable

# An instruction: `[ROOT] %name = SHAPE opcode(operands), attributes`; a tuple SHAPE holds spaces.
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%([\w.\-]+) = (.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*|c64|c128)\[([\d,]*)\]")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_NO_ESTIMATE = 2**63 - 1
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"\b(condition|body|to_apply|true_computation|false_computation|calls)"
                     r"=%([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GPU_COST = re.compile(r'"reification_cost":(\[[^\]]*\])')
CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OPERANDS = re.compile(r"%([\w.\-]+(?:#\d+)?)")  # `%t#3`: element 3 of the tuple %t
# Backend configs are JSON, written compact or spaced (XLA:GPU's cuDNN calls: `"key": [...]`,
# other fields first).
_LHS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]'
                              r"|lhs_contracting_dims=\{([^}]*)\}")
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
# Instructions that launch no kernel on a GPU: bookkeeping, control flow (its bodies' kernels
# count), and the halves of asynchronous pairs (the wrapped computation's kernels count).
NO_KERNEL = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "async-start", "async-update", "async-done", "opt-barrier", "after-all",
    "add-dependency", "partition-id", "replica-id", "domain", "copy-done", "send-done",
    "recv-done"))
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONSTANT = re.compile(r"constant\((-?\d+)\)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Splash kernels by their names' tags: the kind and its matmuls (forward: QKᵀ, PV; dq: QKᵀ,
# dO·Vᵀ, dS·K; dkv: QKᵀ, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q). Another Mosaic kernel is "other", unpriced.
SPLASH_KERNELS = (("_dkv", "dkv", 4), ("_dq", "dq", 3), ("_fwd", "forward", 2))


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of an optimized module; what is read off its text is read once."""

    name: str
    opcode: str
    shape: str  # the result's shape text (a tuple's in parentheses)
    rest: str  # operands and attributes
    root: bool = False  # its computation's result

    @functools.cached_property
    def cycles(self) -> int:
        """XLA:TPU's estimate; 0 where it has none, written as INT64_MAX (seen on its gather
        offload fusions)."""
        cycles = int(found.group(1)) if (found := _CYCLES.search(self.rest)) else 0
        return cycles if cycles < _NO_ESTIMATE else 0

    @functools.cached_property
    def gpu_seconds(self) -> float | None:
        """XLA:GPU's time for a fusion (None: not priced) by the model XLA:GPU itself trusts
        for its kind: the indexing cost model for a Triton fusion (the default performance
        model prices a [16, 2048] softmax at 85 ms there), the default one for the rest."""
        found = _GPU_COST.search(self.rest)
        if not found:
            return None
        model = "indexing-cost-model" if '"kind":"__triton"' in self.rest else ""
        costs = [c for c in json.loads(found.group(1)) if c.get("name") == model]
        return float(costs[0]["exec_time_us"]) * 1e-6 if costs else None

    @functools.cached_property
    def op_name(self) -> str:
        found = _OP_NAME.search(self.rest)
        return found.group(1) if found else ""

    @functools.cached_property
    def target(self) -> str:
        """A custom call's target ("" for other instructions)."""
        found = CUSTOM_CALL_TARGET.search(self.rest) if self.opcode == "custom-call" else None
        return found.group(1) if found else ""


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """An optimized HLO module's text as its computations' instructions, and the entry's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith((" ", "HloModule")):
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(1), [])
                entry = header.group(1) if line.startswith("ENTRY") else entry
            continue
        found = _INSTRUCTION.match(line)
        if found and current is not None:
            current.append(_instruction(found.group(2), found.group(3), bool(found.group(1))))
    return computations, entry


def _instruction(name: str, text: str, root: bool = False) -> Instruction:
    if text.startswith("("):  # a tuple shape: up to its closing parenthesis
        depth = 0
        for end, char in enumerate(text):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape, rest = text[:end + 1], text[end + 2:]
    else:
        shape, _, rest = text.partition(" ")
    opcode, _, rest = rest.partition("(")
    return Instruction(name, opcode, shape, rest, root)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape's arrays (a tuple's summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        width = _BYTES.get(dtype) or max(1, int(re.sub(r"\D", "", dtype)[:3] or 8) // 8)
        total += width * math.prod(int(d) for d in dims.split(",") if d)
    return total


def trip_count(condition: list[Instruction], body: list[Instruction] = (),
               caller: list[Instruction] = (), loop: Instruction | None = None) -> int | None:
    """A loop's trips read off its counter: the condition compares a tuple element with a
    constant (`LT n`, or `LE n`: one more), the body adds a constant step to that element
    (XLA:TPU's windowed einsums, unrolled twice, count 2 a trip), and the `loop`'s input tuple
    in `caller` holds its first value where that is a constant (else 0, as `lax.scan` and
    `fori_loop` start it)."""
    by_name = {i.name: i for i in (*condition, *body, *caller)}
    for instruction in condition:
        if instruction.opcode != "compare":
            continue
        operands = [by_name.get(o) for o in _operands(instruction)]
        bound = [_constant(o) for o in operands if _constant(o) is not None]
        direction = re.search(r"direction=(\w+)", instruction.rest)
        if not (bound and direction and direction.group(1) in ("LT", "GT", "LE", "GE")):
            continue
        end = bound[0] + (direction.group(1) in ("LE", "GE"))
        index = next((_element(o) for o in operands if o is not None
                      and o.opcode == "get-tuple-element"), None)
        if index is None:
            return end
        step = _counter_step(body, by_name, index)
        first = _loop_input(loop, by_name, index)
        return max(0, -(-(end - first) // step))
    return None


def _operands(i: Instruction) -> list[str]:
    """The names of `i`'s operands, in order."""
    return _OPERANDS.findall(i.rest.split(")")[0])


def _operand(i: Instruction | None, n: int, by_name: dict[str, Instruction]
             ) -> Instruction | None:
    """`i`'s operand `n` (None where `i` is None, has fewer, or it is not in `by_name`)."""
    names = _operands(i) if i is not None else []
    return by_name.get(names[n]) if n < len(names) else None


def _constant(i: Instruction | None) -> int | None:
    found = _CONSTANT.search(f"constant({i.rest}") if i is not None and \
        i.opcode == "constant" else None
    return int(found.group(1)) if found else None


def _element(i: Instruction) -> int | None:
    found = re.search(r"\bindex=(\d+)", i.rest)
    return int(found.group(1)) if found else None


def _counter_step(body: list[Instruction], by_name: dict[str, Instruction], index: int) -> int:
    """What the body adds to tuple element `index` per trip (1 unless read)."""
    root = next((i for i in body if i.root and i.opcode == "tuple"), None)
    updated = _operand(root, index, by_name)
    if updated is None or updated.opcode != "add":
        return 1
    steps = [_constant(by_name.get(o)) for o in _operands(updated)]
    return next((s for s in steps if s), 1)


def _loop_input(loop: Instruction | None, by_name: dict[str, Instruction], index: int) -> int:
    """The first value of tuple element `index` of `loop`'s input: a constant, through copies;
    0 where it is not one."""
    init = _operand(loop, 0, by_name)
    value = _operand(init, index, by_name) if init is not None and init.opcode == "tuple" \
        else None
    while value is not None and value.opcode == "copy":
        value = _operand(value, 0, by_name)
    return _constant(value) or 0


def loop_trips(loop: Instruction, computations: dict[str, list[Instruction]],
               called: dict[str, str], caller: str) -> int | None:
    """A while loop's trips: XLA:GPU's `known_trip_count`, else its counter's (`trip_count`)."""
    known = _KNOWN_TRIPS.search(loop.rest)
    if known:
        return int(known.group(1))
    return trip_count(computations.get(called["condition"], []),
                      computations.get(called["body"], []), computations.get(caller, []), loop)


def weights(computations: dict[str, list[Instruction]], entry: str
            ) -> tuple[dict[str, float], list[str]]:
    """How many times each executed computation runs per call of the entry (fusions' bodies
    are not executed computations: their fusion instruction carries the price; an
    asynchronous start's wrapped computation is), and the loops whose trip count could not be
    read (counted once)."""
    weight: dict[str, float] = defaultdict(float)
    unknown: list[str] = []

    def cost(branch: str) -> float:
        return sum(i.cycles + (i.gpu_seconds or 0) for i in computations.get(branch, ()))

    def visit(name: str, times: float) -> None:
        weight[name] += times
        for instruction in computations.get(name, ()):
            called = dict(_CALLED.findall(instruction.rest))
            if instruction.opcode == "while":
                trips = loop_trips(instruction, computations, called, name)
                if trips is None:
                    unknown.append(instruction.name)
                visit(called["body"], times * (trips or 1))
                visit(called["condition"], times * ((trips or 1) + 1))  # checked once more
            elif instruction.opcode == "conditional":
                branches = _branches(instruction, called)
                visit(max(branches, key=cost), times)
            elif instruction.opcode == "call" and "to_apply" in called:
                visit(called["to_apply"], times)
            elif instruction.opcode == "async-start" and "calls" in called:
                visit(called["calls"], times)
    visit(entry, 1.0)
    return dict(weight), unknown


def _branches(instruction: Instruction, called: dict[str, str]) -> list[str]:
    listed = _BRANCHES.search(instruction.rest)
    if listed:
        return re.findall(r"%([\w.\-]+)", listed.group(1))
    return [called[k] for k in ("true_computation", "false_computation") if k in called]


@dataclasses.dataclass(frozen=True)
class CollectiveTotal:
    """One kind of collective over a step, per device."""

    kind: str
    count: float  # executions per step
    bytes: float  # the buffers' bytes per step (all-gather: the gathered result)
    seconds: float | None  # ours: the traffic at the chip's ICI bandwidth (None: no figure)


@dataclasses.dataclass(frozen=True)
class TopOp:
    """Instructions of the same origin (the JAX op that made them), priced per step."""

    name: str
    opcode: str
    count: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """A compiled program's time per call by XLA's own cost model, trip-weighted."""

    model: str  # whose prices: "XLA:TPU cycles" or "XLA:GPU cost model"
    clock_hz: float | None  # a TPU's clock, at which its cycles become seconds
    peak_flops: float  # the chip's bf16 peak (the kernels' rate, and MFU's denominator)
    priced_seconds: float  # trip-weighted: every instruction XLA priced
    unweighted_seconds: float  # the same counting each loop body once (what XLA's sum says)
    kernel_seconds: float  # ours: the kernels XLA does not price (`kernels`), analytically
    kernels: tuple[tuple[str, float], ...]  # those kernels' calls per step by kind
    collectives: tuple[CollectiveTotal, ...]
    top_ops: tuple[TopOp, ...]
    unknown_loops: tuple[str, ...]  # loops counted once: no trip count found
    launches: float | None = None  # GPU: kernels launched per call
    unpriced: float = 0.0  # GPU: of those, the ones neither XLA nor this prices (copies...)

    @property
    def cycles(self) -> float:
        """XLA:TPU's trip-weighted cycles."""
        return self.priced_seconds * self.clock_hz if self.clock_hz else 0.0

    @property
    def unweighted_cycles(self) -> float:
        return self.unweighted_seconds * self.clock_hz if self.clock_hz else 0.0

    @property
    def seconds(self) -> float:
        """The step's estimate: XLA's priced work plus the kernels it does not price
        (collectives apart: most overlap compute)."""
        return self.priced_seconds + self.kernel_seconds

    @property
    def collective_seconds(self) -> float | None:
        times = [c.seconds for c in self.collectives if c.seconds is not None]
        return sum(times) if times else None

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(seconds=self.seconds, cycles=self.cycles,
                   collective_seconds=self.collective_seconds)
        return out

    def mfu(self, model_flops: float) -> float:
        """Model FLOPs utilisation at the estimated time, for `model_flops` per device."""
        return model_flops / (self.seconds * self.peak_flops)

    def report_lines(self, model_flops: float | None = None, top: int = 8) -> list[str]:
        """The estimate as text: the time (and MFU from the model FLOPs per device), then the
        collectives and the top ops."""
        mfu = f"; MFU {self.mfu(model_flops):.1%}" if model_flops else ""
        priced = (f"{self.cycles:.3g} trip-weighted cycles at {self.clock_hz / 1e9:.2f} GHz"
                  if self.clock_hz else "XLA:GPU's fusions, trip-weighted")
        ours = ", ".join(f"{n:g} {kind}" for kind, n in self.kernels) or "none"
        lines = [f"XLA's clock  {duration(self.seconds)} per call estimated{mfu} "
                 f"({priced} = {duration(self.priced_seconds)}; + "
                 f"{duration(self.kernel_seconds)} for the kernels XLA does not price, at "
                 f"their FLOPs (ours: {ours}); "
                 f"each loop body once: {duration(self.unweighted_seconds)})"]
        if self.launches is not None:
            unpriced = f"; {self.unpriced:g} unpriced" if self.unpriced else ""
            lines.append(f"  {self.launches:g} kernels launched per call{unpriced}")
        if self.unknown_loops:
            lines.append(f"  loops counted once (no trip count): "
                         f"{', '.join(self.unknown_loops)}")
        if self.collectives:
            lines.append("  collectives per step (ours: bytes at the ICI bandwidth, not added)")
            for c in self.collectives:
                time = "" if c.seconds is None else f"  ~{duration(c.seconds)}"
                lines.append(f"    {c.kind:<19}{c.count:>7g} x  {c.bytes / 2**30:9.3f} GiB{time}")
        if self.top_ops:
            lines.append("  top ops by estimated time per step")
            for op in self.top_ops[:top]:
                lines.append(f"    {duration(op.seconds):>9}  {op.count:>6g} x {op.opcode:<10} "
                             f"{op.name[-90:]}")
        return lines


def duration(seconds: float) -> str:
    """"1.234 s", "12.3 ms" or "45.6 us"."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def estimate(text: str, clock_hz: float, peak_flops: float,
             ici_bandwidth: float | None = None, top: int = 12) -> StepEstimate:
    """The step's estimate from an optimized HLO module's text (`compiled.as_text()` of an
    XLA:TPU compile) at `clock_hz`; Mosaic kernels at `peak_flops`, collectives at
    `ici_bandwidth` bytes/s (None: bytes only)."""
    executed, weight, computations, unknown = _executed(text)
    kernel_flops, kernels = _kernel_flops(executed)
    return StepEstimate(
        model="XLA:TPU cycles", clock_hz=clock_hz, peak_flops=peak_flops,
        priced_seconds=sum(i.cycles * w for i, w in executed) / clock_hz,
        unweighted_seconds=sum(i.cycles for name in weight for i in computations[name])
        / clock_hz,
        kernel_seconds=kernel_flops / peak_flops, kernels=kernels,
        collectives=collective_totals(executed, ici_bandwidth),
        top_ops=_top_ops(executed, lambda i: i.cycles / clock_hz, top),
        unknown_loops=tuple(unknown))


def estimate_gpu(text: str, peak_flops: float, bandwidth: float,
                 ici_bandwidth: float | None = None, top: int = 12) -> StepEstimate:
    """The step's estimate from an XLA:GPU optimized HLO module's text compiled with
    `--xla_gpu_collect_cost_model_stats`: its fusions at XLA's prices, cuBLAS and cuDNN calls
    at `peak_flops` / `bandwidth` bytes/s (ours), and the kernels launched per call."""
    executed, weight, computations, unknown = _executed(text)
    shapes = _Shapes(computations)
    ours = {id(i): _library_call(i, computations, shapes, peak_flops, bandwidth)
            for i, _ in executed}
    kernels: dict[str, float] = defaultdict(float)
    for i, w in executed:
        if ours[id(i)]:
            kernels[ours[id(i)][0]] += w
    launching = [(i, w) for i, w in executed if i.opcode not in NO_KERNEL]

    def xla(i: Instruction) -> float:  # a GEMM fusion is ours
        return 0.0 if ours[id(i)] else i.gpu_seconds or 0.0
    return StepEstimate(
        model="XLA:GPU cost model", clock_hz=None, peak_flops=peak_flops,
        priced_seconds=sum(xla(i) * w for i, w in executed),
        unweighted_seconds=sum(xla(i) for name in weight for i in computations[name]),
        kernel_seconds=sum(ours[id(i)][1] * w for i, w in executed if ours[id(i)]),
        kernels=tuple(sorted(kernels.items())),
        collectives=collective_totals(executed, ici_bandwidth),
        top_ops=_top_ops(executed, lambda i: xla(i) + (ours[id(i)] or (0, 0))[1], top),
        unknown_loops=tuple(unknown), launches=sum(w for _, w in launching),
        unpriced=sum(w for i, w in launching if i.gpu_seconds is None and not ours[id(i)]))


def _executed(text: str) -> tuple[list[tuple[Instruction, float]], dict[str, float],
                                  dict[str, list[Instruction]], list[str]]:
    """Every executed instruction with its runs per call; the computations' weights; the
    computations; the loops counted once."""
    computations, entry = parse_module(text)
    weight, unknown = weights(computations, entry)
    executed = [(i, weight[name]) for name, instructions in computations.items()
                if name in weight for i in instructions]
    return executed, weight, computations, unknown


def _top_ops(executed: list[tuple[Instruction, float]], seconds, top: int) -> tuple[TopOp, ...]:
    """Instructions grouped by origin (the JAX op that made them), dearest first."""
    by_origin: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for i, w in executed:
        if seconds(i):
            entry = by_origin[(_origin(i.op_name) or i.name, i.opcode)]
            entry[0] += w
            entry[1] += seconds(i) * w
    return tuple(sorted((TopOp(name, opcode, count, total)
                         for (name, opcode), (count, total) in by_origin.items()),
                        key=lambda op: -op.seconds)[:top])


class _Shapes(dict):
    """Instruction name -> result shape, for every instruction of a module; `name#n` gives
    element n of a tuple result (arrays in order: XLA:GPU's flat tuples)."""

    def __init__(self, computations: dict[str, list[Instruction]]):
        super().__init__((i.name, i.shape) for instructions in computations.values()
                         for i in instructions)

    def get(self, name: str, default: str = "") -> str:
        tuple_name, _, index = name.partition("#")
        if not index:
            return super().get(name, default)
        arrays = _ARRAY.finditer(super().get(tuple_name, ""))
        return next((a.group(0) for n, a in enumerate(arrays) if n == int(index)), default)


def _dims(shape: str) -> list[list[int]]:
    """The dimensions of each array in an HLO shape."""
    return [[int(d) for d in dims.split(",") if d] for _, dims in _ARRAY.findall(shape)]


def _library_call(i: Instruction, computations: dict[str, list[Instruction]],
                  shapes: _Shapes, peak_flops: float,
                  bandwidth: float) -> tuple[str, float] | None:
    """(kind, seconds), ours, of a GEMM (a cuBLAS call, or a fusion around a dot: XLA's
    models price those 10x apart), a cuDNN attention call, a copy (its bytes read and
    written) or an in-place scatter fusion; None for other instructions."""
    operands = _operands(i)

    def moved(result: str) -> float:  # the operands read and `result` written, in seconds
        return (sum(shape_bytes(shapes.get(o, "")) for o in operands)
                + shape_bytes(result)) / bandwidth
    if i.opcode == "copy":
        return "copy", moved(i.shape)
    if i.target.startswith("__cublas"):
        out = _ARRAY.search(i.shape).group(0)  # the product; a workspace follows
        return "gemm", max(_dot_flops(i, out, operands, shapes) / peak_flops, moved(out))
    if i.opcode == "fusion":
        called = computations.get(dict(_CALLED.findall(i.rest)).get("calls"), ())
        updated = _updated_in_place(called, shapes)
        if updated is not None:  # read: all but the array updated; written: the updates
            indices, written = updated
            return "scatter", (sum(shape_bytes(shapes.get(o, "")) for n, o in enumerate(operands)
                                   if n not in indices) + written) / bandwidth
        dots = [d for d in called if d.opcode == "dot"]
        if not dots:
            return None
        flops = sum(_dot_flops(d, d.shape, _operands(d), shapes)
                    for d in dots)
        return "gemm", max(flops / peak_flops, moved(i.shape))
    if i.target.startswith("__cudnn$fmha"):
        # its matmuls' FLOPs from the scores' shape [B, N, T, S] (the output's head width),
        # or its operands read and results written, whichever takes longer: a decode step's
        # one query a row reads the cache at far fewer FLOPs a byte than the GPU's ratio
        backward = "Backward" in i.target
        scores = _SCORES.search(i.rest)
        flops = 0.0
        if scores:
            head = _dims(i.shape)[0][-1]
            per_matmul = 2 * math.prod(int(d.strip('" ')) for d in scores.group(1).split(","))
            causal = 0.5 if re.search(r'"mask_type":\s*"CAUSAL"', i.rest) else 1.0
            flops = (5 if backward else 2) * per_matmul * head * causal
        return ("attention backward" if backward else "attention forward",
                max(flops / peak_flops, moved(i.shape)))
    return None


def _updated_in_place(called: list[Instruction],
                      shapes: _Shapes) -> tuple[set[int], int] | None:
    """A scatter fusion's in-place arrays (the fusion's operand numbers) and its updates' bytes;
    None for a fusion without a scatter, or one whose scattered arrays are not the fusion's own
    operands."""
    params = {p.name: int(p.rest.split(")")[0]) for p in called if p.opcode == "parameter"}
    indices, written = set(), 0
    for scatter in (c for c in called if c.opcode == "scatter"):
        args = _operands(scatter)
        n = (len(args) - 1) // 2  # scatter(arrays..., indices, updates...)
        if not all(a in params for a in args[:n]):
            return None
        indices |= {params[a] for a in args[:n]}
        written += sum(shape_bytes(shapes.get(a, "")) for a in args[n + 1:])
    return (indices, written) if indices else None


def _dot_flops(i: Instruction, out: str, operands: list[str], shapes: _Shapes) -> float:
    """2 x the product's elements x the contracted size (read off the left operand)."""
    lhs = _dims(shapes.get(operands[0], "")) if operands else []
    contracting = _LHS_CONTRACTING.search(i.rest)
    if not lhs or not contracting:
        return 0.0
    dims = (contracting.group(1) or contracting.group(2) or "").replace('"', "")
    k = math.prod(lhs[0][int(d)] for d in dims.split(",") if d)
    return 2.0 * math.prod(_dims(out)[0]) * k


# The wrappers JAX writes into a training step's op names (jax 0.10 and 0.12), in words.
_WRAPPERS = ((r"^jit\([^)]*\)/", ""), (r"transpose\(jvp\(\)\)", "backward"),
             (r"jvp\(\)", "forward"), (r"/while/body/(closed_call|eval_jaxpr)", " layer"),
             (r"/checkpoint/rematted_computation", " recomputed"), (r"/checkpoint", ""))


def _origin(op_name: str) -> str:
    """A JAX op name without the `jit(...)` of its program, its wrappers in words."""
    for wrapper, words in _WRAPPERS:
        op_name = re.sub(wrapper, words, op_name)
    return op_name


def _kernel_flops(executed: Iterable[tuple[Instruction, float]]
                  ) -> tuple[float, tuple[tuple[str, float], ...]]:
    """Mosaic kernels' FLOPs per step (splash attention's, by their names) and their calls
    by kind."""
    calls = [(i, w) for i, w in executed
             if i.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in i.rest]
    per_matmul = 0.0
    for i, _ in calls:  # B·N·T·H from the forward kernel's attention output, S = T
        if "_fwd" in i.name:
            outputs = [[int(d) for d in dims.split(",") if d] for _, dims in _ARRAY.findall(i.shape)]
            out = max((o for o in outputs if len(o) >= 3), key=math.prod, default=None)
            if out:
                per_matmul = max(per_matmul, 2 * math.prod(out) * out[-2] / 2)
    flops, counts = 0.0, defaultdict(float)
    for i, w in calls:
        kind, matmuls = next(((kind, n) for tag, kind, n in SPLASH_KERNELS if tag in i.name),
                             ("other", 0))
        flops += matmuls * per_matmul * w
        counts[kind] += w
    return flops, tuple(sorted(counts.items()))


def group_size(instruction: Instruction) -> int | None:
    """The number of devices in each of a collective's replica groups, where it says."""
    listed = _GROUPS_LIST.search(instruction.rest)
    if listed:
        return len(listed.group(1).split(","))
    iota = _GROUPS_IOTA.search(instruction.rest)
    if iota:
        return int(iota.group(2))
    mesh = _GROUPS_MESH.search(instruction.rest)  # mesh['a'=4,'b'=64] {'b'}: the named axes
    if mesh:
        sizes = {name: int(n) for name, n in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes[name] for name in re.findall(r"'([^']+)'", mesh.group(2)))
    return None


# Each kind's traffic per device in multiples of its result's bytes, for a group of n (None:
# a group whose size the instruction does not say; all but reduce-scatter have a limit).
_TRAFFIC = {"all-gather": lambda n: 1.0 if n is None else (n - 1) / n,
            "all-reduce": lambda n: 2.0 if n is None else 2 * (n - 1) / n,
            "reduce-scatter": lambda n: None if n is None else n - 1,
            "all-to-all": lambda n: 1.0 if n is None else (n - 1) / n,
            "collective-permute": lambda n: 1.0}


def _collective_kind(i: Instruction) -> str | None:
    """A collective's kind: synchronous ones, the `-done` halves of asynchronous ones (whose
    result is the collective's), and XLA:TPU's reduce-scatter, a fusion that calls an
    `all-reduce-scatter` computation."""
    if i.opcode == "fusion" and "calls=%all-reduce-scatter" in i.rest:
        return "reduce-scatter"
    kind = i.opcode.removesuffix("-done")
    return kind if kind in COLLECTIVES and not i.opcode.endswith("-start") else None


def collective_totals(executed: Iterable[tuple[Instruction, float]],
                      ici_bandwidth: float | None) -> tuple[CollectiveTotal, ...]:
    """Collectives per step by kind (`_collective_kind`), weighted by trip counts."""
    totals: dict[str, list[float]] = {}
    for i, w in executed:
        kind = _collective_kind(i)
        if kind is None:
            continue
        factor = _TRAFFIC[kind](group_size(i))
        size = shape_bytes(i.shape)
        entry = totals.setdefault(kind, [0.0, 0.0, 0.0])
        entry[0] += w
        entry[1] += size * w
        entry[2] += float("nan") if factor is None else factor * size * w
    return tuple(CollectiveTotal(kind, count, size, traffic / ici_bandwidth
                                 if ici_bandwidth and not math.isnan(traffic) else None)
                 for kind, (count, size, traffic) in sorted(totals.items()))
