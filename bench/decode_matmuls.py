"""The matmuls of a CPU decode step: the benchmark model's 8 SwiGLU MLPs (D=512, F=1536) applied
to B rows, as one jitted program in the layout our decoder uses (weights [in, out],
activations [B, in]) and with the weights stored [out, in] and the activations kept [in, B];
against the same chain in PyTorch (eager, fp32). B=1 reads each weight once for one row: the
bandwidth floor of the chain. This is where a serving step of 8 rows spends most of its time
on a CPU (BENCHMARKS.md, "Serving").

    python bench/decode_matmuls.py [--rounds 3] [--rows 1 8 16]

Each implementation runs in its own process per round (rounds alternate); medians of rounds,
each round the median of 100 calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from common import BENCH_MODEL, run_child

IMPLS = ("ours", "weights_first", "torch")


def chain_weights(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(W_gate [D, F], W_up [D, F], W_down [F, D]) of each layer."""
    D, F = BENCH_MODEL.dim, BENCH_MODEL.ffn_dim
    rng = np.random.default_rng(seed)
    return [tuple((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
                  for shape in ((D, F), (D, F), (F, D))) for _ in range(BENCH_MODEL.n_layers)]


def median_ms(f, calls: int = 100) -> float:
    f()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def child(impl: str, rows: int) -> float:
    weights = chain_weights()
    x_BD = np.random.default_rng(1).standard_normal((rows, BENCH_MODEL.dim), np.float32)
    if impl == "torch":
        import torch

        layers = [tuple(torch.from_numpy(w) for w in layer) for layer in weights]
        x = torch.from_numpy(x_BD)

        def run():
            h = x
            for w_gate, w_up, w_down in layers:
                h = h + (torch.nn.functional.silu(h @ w_gate) * (h @ w_up)) @ w_down
            return h
        return median_ms(run)

    import jax
    import jax.numpy as jnp

    if impl == "ours":
        layers = [tuple(jnp.asarray(w) for w in layer) for layer in weights]

        @jax.jit
        def chain(x_BD, layers):
            for w_gate_DF, w_up_DF, w_down_FD in layers:
                x_BD = x_BD + (jax.nn.silu(x_BD @ w_gate_DF) * (x_BD @ w_up_DF)) @ w_down_FD
            return x_BD
        x = jnp.asarray(x_BD)
    else:  # weights stored [out, in]; activations [in, B] throughout
        layers = [tuple(jnp.asarray(np.ascontiguousarray(w.T)) for w in layer)
                  for layer in weights]

        @jax.jit
        def chain(x_DB, layers):
            for w_gate_FD, w_up_FD, w_down_DF in layers:
                x_DB = x_DB + w_down_DF @ (jax.nn.silu(w_gate_FD @ x_DB) * (w_up_FD @ x_DB))
            return x_DB
        x = jnp.asarray(np.ascontiguousarray(x_BD.T))
    return median_ms(lambda: chain(x, layers).block_until_ready())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"ms": child(args.child[0], int(args.child[1]))}))
        return
    times = {(impl, B): [] for impl in IMPLS for B in args.rows}
    for _ in range(args.rounds):
        for B in args.rows:
            for impl in IMPLS:
                times[impl, B].append(run_child(__file__, "--child", impl, str(B))["ms"])
    print(f"8 SwiGLU MLPs (D={BENCH_MODEL.dim}, F={BENCH_MODEL.ffn_dim}), fp32, "
          f"median of {args.rounds} rounds, ms per call")
    print("| rows | ours | weights [out, in] | torch | ours vs torch | [out, in] vs ours |")
    print("|---|---|---|---|---|---|")
    for B in args.rows:
        ours, first, torch = (statistics.median(times[impl, B]) for impl in IMPLS)
        print(f"| {B} | {ours:.2f} | {first:.2f} | {torch:.2f} | {torch / ours:.2f}x | "
              f"{ours / first:.2f}x |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
