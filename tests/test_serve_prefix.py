"""The engine's chunked prefill, prefix cache and shared prefills (`n` choices), in-process:
a warm prompt equals its cold run bit for bit; chunked, cached, evicting and unchunked
engines equal `generate` alone; a group's choices equal separate requests; prompt scores
ignore the cache. The prompts are random token ids of a random tiny model, whose greedy
choices have no near-ties (a tie would show as a token mismatch against `generate`, whose
test_serve_engine.py twin has never met one)."""

import threading

import jax
import numpy as np
import pytest

import llama_jax
from llama_jax.decode.generate import generate
from llama_jax.decode.batching import chunk_plan
from llama_jax.decode.decoder import page_bytes
from llama_jax.serve.engine import Engine
from llama_jax.serve.requests import Request

from models import SERVING, random_params

CONFIGS = {name: SERVING[name] for name in ("gqa", "mla")}
CHUNK = 16
MAX_SEQ_LEN = 112
WAIT_S = 120


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIGS, seed=5)


def engine_for(config, p, blocks: int, chunk: int = CHUNK, **kwargs) -> Engine:
    cache_dtype = kwargs.setdefault("cache_dtype", "float32")
    page = kwargs.setdefault("page_size", 16)
    block = page_bytes(config, p, page, cache_dtype, None) * (chunk // page)
    return Engine(config, p, max_batch=4, max_seq_len=MAX_SEQ_LEN, stop_ids=[],
                  steps_per_dispatch=3, prefill_chunk=chunk, prefix_cache_bytes=blocks * block,
                  **kwargs)


def run(engine: Engine, groups: list[list[dict]]) -> list[dict]:
    """Submits the groups (each a list of requests sharing a prompt) at once and waits,
    bounded, for all; a result per request, in order: tokens, log-probabilities, top
    alternatives, prompt scores, finish reason, error and the tokens restored."""
    results, done, requests = [], [], []
    for group in groups:
        members = []
        for kwargs in group:
            result, event = {"tokens": [], "logprobs": [], "top": [], "prompt": None}, \
                threading.Event()

            def take(chunk, result=result, event=event):
                result["tokens"] += chunk.tokens
                result["logprobs"] += chunk.logprobs
                result["top"] += chunk.top
                if chunk.prompt_logprobs is not None:
                    result["prompt"] = chunk.prompt_logprobs
                if chunk.finish_reason or chunk.error:
                    result["reason"], result["error"] = chunk.finish_reason, chunk.error
                    event.set()
            members.append(Request(deliver=take, **kwargs))
            results.append(result)
            done.append(event)
        requests += members
        engine.submit_group(members)
    for event in done:
        assert event.wait(WAIT_S), "a request did not finish"
    for result, request in zip(results, requests):
        assert result["error"] is None
        result["cached"] = request.cached_tokens
    return results


def shared_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 5-80 tokens over three common prefixes of 0, 20 and 40 tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [[], rng.integers(0, vocab, 20).tolist(), rng.integers(0, vocab, 40).tolist()]
    return [prefixes[i % 3] + rng.integers(0, vocab, int(n)).tolist()
            for i, n in enumerate(rng.integers(5, 41, 32))]


@pytest.mark.parametrize("name, cache_dtype, decode_impl", [
    ("gqa", "float32", "scan"), ("gqa", "int8", "unrolled"), ("mla", "float32", "unrolled"),
    ("mla", "int8", "scan"), ("gqa", "int8", "scan"), ("gqa", "float32", "unrolled")])
def test_a_warm_prompt_equals_its_cold_run_bit_for_bit(params, name, cache_dtype, decode_impl):
    """The same request twice to an idle engine: the second restores the prompt's full
    chunks but the last and returns the same tokens, log-probabilities and top
    alternatives, bit for bit, greedy and sampled."""
    config, p = CONFIGS[name], params[name]
    engine = engine_for(config, p, 16, cache_dtype=cache_dtype, decode_impl=decode_impl)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 53).tolist()
    engine.start()
    try:
        runs = [run(engine, [[dict(prompt=prompt, max_tokens=9, top_logprobs=3),
                              dict(prompt=prompt, max_tokens=9, temperature=0.8, seed=4)]])
                for _ in range(2)]
    finally:
        assert engine.stop(30)
    (cold, cold_sampled), (warm, warm_sampled) = runs
    assert cold["cached"] == 0 and warm["cached"] == 3 * CHUNK  # 53 tokens: 3 full chunks
    for a, b in ((cold, warm), (cold_sampled, warm_sampled)):
        assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
        assert a["top"] == b["top"]
    stats = engine.stats()
    # Idle, the pool's pages in use are the three cached chunks' (a page each), which the
    # warm prompt's rows listed without copying.
    assert stats["prefix_cache_hits"] == 1 and stats["kv_pages_used"] == 3


