"""A server's start-up: `python -m llama_jax.serve` from its launch to "serving ... on" (load,
check, compile every program it meets, listen), and the compile alone (`Engine.warm_up` in a
fresh process), for the demo server (the demo model, --max-batch 4, context 512) and the
benchmark server (bench/common.py's model, --max-batch 8, --max-seq-len 2048), with random
weights and bench/serve.py's tokenizer.

    python bench/serve_startup.py [--rounds 2] [--servers demo bench]

Prints, per server, the medians over `--rounds` rounds (alternating the servers) and the
programs compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import BENCH_MODEL, run_child

SERVERS = {"demo": ("configs/demo.yaml", 4, 512), "bench": (None, 8, 2048)}


def model_of(server: str):
    import llama_jax

    path = SERVERS[server][0]
    return BENCH_MODEL if path is None else llama_jax.load_run_config(path).model


def measure(server: str) -> dict:
    """One warm-up of `server` (run in a fresh process)."""
    import jax

    import llama_jax
    from llama_jax.serve.engine import Engine

    _, max_batch, max_seq_len = SERVERS[server]
    config = model_of(server)
    params = llama_jax.init_params(config, jax.random.key(0))
    engine = Engine(config, params, max_batch=max_batch, max_seq_len=max_seq_len)
    seconds = engine.warm_up()
    return {"seconds": seconds, "programs": engine.programs.compiled}


def checkpoint(server: str, root: Path) -> Path:
    """`server`'s model with random weights and bench/serve.py's tokenizer, saved at root."""
    import jax

    import llama_jax
    from serve import make_checkpoint

    if not (root / "tokenizer").exists():
        make_checkpoint(root / "tokenizer")
    config = dataclasses.replace(model_of(server), eos_ids=(2,))
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)), root / server)
    (root / server / "tokenizer.model").write_bytes(
        (root / "tokenizer" / "native" / "tokenizer.model").read_bytes())
    return root / server


def launch(native: Path, server: str) -> float:
    """Seconds from launching the server to its "serving" line."""
    from serve import Server, free_port

    _, max_batch, max_seq_len = SERVERS[server]
    port = free_port()
    start = time.perf_counter()
    process = Server([sys.executable, "-m", "llama_jax.serve", "--checkpoint", str(native),
                      "--port", str(port), "--served-model-name", server, "--max-batch",
                      str(max_batch), "--max-seq-len", str(max_seq_len), "--log-level",
                      "warning"], port, f"serving {server} on ")
    seconds = time.perf_counter() - start
    process.stop()
    return seconds


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
    launches = {s: [] for s in args.servers}
    with tempfile.TemporaryDirectory() as tmp:
        natives = {s: checkpoint(s, Path(tmp)) for s in args.servers}
        for _ in range(args.rounds):
            for server in args.servers:
                launches[server].append(launch(natives[server], server))
                runs[server].append(run_child(__file__, "--child", server))
    for server, results in runs.items():
        print(f"{server:6s} start-up {statistics.median(launches[server]):6.1f} s, of which "
              f"compiling {statistics.median(r['seconds'] for r in results):6.1f} s "
              f"({results[0]['programs']} programs; rounds: "
              f"{', '.join(format(x, '.1f') for x in launches[server])} and "
              f"{', '.join(format(r['seconds'], '.1f') for r in results)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
