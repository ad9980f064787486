"""A TPU server's decode program on XLA:TPU's clock, deviceless: its attention over the pool of
pages gathered (the pure-JAX path) against read in place by Pallas's paged attention kernel
(nn/attention/paged_kernel.py), both compiled for one v5e chip by `aot.serving`.

    TPU_LIBRARY_PATH=$PWD/../.venv/libtpu/libtpu/libtpu.so python paged_kernel_clock.py \
        [--config llama3.2-3b] [--max-batch 8] [--max-seq-len 2048]

XLA prices the gather and the matmuls it runs; it prices a Mosaic kernel at ~0, so the
kernel's side adds its reads at the chip's HBM bandwidth, as if every row were as long as
the program's table (the most it reads): every layer's keys and values of every row's pages.
"""

from __future__ import annotations

import argparse
import sys

from llama_jax import load_run_config
from llama_jax.aot.serving import compile_serving
from llama_jax.nn.attention import paged_kernel
from llama_jax.plan.hardware import hardware


def decode_seconds(config, max_batch: int, max_seq_len: int, kernel: bool):
    """XLA:TPU's time for the decode program's dispatch (its steps) on one v5e chip, and the
    server's report."""
    applies = paged_kernel.applies
    if not kernel:
        paged_kernel.applies = lambda *_: False
    try:
        report = compile_serving(config, "v5e-1", max_batch=max_batch, max_seq_len=max_seq_len,
                                 cache_dtype="bfloat16")
    finally:
        paged_kernel.applies = applies
    (decode,) = [p for p in report.programs if p.name == "decode"]
    assert ("tpu_custom_call" in decode.custom_calls) == kernel, decode.custom_calls
    return decode.clock.seconds, report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama3.2-3b")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    config = load_run_config(args.config, ["model.compute_dtype=bfloat16",
                                           "model.param_dtype=bfloat16"]).model
    gathered, report = decode_seconds(config, args.max_batch, args.max_seq_len, kernel=False)
    in_place, _ = decode_seconds(config, args.max_batch, args.max_seq_len, kernel=True)
    chip = hardware("v5e")
    steps = 4  # the server's default dispatch (SERVING_STEPS_PER_DISPATCH)
    reads = (steps * config.n_layers * args.max_batch * 2 * config.K * report.cache_len
             * config.H * 2)
    kernel_s = reads / chip.bandwidth
    print(f"# {args.config}, bf16, {args.max_batch} rows, table of {report.cache_len} "
          f"positions, {steps} steps a dispatch, one v5e chip (XLA:TPU's clock)")
    print(f"gathered: {gathered * 1e3:.2f} ms a dispatch")
    print(f"in place: {in_place * 1e3:.2f} ms priced by XLA + {kernel_s * 1e3:.2f} ms of the "
          f"kernel's reads at {chip.bandwidth / 1e9:.0f} GB/s = "
          f"{(in_place + kernel_s) * 1e3:.2f} ms ({gathered / (in_place + kernel_s):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
