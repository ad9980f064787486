"""A server's start-up compile: `Engine.warm_up` (every program a server meets) in a fresh
process, for the demo server (the demo model, --max-batch 4, context 512) and the benchmark
server (bench/common.py's model, --max-batch 8, --max-seq-len 2048), with random weights.

    python bench/serve_startup.py [--rounds 2] [--servers demo bench]

Prints, per server, the median warm-up seconds over `--rounds` processes (alternating the
servers) and the programs compiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from common import BENCH_MODEL, run_child

SERVERS = {"demo": ("configs/demo.yaml", 4, 512), "bench": (None, 8, 2048)}


def measure(server: str) -> dict:
    """One warm-up of `server` (run in a fresh process)."""
    import jax

    import llama_jax
    from llama_jax.serve.engine import Engine

    path, max_batch, max_seq_len = SERVERS[server]
    config = BENCH_MODEL if path is None else llama_jax.load_run_config(path).model
    params = llama_jax.init_params(config, jax.random.key(0))
    engine = Engine(config, params, max_batch=max_batch, max_seq_len=max_seq_len)
    seconds = engine.warm_up()
    return {"seconds": seconds, "programs": engine.programs.compiled}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child)))
        return 0
    runs = {s: [] for s in args.servers}
    for _ in range(args.rounds):
        for server in args.servers:
            runs[server].append(run_child(__file__, "--child", server))
    for server, results in runs.items():
        print(f"{server:6s} warm-up {statistics.median(r['seconds'] for r in results):6.1f} s "
              f"({results[0]['programs']} programs; rounds: "
              f"{', '.join(format(r['seconds'], '.1f') for r in results)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