@pytest.mark.parametrize("chunk, blocks", [(CHUNK, 64), (CHUNK, 0), (CHUNK, 2), (128, 0)],
                         ids=["cached", "chunked", "evicting", "whole"])
def test_every_engine_equals_generate_alone(params, chunk, blocks):
    """32 requests sharing prefixes, mixed lengths, sent at once through 4 rows: with the
    prefix cache, chunked without it, with a pool of 2 blocks (always evicting) and with one
    chunk per prompt, each request's greedy tokens equal `generate` alone and its
    log-probabilities within 1e-4; two seeded samples equal `generate(seed)` alone."""
    config, p = CONFIGS["gqa"], params["gqa"]
    engine = engine_for(config, p, blocks, chunk)
    prompts = shared_prompts(config.vocab_size)
    new = [int(n) for n in np.random.default_rng(1).integers(2, 12, len(prompts))]
    sampled = [dict(prompt=prompts[i], max_tokens=8, temperature=1.0, top_p=0.9, seed=i)
               for i in (4, 5)]
    engine.start()
    try:
        results = run(engine, [[dict(prompt=q, max_tokens=n)] for q, n in zip(prompts, new)]
                      + [[s] for s in sampled])
    finally:
        assert engine.stop(30)
    tokens, logprobs = generate(config, p, prompts, max(new), stop_tokens=[],
                                cache_dtype="float32", return_logprobs=True)
    for n, result, row, row_logprobs in zip(new, results, tokens, logprobs):
        assert result["tokens"] == row[:n]
        np.testing.assert_allclose(result["logprobs"], row_logprobs[:n], atol=1e-4)
    for s, result in zip(sampled, results[len(prompts):]):
        assert result["tokens"] == generate(config, p, [s["prompt"]], 8, stop_tokens=[],
                                            temperature=1.0, top_p=0.9, seed=s["seed"],
                                            cache_dtype="float32")[0]
    stats = engine.stats()
    hits = sum(r["cached"] > 0 for r in results)
    assert stats["prefix_cache_hits"] == hits and (hits > 0) == (blocks > 0)
    assert stats["prefix_cache_hit_tokens"] == sum(r["cached"] for r in results)
    assert stats["prefix_cache_blocks_used"] <= blocks
    computed = sum(len(chunk_plan(len(r_prompt), r["cached"], chunk, MAX_SEQ_LEN))
                   for r_prompt, r in zip(prompts + [s["prompt"] for s in sampled], results))
    assert stats["prefill_chunks"] == computed


def test_n_choices_share_one_prefill(params):
    """A group of 4 sampled choices of one 40-token prompt runs the prompt's chunks once and
    each choice j equals a request alone with seed 7 + j."""
    config, p = CONFIGS["gqa"], params["gqa"]
    engine = engine_for(config, p, 0)
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 40).tolist()
    choices = [dict(prompt=prompt, max_tokens=10, temperature=1.0, seed=7 + j) for j in range(4)]
    engine.start()
    try:
        together = run(engine, [choices])
        chunks = engine.stats()["prefill_chunks"]
        alone = [run(engine, [[c]])[0] for c in choices]
    finally:
        assert engine.stop(30)
    assert chunks == len(chunk_plan(40, 0, CHUNK, MAX_SEQ_LEN)) == 3
    for a, b in zip(together, alone):
        assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
    assert len({tuple(r["tokens"]) for r in together}) > 1


def test_prompt_scores_are_chunked_exactly_and_bypass_the_cache(params):
    """A 70-token prompt scored (prompt_logprobs) in chunks of 16 equals the full forward's
    log-probabilities; sent again it restores nothing and scores the same."""
    config, p = CONFIGS["gqa"], params["gqa"]
    prompt = np.random.default_rng(4).integers(0, config.vocab_size, 70).tolist()
    logprobs_TV = np.asarray(jax.nn.log_softmax(
        llama_jax.forward(config, p, np.asarray([prompt]))[0].astype(np.float32), -1))
    engine = engine_for(config, p, 64)
    engine.start()
    try:
        plain = run(engine, [[dict(prompt=prompt, max_tokens=2)]])[0]
        scored = [run(engine, [[dict(prompt=prompt, max_tokens=2, prompt_logprobs=True)]])[0]
                  for _ in range(2)]
    finally:
        assert engine.stop(30)
    expected = logprobs_TV[np.arange(69), prompt[1:]]
    for result in scored:
        assert result["cached"] == 0 and result["tokens"] == plain["tokens"]
        np.testing.assert_allclose(result["prompt"], expected, atol=1e-5)
    assert scored[0]["prompt"] == scored[1]["prompt"]
