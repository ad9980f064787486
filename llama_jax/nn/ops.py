"""Matmul building blocks: a mixed-precision einsum and the dense projection every component uses.

Matmuls accumulate in fp32 (`preferred_element_type`) whatever the compute dtype, and 32-bit
operands are multiplied at full precision (`matmul_precision`). A weight may be int8
(`quant.Int8`): its values enter the matmul as they are and its scales multiply the side
they are constant along (`_int8_einsum`), so no dequantized copy of the weight is made.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from llama_jax.nn.lora import (delta as lora_delta, delta_equations as lora_delta_equations,
                               dropped as lora_dropped, is_lora)
from llama_jax.quant import Int8, is_int8
from llama_jax.parallel import target
from llama_jax.parallel.sharding import constrain


def einsum_f32(equation: str, a: jax.Array, b: jax.Array | Int8) -> jax.Array:
    """`einsum` with fp32 accumulation and an fp32 result, for operands of any float dtype
    (and an int8 weight `b`).

    XLA:CPU has no bf16 x bf16 -> fp32 kernel for every dot shape (it fails at run time with
    "Unsupported element type for DotThunk"), so on CPU 16-bit operands are widened first —
    the same numbers, since products of bf16/fp16 values are exact in fp32. Accelerators get
    `preferred_element_type` and keep their 16-bit inputs.
    """
    if is_int8(b):
        return _int8_einsum(equation, a, b)
    if is_lora(b):  # a MoE's experts' weights with their adapters (lora.py)
        to_rank, from_rank = lora_delta_equations(equation)
        h = einsum_f32(to_rank, lora_dropped(a, b), b.a).astype(a.dtype)
        return einsum_f32(equation, a, b.base) + b.scale * einsum_f32(from_rank, h, b.b)
    precision = matmul_precision(a, b)
    a, b = _widened_on_cpu(a, b)
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32, precision=precision)


def _int8_einsum(equation: str, x: jax.Array, w: Int8) -> jax.Array:
    """x·w with w's int8 values in the matmul. Per output channel scales (constant along the
    contracted axes) multiply the output; scales constant along the output axes (a weight
    contracted along other axes than it was quantized for: MLA's absorbed W_UK) multiply the
    input; anything else is dequantized first."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    kept = {c for c, n in zip(rhs, w.scale.shape) if n != 1}
    if kept <= set(out):
        return einsum_f32(equation, x, w.values) * _aligned(w.scale, rhs, out)
    if kept <= set(lhs):
        return einsum_f32(equation, x * _aligned(w.scale, rhs, lhs).astype(x.dtype), w.values)
    return einsum_f32(equation, x, w.dequantize(x.dtype))


def _aligned(scale: jax.Array, letters: str, target: str) -> jax.Array:
    """`scale` (axes `letters`, size 1 along those not in `target`) laid out to broadcast
    against an array of axes `target`."""
    common = "".join(c for c in target if c in letters)
    shape = [scale.shape[letters.index(c)] if c in letters else 1 for c in target]
    return jnp.einsum(f"{letters}->{common}", scale).reshape(shape)


def matmul_precision(a: jax.Array, b: jax.Array) -> jax.lax.Precision:
    """HIGHEST when the operands (as promoted) are 32-bit or wider, else DEFAULT.

    At DEFAULT, GPUs multiply fp32 matrices as TF32 (10-bit mantissa) and TPUs as one bf16
    pass: an fp32 model's logits then differ from the CPU's by ~1e-3 relative (measured on an
    H100: 8.7e-4), where an fp32 model must compute in fp32. 16-bit operands need nothing more:
    their products are exact in the fp32 accumulator.
    """
    wide = jnp.result_type(a, b).itemsize >= 4
    return jax.lax.Precision.HIGHEST if wide else jax.lax.Precision.DEFAULT


def einsum_f32_grads(equation: str, a: jax.Array, b: jax.Array, ct: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """The gradients of `einsum_f32(equation, a, b)` for the cotangent `ct`, each in its
    operand's dtype: two matmuls with fp32 accumulation, whose operands are `ct` as given and
    the other operand (pass a 16-bit `ct` for 16-bit matmuls). Needs each index in the output
    or in both operands (a matmul)."""
    (lhs, rhs), out = equation.split("->")[0].split(","), equation.split("->")[1]
    return (einsum_f32(f"{out},{rhs}->{lhs}", ct, b).astype(a.dtype),
            einsum_f32(f"{lhs},{out}->{rhs}", a, ct).astype(b.dtype))


def _widened_on_cpu(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """16-bit operands widened to fp32 when compiling for a CPU (see `einsum_f32`); unchanged
    elsewhere."""
    if target.platform() != "cpu":
        return a, b
    return (a.astype(jnp.promote_types(a.dtype, jnp.float32)),
            b.astype(jnp.promote_types(b.dtype, jnp.float32)))


def grouped_f32(rows: jax.Array, w_EIO: jax.Array | Int8, sizes_E: jax.Array) -> jax.Array:
    """Grouped matmul (`jax.lax.ragged_dot`): consecutive runs of `sizes_E[e]` rows times
    `w_EIO[e]`, fp32 result; widened on CPU as in `einsum_f32`. An int8 `w_EIO`'s scales
    `[E, 1, O]` multiply each row's output by its expert's."""
    if is_lora(w_EIO):  # the experts' adapters: grouped like their weights (lora.py)
        h = grouped_f32(lora_dropped(rows, w_EIO), w_EIO.a, sizes_E).astype(rows.dtype)
        return (grouped_f32(rows, w_EIO.base, sizes_E)
                + w_EIO.scale * grouped_f32(h, w_EIO.b, sizes_E))
    if is_int8(w_EIO):
        expert_of_row = jnp.repeat(jnp.arange(w_EIO.shape[0]), sizes_E,
                                   total_repeat_length=rows.shape[0])
        return grouped_f32(rows, w_EIO.values, sizes_E) * w_EIO.scale[expert_of_row, 0]
    w_EIO = w_EIO.astype(rows.dtype)
    precision = matmul_precision(rows, w_EIO)
    rows, w_EIO = _widened_on_cpu(rows, w_EIO)
    return jax.lax.ragged_dot(rows, w_EIO, sizes_E, preferred_element_type=jnp.float32,
                              precision=precision)


# XLA rewrites a dot of very few rows into multiplies and a reduction. XLA:TPU runs those on the
# vector units: LLaMA-3 8B's batch-1 decode step is priced at 3.1x its HBM floor that way, 2.0x
# with its matmuls' rows padded to 8 (they stay on the MXUs, reading each weight once as
# before; the padding's products are thrown away). XLA:GPU wrote the products of one row and
# the K/V weights to memory in fp32 before reducing them (2x the weights' bytes, each way);
# with 8 rows it runs GEMM fusions (q/k/v merged into one, int8 weights dequantized inside
# them): XLA:GPU's clock priced a 2-layer LLaMA-3 8B's unrolled step on an H100 at 1.18x its
# floor before, 1.04x after. A matmul contracting two axes (W_O's, over heads x features)
# XLA:GPU runs as a GEMM fusion at one row too, so it is not padded there: the pad was a
# kernel of its own (LLaMA-3 8B's batch-1 step: one kernel a layer fewer, bf16 or int8).
MIN_ROWS = 8


def row_tiled(matmul: Callable[[jax.Array], jax.Array], x: jax.Array, n_in: int) -> jax.Array:
    """`matmul(x)`; in a program compiled for an accelerator, when `x`'s rows (every axis but
    its last `n_in`, the contracted ones) are fewer than MIN_ROWS, computed on `x` with zero
    rows added along its first axis up to that many, the result's added rows dropped (on a
    GPU, only for a matmul contracting one axis)."""
    per_lead = math.prod(x.shape[1:x.ndim - n_in])
    platform = target.platform()
    if (platform == "cpu" or x.shape[0] * per_lead >= MIN_ROWS
            or (platform == "gpu" and n_in > 1)):
        return matmul(x)
    extra = -(-MIN_ROWS // per_lead) - x.shape[0]
    return matmul(jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1)))[:x.shape[0]]


def dense(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(equation, x, w)` in x's dtype with fp32 accumulation; w is cast to x's dtype.

    Casting the weights here is what separates the parameter dtype (e.g. fp32 master weights)
    from the compute dtype (e.g. bf16) without a second copy of the parameters.
    """
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    n_in = len(set(lhs) & set(rhs))
    assert lhs[-n_in:] == rhs[:n_in] and out == lhs[:-n_in] + rhs[n_in:], equation
    if is_lora(w):  # a low-rank adapter beside the frozen weight (lora.py)
        y = dense(equation, x, w.base)
        x_MK = x.reshape(-1, math.prod(x.shape[x.ndim - n_in:]))
        return (y + lora_delta(x_MK, w).reshape(y.shape)).astype(y.dtype)
    return row_tiled(lambda x: _dense(equation, x, w, n_in), x, n_in)


def _dense(equation: str, x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """`dense` of `x` as given: the einsum on accelerators, one 2-D matmul on CPUs."""
    if not is_int8(w) and target.platform() != "cpu":
        # The einsum as written: the partitioner then gathers each FSDP weight as it is stored,
        # where reshaping first made XLA:TPU gather transposed copies as well.
        return einsum_f32(equation, x, cast_weight(w, x.dtype)).astype(x.dtype)
    # As one 2-D matmul (rows x contracted): XLA:CPU runs these faster than the N-D einsum.
    rows, contracted = x.shape[:x.ndim - n_in], math.prod(x.shape[x.ndim - n_in:])
    x_MK = x.reshape(-1, contracted)
    if is_int8(w):  # per output channel: scales [1, ..., 1, outputs]
        y = _int8_matmul(x_MK, w.values.reshape(contracted, -1)) * w.scale.reshape(1, -1)
    else:
        y = einsum_f32("MK,KN->MN", x_MK, cast_weight(w, x.dtype).reshape(contracted, -1))
    return y.reshape(*rows, *w.shape[n_in:]).astype(x.dtype)


# XLA:CPU has no int8 x fp32 matmul: it widens an int8 weight to fp32 for the dot, and in the
# decode loop it hoists that widening out of the loop, so every step reads an fp32 copy of
# the weights (4x the int8 bytes, held for the whole call). Widened a slice of this many rows
# at a time inside a scan, each fp32 slice stays in cache and the weights stay int8 (measured
# on the benchmark model's matmuls in a decode-like loop: 0.84x the fp32 step; 256 of 32-512).
CPU_INT8_SLICE = 256


def _int8_matmul(x_MK: jax.Array, values_KN: jax.Array) -> jax.Array:
    """x·values in fp32, for int8 `values_KN`: in K-slices when compiling for a CPU (see
    CPU_INT8_SLICE), one matmul elsewhere."""
    K, c = values_KN.shape[0], CPU_INT8_SLICE
    if target.platform() != "cpu" or K % c or K == c:
        return einsum_f32("MK,KN->MN", x_MK, values_KN)

    def add_slice(acc_MN, slice_):
        x_Mc, values_cN = slice_
        return acc_MN + einsum_f32("Mc,cN->MN", x_Mc, values_cN), None

    x_SMc = jnp.swapaxes(x_MK.reshape(x_MK.shape[0], K // c, c), 0, 1)
    acc_MN = jnp.zeros((x_MK.shape[0], values_KN.shape[1]), jnp.float32)
    return jax.lax.scan(add_slice, acc_MN, (x_SMc, values_KN.reshape(K // c, c, -1)))[0]


def linear(equation: str, x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """`dense`, plus a bias (cast to the result's dtype) when the layer has one."""
    y = dense(equation, x, w)
    return y if b is None else y + b.astype(y.dtype)


def cast_weight(w: jax.Array | Int8, dtype) -> jax.Array | Int8:
    """A float weight in the compute dtype; an int8 one as it is (`einsum_f32` takes it)."""
    return w if is_int8(w) else w.astype(dtype)


def lookup(table_VD: jax.Array | Int8, tokens: jax.Array, dtype) -> jax.Array:
    """Rows of an embedding table (float or int8, one scale per row) in `dtype`."""
    if is_int8(table_VD):
        rows = jnp.take(table_VD.values, tokens, axis=0).astype(jnp.float32)
        return (rows * jnp.take(table_VD.scale, tokens, axis=0)).astype(dtype)
    return _rows(table_VD, tokens, jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rows(table_VD: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """A float table's rows for `tokens`, in `dtype`. Its gradient is autodiff's (each
    token's row of the cotangent scatter-added into the table's dtype), with the rows moved to
    the table's layout in the dtype they arrive in, before they are widened: the partitioner
    moves them (an all-to-all under FSDP) after the widening otherwise, twice the bytes of bf16
    rows for the same values. LLaMA-3 8B on a v5p-512: 0.06 GiB a step."""
    return jnp.take(table_VD, tokens, axis=0).astype(dtype)


def _rows_forward(table_VD, tokens, dtype):
    return _rows(table_VD, tokens, dtype), (table_VD, tokens)


def _rows_backward(dtype, residuals, d_rows):
    table_VD, tokens = residuals
    # to the table's layout: every row, the width split as the table's is
    d_rows = constrain(d_rows, (None,) * tokens.ndim + ("embed",), table="weight_rules")
    return jnp.zeros_like(table_VD).at[tokens].add(d_rows.astype(table_VD.dtype)), None


_rows.defvjp(_rows_forward, _rows_backward)


def fenced(x):
    """`x` (an array or a tuple of them), materialised as it is before any use when compiling
    for a TPU (`optimization_barrier`): XLA:TPU cannot fuse the ops that make it into the ops
    that use it. Where XLA:TPU's own clock prices such fusions dearer than the memory pass they
    save (an elementwise chain recomputed in a matmul's prologue or epilogue, per tile), a
    fence gets the cheaper program. Elsewhere unmeasured, so left to XLA."""
    return jax.lax.optimization_barrier(x) if target.platform() == "tpu" else x


@jax.custom_vjp
def fenced_cotangent(x: jax.Array) -> jax.Array:
    """`x`; in the backward pass its cotangent is `fenced`."""
    return x


fenced_cotangent.defvjp(lambda x: (x, None), lambda _, ct: (fenced(ct),))
