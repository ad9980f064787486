"""A decode step's attention on one NVIDIA GPU: the unrolled decoder's XLA path against cuDNN's
fused attention, at LLaMA-3 8B's heads (N=32 queries, K=8 key/value heads, H=128), bf16.

    python bench/decode_attention.py [--batches 1 8] [--contexts 2048 8192] [--calls 50]
    python bench/decode_attention.py --topology h100x1     # deviceless: kernels and estimates

The XLA path is the library's (`decode_attention_block_diagonal` over a layer's merged cache
`[B, K·S, H]`: a scores GEMM, the softmax, a values GEMM and its split-K sum). The cuDNN path
calls jax's cuDNN attention on the cache's `[B, K, S, H]` view as it is (`qkv_layout="BNTH"`),
each row's keys up to its end (`kv_seqlen`; the decoders' rows start at slot 0). jax.nn's
public call takes the keys only as `[B, S, K, H]`, which would copy the cache each step, so
this calls jax's own cuDNN module (private: the jax version is printed).

Random queries and caches, each row ending at a random slot in the second half of its S. Per
case: the largest difference of each path from a float64 reference (the XLA path's is the
bound the cuDNN path must meet), microseconds a call (median of `--calls` after a warm-up,
dispatch included, alike for both), and the kernels a call launches with XLA's estimate of
its time (from the optimized module; cuDNN's kernel priced at its FLOPs and bytes). With
`--topology`, the same programs compiled for that GPU without one: kernels and estimates
only. Prints a table; `--out FILE` writes the rows as JSON. `bash bench/lease.sh attention`
runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as cudnn

from llama_jax.aot.compiled import compile_program
from llama_jax.nn.attention.dot_product import decode_attention_block_diagonal
from llama_jax.parallel import target, topology
from llama_jax.plan.hardware import HARDWARE

N, K, H = 32, 8, 128
SCALE = H ** -0.5


def xla_path(q_BTNH, k_BCH, v_BCH, end_B):
    S = k_BCH.shape[1] // K
    mask_BTS = jnp.arange(S)[None, None, :] <= end_B[:, None, None]
    return decode_attention_block_diagonal(q_BTNH, k_BCH, v_BCH, mask_BTS, SCALE)


def cudnn_path(q_BTNH, k_BCH, v_BCH, end_B):
    B, S = q_BTNH.shape[0], k_BCH.shape[1] // K
    k_BKSH, v_BKSH = (a.reshape(B, K, S, H) for a in (k_BCH, v_BCH))  # the same buffers
    out_BNTH = cudnn.dot_product_attention(
        jnp.swapaxes(q_BTNH, 1, 2), k_BKSH, v_BKSH, q_seqlen=jnp.ones((B,), jnp.int32),
        kv_seqlen=end_B + 1, scale=SCALE, mask_type=cudnn.MaskType.PADDING, qkv_layout="BNTH")
    return jnp.swapaxes(out_BNTH, 1, 2)


PATHS = {"xla": xla_path, "cudnn": cudnn_path}


def inputs(batch: int, context: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, 1, N, H))
    k, v = (rng.standard_normal((batch, K * context, H)) for _ in range(2))
    end = rng.integers(context // 2, context, batch).astype(np.int32)  # each row's last slot
    return q, k, v, end


def reference(q, k, v, end) -> np.ndarray:
    """float64 attention of each row's query heads over its KV head's slots 0..end."""
    B, S = q.shape[0], k.shape[1] // K
    out = np.zeros(q.shape)
    for b in range(B):
        for n in range(N):
            rows = slice((n // (N // K)) * S, (n // (N // K)) * S + end[b] + 1)
            scores = k[b, rows] @ q[b, 0, n] * SCALE
            p = np.exp(scores - scores.max())
            out[b, 0, n] = (p / p.sum()) @ v[b, rows]
    return out


def compiled(path: str, args, device, chip):
    """The path's program for `device` and XLA's (or our) estimate of it."""
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                   sharding=jax.sharding.SingleDeviceSharding(device))
              for a in args]
    with target.compiling_for([device]):
        memory, program = compile_program(
            path, lambda: jax.jit(PATHS[path]).lower(*placed), target.compiler_options(),
            "gpu", chip)
    return memory.clock, program


def microseconds(program, args, calls: int) -> float:
    program(*args).block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        program(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def case(batch: int, context: int, device, chip, calls: int | None) -> list[dict]:
    host = inputs(batch, context)
    args = [jnp.asarray(a, jnp.bfloat16 if a.dtype == np.float64 else a.dtype) for a in host]
    want = reference(*host) if calls else None
    rows = []
    for path in PATHS:
        clock, program = compiled(path, args, device, chip)
        row = dict(path=path, batch=batch, context=context, kernels=clock.launches,
                   estimated_us=1e6 * clock.seconds)
        if calls:  # on the device
            got = np.asarray(program(*args), np.float64)
            row.update(max_error=float(np.abs(got - want).max()),
                       us=microseconds(program, args, calls))
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    measured = "us" in rows[0]
    head = "| batch | context | path | kernels | XLA's estimate, µs |"
    head += " µs a call | largest error vs float64 |" if measured else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['batch']} | {r['context']} | {r['path']} | {r['kernels']:g} | "
                f"{r['estimated_us']:.1f} |")
        if measured:
            line += f" {r['us']:.1f} | {r['max_error']:.2e} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--topology", help="compile for this GPU without one (e.g. h100x1)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.topology:
        named = topology.parse(args.topology)
        device, chip, calls = topology.devices(named)[0], HARDWARE[named.hardware], None
    else:
        device = jax.devices()[0]
        chip = next(h for h in HARDWARE.values()
                    if h.backend == "gpu" and device.device_kind.startswith(h.device_kinds))
        calls = args.calls
    print(f"{device.device_kind}, jax {jax.__version__}")
    rows = [r for batch in args.batches for context in args.contexts
            for r in case(batch, context, device, chip, calls)]
    print(render(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
