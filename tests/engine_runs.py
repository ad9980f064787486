"""Driving a server's Engine in tests: requests submitted at once, each one's delivered chunks
gathered, every wait bounded."""

from __future__ import annotations

import threading

from llama_jax.serve.engine import Engine
from llama_jax.serve.requests import Request

WAIT_S = 120


def run(engine: Engine, requests: list[dict]) -> list[dict]:
    """Submits the requests at once and waits (bounded) for all; each result has the tokens,
    log-probabilities, finish reason and error of one request."""
    results = [{"tokens": [], "logprobs": [], "reason": None, "error": None} for _ in requests]
    done = [threading.Event() for _ in requests]

    def deliver(i):
        def take(chunk):
            results[i]["tokens"] += chunk.tokens
            results[i]["logprobs"] += chunk.logprobs
            if chunk.finish_reason or chunk.error:
                results[i]["reason"], results[i]["error"] = chunk.finish_reason, chunk.error
                done[i].set()
        return take

    for i, kwargs in enumerate(requests):
        engine.submit(Request(deliver=deliver(i), **kwargs))
    for event in done:
        assert event.wait(WAIT_S), "a request did not finish"
    return results
