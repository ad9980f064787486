"""Cold compile time of the forward pass and of a full training step at several depths.

    python bench/compile_time.py [--layers 4 16 64] [--repeats 3] [--unrolled]

Each measurement runs in a fresh process (a cold JAX cache): trace + lower + XLA compile of
`jax.jit(forward)` and of a training step (loss, grad, optax AdamW update) on abstract inputs
(no weights allocated), and of the decoder's prefill + decode executables under both decode
implementations (as `generate` reports them). Width: D=512,
N=8, K=4, F=1536, V=8192, batch 8, seq 256 (the shape of the other benchmarks). Prints medians
over `--repeats` processes and the ratio to the shallowest depth; `--unrolled` adds the same
with `scan_layers=False` for contrast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import run_child

WIDTH = dict(vocab_size=8192, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=256)
BATCH, SEQ = 8, 256


def measure(n_layers: int, scan: bool) -> dict[str, float]:
    """Compile seconds of forward and train step for one depth (run in a fresh process)."""
    import jax
    import jax.numpy as jnp
    import optax

    import llama_jax
    from llama_jax.model.params import abstract_params

    config = llama_jax.ModelConfig(n_layers=n_layers, scan_layers=scan, **WIDTH)
    params = abstract_params(config)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
    optimizer = optax.adamw(1e-3)
    opt_state = jax.eval_shape(optimizer.init, params)

    def loss_fn(p, toks):
        logits = llama_jax.forward(config, p, toks[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

    def train_step(p, state, toks):
        loss, grads = jax.value_and_grad(loss_fn)(p, toks)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    def forward(p, toks):
        return llama_jax.forward(config, p, toks[:, :-1])

    def compile_seconds(fn, *args) -> float:
        start = time.perf_counter()
        jax.jit(fn).lower(*args).compile()
        return time.perf_counter() - start

    result = {"forward": compile_seconds(forward, params, tokens),
              "train_step": compile_seconds(train_step, params, opt_state, tokens)}
    if scan:  # the decoder does not depend on scan_layers
        for impl in ("scan", "unrolled"):
            result[f"decode_{impl}"] = decode_compile_seconds(config, impl)
    return result


def decode_compile_seconds(config, decode_impl: str) -> float:
    """Prefill + decode compile seconds of `generate` (batch 1, a 128-token prompt, 128 new
    tokens) under one decode implementation, as its own stats report them."""
    import jax

    import llama_jax
    from llama_jax.decode.generate import GenerationStats

    params = llama_jax.init_params(config, jax.random.key(0))
    stats = GenerationStats()
    llama_jax.generate(config, params, [[1] * 128], 128, stop_tokens=[], decode_impl=decode_impl,
                       stats=stats)
    return stats.compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unrolled", action="store_true", help="also measure scan_layers=False")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], bool(args.child[1]))))
        return

    print(f"width {WIDTH}, batch {BATCH}, seq {SEQ}; median of {args.repeats} cold processes")
    print("| layers | layout | forward compile s | train step compile s | forward / shallowest "
          "| train / shallowest | decode compile s, scan | decode compile s, unrolled |")
    print("|---|---|---|---|---|---|---|---|")
    for scan in [True, False] if args.unrolled else [True]:
        base = None
        for n_layers in args.layers:
            runs = [run_child(__file__, "--child", str(n_layers), str(int(scan)))
                    for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            base = base or med
            decode = [f"{med[k]:.2f}" if k in med else "-"
                      for k in ("decode_scan", "decode_unrolled")]
            print(f"| {n_layers} | {'scan' if scan else 'unrolled'} | {med['forward']:.2f} | "
                  f"{med['train_step']:.2f} | {med['forward'] / base['forward']:.2f}x | "
                  f"{med['train_step'] / base['train_step']:.2f}x | {' | '.join(decode)} |",
                  flush=True)


if __name__ == "__main__":
    main()
