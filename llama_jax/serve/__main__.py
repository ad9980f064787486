"""Serve a checkpoint over the OpenAI API with continuous batching.

    python -m llama_jax.serve --checkpoint DIR [--tokenizer PATH] [--host 127.0.0.1]
        [--port 8000] [--max-batch 8] [--max-seq-len N] [--dtype bfloat16]
        [--served-model-name NAME] [--attention-impl auto] [--mesh data=D,fsdp=F,tensor=T]
        [--quantize int8 [--quantize-head]] [--cache-dtype int8] [--steps-per-dispatch 4]
        [--prefill-chunk 128] [--prefix-cache-bytes N | --no-prefix-cache]
        [--max-queue 64] [--drain-timeout 30] [--compile-only [--topology v5e-8]]
        [--speculate ngram [--ngram 1 3] [--speculate-min-accepted X] |
         --draft-checkpoint DIR] [--num-speculative-tokens 4]

It loads any checkpoint `load_checkpoint` reads, refuses a configuration whose weights and KV
cache do not fit the device's memory (with the numbers), compiles its programs, prints
`serving NAME on http://HOST:PORT` and serves until SIGINT or SIGTERM: then it stops
accepting connections, lets the requests in flight finish (at most --drain-timeout seconds)
and exits 0. With `--compile-only` it reads the checkpoint's config, not its weights, compiles
the server's largest programs for this host's devices or a `--topology` it does not have, and
says whether they fit each device (exit 0) or not (exit 1): `llama_jax.aot.serving`.
`--speculate ngram` decodes by prompt lookup (docs/serving.md), turning itself off while the
guesses are not kept often enough to pay; `--draft-checkpoint DIR` by a draft model sharing
the tokenizer (`--speculate draft`, implied).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from llama_jax.cli import user_errors_exit
from llama_jax.config import parse_mesh
from llama_jax.serve.flags import add_server_arguments, check_speculation_flags

log = logging.getLogger("llama_jax.serve")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llama_jax.serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
    parser.add_argument("--tokenizer", help="tokenizer.model (default: the checkpoint's)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients ask for (default: the checkpoint "
                             "directory's name)")
    add_server_arguments(parser)
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a slot (more get 429)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let requests in flight finish on SIGTERM")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the server's largest programs and say whether they fit "
                             "each device, then exit (no weights are read)")
    parser.add_argument("--topology", default=None,
                        help="with --compile-only: compile for this TPU slice or GPU node "
                             "(v5e-8, v5p-8, h100x8, ...) instead of this host's devices")
    args = parser.parse_args(argv)
    if args.topology and not args.compile_only:
        parser.error("--topology needs --compile-only: a server runs on this host's devices")
    check_speculation_flags(parser, args)
    return args


def _shutdown_on_signals() -> list[int]:
    """SIGINT and SIGTERM end the server gracefully (uvicorn handles them while it runs and
    raises them again afterwards; then they are only recorded, so the process exits 0)."""
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _: received.append(number))
    return received


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mesh = parse_mesh(args.mesh) if args.mesh else None  # bad flags fail before loading
    if args.compile_only:
        from llama_jax.aot.serving import print_report, report_for

        return print_report(report_for(args.checkpoint, args, mesh), as_json=False)
    import uvicorn

    from llama_jax.serve.app import build

    server, engine = build(args.checkpoint, tokenizer=args.tokenizer, dtype=args.dtype,
                           quantize=args.quantize, quantize_head=args.quantize_head,
                           cache_dtype=args.cache_dtype, max_batch=args.max_batch,
                           max_seq_len=args.max_seq_len, attention_impl=args.attention_impl,
                           decode_impl=args.decode_impl, mesh=mesh,
                           steps_per_dispatch=args.steps_per_dispatch,
                           prefill_chunk=args.prefill_chunk,
                           prefix_cache_bytes=0 if args.no_prefix_cache
                           else args.prefix_cache_bytes, page_size=args.page_size,
                           kv_cache_bytes=args.kv_cache_bytes, max_queue=args.max_queue,
                           model_name=args.served_model_name or Path(args.checkpoint).name,
                           speculate=args.speculate,
                           num_speculative_tokens=args.num_speculative_tokens,
                           ngram=tuple(args.ngram), min_accepted=args.speculate_min_accepted,
                           draft_checkpoint=args.draft_checkpoint)
    log.info("compiled the server's programs in %.1f s", engine.warm_up())
    engine.start()
    from llama_jax.serve.api import create_app

    config = uvicorn.Config(create_app(server), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout)
    http = uvicorn.Server(config)
    _shutdown_on_signals()
    announce = http.startup

    async def startup(*a, **k):
        await announce(*a, **k)
        if http.started:
            print(f"serving {server.model_name} on http://{args.host}:{args.port}", flush=True)
    http.startup = startup
    http.run()
    drained = engine.stop(args.drain_timeout)
    log.info("stopped%s", "" if drained else " (requests cut at the drain timeout)")
    return 0 if http.started else 1


if __name__ == "__main__":
    sys.exit(main())
