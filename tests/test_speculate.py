"""Speculative decoding: the proposers against plain-Python references, the verify pass
against step-by-step decoding, greedy output against decoding without speculation (token for
token, every cache kind, both proposers), sampled output's distribution against the model's
(chi-square), and the settings refused."""

import dataclasses

import jax
import numpy as np
import pytest

import llama_jax
from llama_jax.decode.generate import GenerationStats, generate, stream
from llama_jax.decode.speculate import speculation
from llama_jax.decode.speculate import ngram_proposals
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply, unstack_layers
from llama_jax.nn.heads import lm_head
from reference import relative_error
from llama_jax.serve.engine import Engine
from engine_runs import run as run_requests
from models import MLA_TINY, TINY


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k (or fewer) tokens after the latest earlier occurrence of the longest suffix
    n-gram with k tokens after it, or else the latest, n from max_n down to min_n; none when
    no n recurs."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > L:
            continue
        suffix = tokens[L - n:]
        matches = [i for i in range(L - n - 1, -1, -1)  # a token must follow the window
                   if tokens[i:i + n] == suffix]
        full = [i for i in matches if i + n + k <= L]
        if matches:
            i = (full or matches)[0]
            return tokens[i + n:i + n + k]
    return []


@pytest.mark.parametrize("k, min_n, max_n", [(4, 1, 3), (2, 2, 2), (7, 1, 5)])
def test_ngram_proposals_equal_the_reference(k, min_n, max_n):
    """Random rows over a 4-token vocabulary (so n-grams recur) of every length up to the
    buffer, padded with random tokens after their length (never looked at)."""
    rng = np.random.default_rng(k)
    N, B = 24, 64
    tokens_BN = rng.integers(0, 4, (B, N)).astype(np.int32)
    length_B = rng.integers(1, N + 1, B).astype(np.int32)
    length_B[:3] = (1, N, max_n)
    proposals, counts = jax.jit(ngram_proposals, static_argnums=(2, 3, 4))(
        tokens_BN, length_B, k, min_n, max_n)
    for row, length, proposal, count in zip(tokens_BN, length_B, np.asarray(proposals),
                                            np.asarray(counts)):
        expected = reference(row[:length].tolist(), k, min_n, max_n)
        assert proposal[:count].tolist() == expected
    assert (np.asarray(counts) > 0).any() and (np.asarray(counts) == 0).any()


def test_bad_ngram_settings_are_refused():
    with pytest.raises(ValueError, match="ngram=\\(3, 2\\)"):
        ngram_proposals(np.zeros((1, 8), np.int32), np.ones(1, np.int32), 2, 3, 2)


# ------------------------------------------------------------------- the verify pass

KINDS = {  # (model, cache dtype, decoder): every cache kind a verify pass reads
    "gqa-stacked-f32": (TINY, "float32", "scan"),
    "gqa-per_layer-bf16": (TINY, "bfloat16", "unrolled"),
    "gqa-per_layer-int8": (TINY, "int8", "unrolled"),
    "gqa-stacked-int8": (TINY, "int8", "scan"),
    "mla-stacked-f32": (MLA_TINY, "float32", "scan"),
    "mla-per_layer-int8": (MLA_TINY, "int8", "unrolled"),
}
run = jax.jit(lambda c, p, tokens, cache: (lambda h, cache: (lm_head(c, p, h), cache))(
    *apply(c, p, tokens, cache=cache)[:2]), static_argnums=0)


@pytest.fixture(scope="module")
def models():
    return {"gqa": (TINY, llama_jax.init_params(TINY, jax.random.key(0))),
            "mla": (MLA_TINY, llama_jax.init_params(MLA_TINY, jax.random.key(1)))}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_verify_pass_at_rows_of_their_own_lengths_equals_one_row_step_by_step(kind, models):
    """Rows whose caches end at different slots (9, 12, 10 of 12 written: the slots past a
    row's end hold rejected guesses) take 5 tokens in one pass; each row's logits equal those
    of the row alone, prefilled to its end and fed the 5 tokens one step at a time."""
    config, dtype, decoder = KINDS[kind]
    params = models[kind[:3]][1]
    params = unstack_layers(params) if decoder == "unrolled" else params
    layout = "per_layer" if decoder == "unrolled" else "stacked"
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (3, 17)).astype(np.int32)
    ends = np.array([9, 12, 10], np.int32)
    cache = init_cache(config, 3, 32, dtype, layout=layout)
    _, cache = run(config, params, tokens[:, :12], cache)
    cache = cache.with_row_ends().replace(end=ends)
    logits, cache = run(config, params, np.stack([tokens[b, e:e + 5] for b, e in
                                                  enumerate(ends)]), cache)
    assert np.asarray(cache.end).tolist() == (ends + 5).tolist()
    for b, e in enumerate(ends):
        one = init_cache(config, 1, 32, dtype, layout=layout)
        _, one = run(config, params, tokens[b:b + 1, :e], one)
        steps = []
        for t in range(5):
            step_logits, one = run(config, params, tokens[b:b + 1, e + t:e + t + 1], one)
            steps.append(step_logits)
        assert relative_error(logits[b:b + 1], np.concatenate(steps, axis=1)) < 1e-5, b


# ------------------------------------------------------------------- greedy: the same tokens

def first_layers(config, params, n):
    """The model's first n layers, with its embedding, final norm and head: a draft that
    agrees with it on many tokens (random weights are too unlike for anything else to)."""
    return (dataclasses.replace(config, n_layers=n),
            {**params, "groups": tuple(jax.tree.map(lambda w: w[:n], g)
                                       for g in params["groups"])})


def repetitive_prompts(lengths, vocab, seed):
    """Prompts that repeat a phrase of their own, so that prompt lookup finds n-grams; random
    weights have no near-ties between their two likeliest tokens on these (a tie broken
    differently by the verify pass's and a step's rounding would change the tokens)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, max(2, n // 3)).tolist() * 3)[:n] for n in lengths]


RAGGED = [37, 5, 18, 2, 29, 11, 44, 8]


# Each cache kind with one proposer; each proposer meets both layouts, both models and int8.
PROPOSERS = {"gqa-stacked-f32": "draft", "gqa-per_layer-bf16": "ngram",
             "gqa-per_layer-int8": "draft", "gqa-stacked-int8": "ngram",
             "mla-stacked-f32": "ngram", "mla-per_layer-int8": "draft"}


@pytest.mark.parametrize("kind, proposer", PROPOSERS.items())
def test_greedy_with_speculation_is_greedy_without(kind, proposer, models):
    """A ragged batch of 8, and its first row alone, generate the same tokens as without
    speculation, their log-probabilities within 1e-4; some guesses are kept, some not."""
    config, dtype, decoder = KINDS[kind]
    params = models[kind[:3]][1]
    prompts = repetitive_prompts(RAGGED, config.vocab_size, seed=len(kind))
    common = dict(stop_tokens=[], cache_dtype=dtype, decode_impl=decoder,
                  return_logprobs=True)
    reference, reference_lp = generate(config, params, prompts, 24, **common)
    how = (dict(speculate="ngram", ngram=(1, 3), min_accepted=0) if proposer == "ngram"
           else dict(draft=first_layers(config, params, 1)))
    stats = GenerationStats()
    tokens, logprobs = generate(config, params, prompts, 24, num_speculative_tokens=3,
                                stats=stats, **how, **common)
    assert tokens == reference
    for row, reference_row in zip(logprobs, reference_lp):
        np.testing.assert_allclose(row, reference_row, atol=1e-4)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    alone, _ = generate(config, params, prompts[:1], 24, num_speculative_tokens=3, **how,
                        **common)
    assert alone == reference[:1]


# ------------------------------------------------------------------- sampling: the same law

SMALL = llama_jax.ModelConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                              ffn_dim=32, max_seq_len=64, init_std=0.6)
TEMPERATURE, TOP_K = 0.9, 6


def filtered_probs(logits_V: np.ndarray) -> np.ndarray:
    """The sampled distribution: temperature, then the top-k tokens kept (float64)."""
    scaled = logits_V.astype(np.float64) / TEMPERATURE
    scaled[scaled < np.sort(scaled)[-TOP_K]] = -np.inf
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


def chi_square_ok(counts: np.ndarray, expected: np.ndarray) -> bool:
    """Pearson's statistic below its 1 - 1e-4 quantile (Wilson–Hilferty), cells expected
    fewer than 5 times pooled."""
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])
    df = keep.sum() - 1
    return stat < df * (1 - 2 / (9 * df) + 3.72 * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_tokens_follow_the_models_distribution(proposer):
    """20480 rows sample 3 tokens from one prompt; the joint law of the first two and the law
    of the third (the first two speculative) match the target's exact ones (enumerated), by a
    chi-square test. The draft is a random model unlike the target; prompt lookup guesses from
    a repetitive prompt (a point mass)."""
    params = llama_jax.init_params(SMALL, jax.random.key(0))
    draft = (SMALL, llama_jax.init_params(SMALL, jax.random.key(1)))
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1]
    how = dict(speculate="ngram", min_accepted=0) if proposer == "ngram" else dict(draft=draft)
    samples, stats = [], GenerationStats()
    for seed in range(5):
        samples += generate(SMALL, params, [prompt] * 4096, 3, temperature=TEMPERATURE,
                            top_k=TOP_K, seed=seed, stop_tokens=[], num_speculative_tokens=2,
                            stats=stats, **how)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    samples = np.asarray(samples)
    V = SMALL.vocab_size
    pairs = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    logits = np.asarray(llama_jax.forward(SMALL, params, np.concatenate(
        [np.tile(prompt, (V * V, 1)), pairs], axis=1)), np.float64)
    p1 = filtered_probs(logits[0, len(prompt) - 1])
    p2_given_1 = np.stack([filtered_probs(logits[a * V, len(prompt)]) for a in range(V)])
    p3_given_12 = np.stack([filtered_probs(row[len(prompt) + 1]) for row in logits])
    joint12 = (p1[:, None] * p2_given_1).reshape(-1)
    n = len(samples)
    assert chi_square_ok(np.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V),
                         n * joint12)
    assert chi_square_ok(np.bincount(samples[:, 2], minlength=V),
                         n * (joint12[:, None] * p3_given_12).sum(0))


def test_stop_tokens_max_tokens_and_streaming_cut_speculative_output_exactly(models):
    """Rounds of several tokens (the model is its own draft: every guess is kept) are cut at
    a stop token and at max_new_tokens as a plain decode cuts them, and streamed chunks of
    rounds add up to the whole output."""
    config, params = models["gqa"]
    prompts = repetitive_prompts([30, 12, 21], config.vocab_size, seed=5)
    plain = generate(config, params, prompts, 20, stop_tokens=[])
    stop = plain[0][7]  # a token row 0 emits mid-way (other rows may emit it too)
    how = dict(draft=(config, params), num_speculative_tokens=4)
    for max_new in (20, 13):
        want = generate(config, params, prompts, max_new, stop_tokens=[stop])
        assert generate(config, params, prompts, max_new, stop_tokens=[stop], **how) == want
    chunks = list(stream(config, params, prompts, 20, stop_tokens=[], chunk_steps=1, **how))
    assert len(chunks) > 3
    assert [sum((c[0][row] for c in chunks), []) for row in range(3)] == plain


# ------------------------------------------------------------------- in the server's engine

@pytest.mark.parametrize("kind, how", [("gqa-stacked-int8", "ngram, always"),
                                       ("mla-per_layer-int8", "ngram, by rates"),
                                       ("gqa-stacked-f32", "draft, always"),
                                       ("mla-stacked-f32", "draft, by rates")])
def test_a_speculating_engine_equals_generate_alone(kind, how, models):
    """16 greedy requests of mixed lengths through 4 rows that speculate (prompt lookup or a
    draft model: the model itself, whose every guess is kept if its cache holds each row's
    context; every round verifying, or rows verifying while their guesses pay by their own
    rates: the draft's start off, below its break-even, and turn on as its first guesses in
    plain rounds land), a stop id among them: each one's tokens, log-probabilities (within
    1e-4) and finish reason equal `generate` without speculation; a seeded sampled request
    gives the same tokens alone and among them where every round verifies; guesses were
    verified and some (the draft's: all) kept, a greedy request alone as many as in
    `generate` where every round verifies."""
    config, dtype, decoder = KINDS[kind]
    params = models[kind[:3]][1]
    lengths = [37, 5, 18, 2, 29, 11, 44, 8, 20, 33, 7, 15, 3, 26, 40, 12]
    new = [24, 10, 30, 5, 17, 24, 12, 30, 9, 16, 28, 20, 6, 24, 13, 19]
    prompts = repetitive_prompts(lengths, config.vocab_size, seed=7)
    stop = generate(config, params, prompts[:1], 12, stop_tokens=[])[0][10]
    speculating = {"ngram, always": dict(speculate="ngram", min_accepted=0),
                   "ngram, by rates": dict(speculate="ngram"),
                   "draft, always": dict(draft=(config, params), min_accepted=0),
                   "draft, by rates": dict(draft=(config, params))}[how]
    engine = Engine(config, params, max_batch=4, max_seq_len=80, stop_ids=[stop],
                    cache_dtype=dtype, decode_impl=decoder, steps_per_dispatch=3,
                    prefill_chunk=16, num_speculative_tokens=3, **speculating)
    sampled = dict(prompt=prompts[4], max_tokens=20, temperature=0.9, top_k=20, seed=11)
    engine.start()
    try:
        alone = run_requests(engine, [sampled])[0]["tokens"]
        first = engine.stats()
        run_requests(engine, [dict(prompt=prompts[6], max_tokens=new[6])])
        first = {k: v - first[k] for k, v in engine.stats().items() if "speculative" in k}
        results = run_requests(engine, [dict(prompt=q, max_tokens=n)
                                        for q, n in zip(prompts, new)]
                                       + [sampled])
    finally:
        assert engine.stop(30)
    if how.endswith("always"):  # (the server decides by rates a program late)
        # a greedy request alone guesses and keeps what it does in `generate`: its guesses
        # come from the same state (its tokens; a draft's cache of them)
        stats = GenerationStats()
        generate(config, params, prompts[6:7], new[6], stop_tokens=[stop], cache_dtype=dtype,
                 decode_impl=decoder, num_speculative_tokens=3, stats=stats, **speculating)
        assert (first["speculative_accepted_tokens"], first["speculative_drafted_tokens"]) \
            == (stats.accepted_tokens, stats.drafted_tokens)
    tokens, logprobs = generate(config, params, prompts, max(new), stop_tokens=[stop],
                                cache_dtype=dtype, decode_impl=decoder, return_logprobs=True)
    for n, result, row, row_logprobs in zip(new, results, tokens, logprobs):
        assert result["tokens"] == row[:n]
        assert result["reason"] == ("length" if len(row) >= n else "stop")
        np.testing.assert_allclose(result["logprobs"], row_logprobs[:n], atol=1e-4)
    if how.endswith("always"):  # (by rates, a busy batch may outvote the row's passes)
        assert results[-1]["tokens"] == alone
    stats = engine.stats()
    kept, drafted = stats["speculative_accepted_tokens"], stats["speculative_drafted_tokens"]
    assert 0 < kept == drafted if how.startswith("draft") else 0 < kept < drafted


def test_rows_verify_by_the_rates_the_host_chose_the_program_by(models):
    """In a server's program that verifies, a row verifies by the rate the host decided by
    (`deciding_rate_B`, the program before the last's), not by its running rate: a row the
    host saw worth verifying does even if its rate fell since, and one it did not see worth
    it takes plain steps even if its rate rose."""
    from llama_jax.decode import batching as programs
    from llama_jax.decode.sampling import SamplingParams, Strategy
    from llama_jax.decode.step import NO_TOKEN

    config, params = models["gqa"]
    spec = speculation(config, "ngram", 3, (1, 3), None, 2, min_accepted=1.0)
    rows = programs.empty_rows(np.asarray([NO_TOKEN], np.int32), config=config, batch=2,
                               n_pages=8, page_size=16, max_len=64, cache_dtype="float32",
                               layout="stacked", spec=spec, placement=None)
    pages_BN = np.arange(8, dtype=np.int32).reshape(2, 4)  # 64 positions a row
    base = repetitive_prompts([20], config.vocab_size, seed=0)[0]
    prompt = base + generate(config, params, [base], 10, stop_tokens=[])[0]  # it loops: guesses
    n = len(prompt)
    tokens_1L = np.zeros((1, 32), np.int32)
    tokens_1L[0, :n] = prompt
    prompt_1S = np.zeros((1, 64), np.int32)
    prompt_1S[0, :n] = prompt
    for row in (0, 1):
        rows, logits, _ = programs.prefill_chunk(rows, params, pages_BN[row:row + 1, :2],
                                                 tokens_1L, np.int32(0), np.int32(n - 1),
                                                 config=config, placement=None)
        rows, _ = programs.insert(rows, logits, np.int32(row), np.int32(n), np.int32(20),
                                  SamplingParams.broadcast(1), jax.random.key(row)[None],
                                  prompt_1S)
    rates = np.asarray([0.9, 0.1], np.float32)  # expected kept: 2.44 and 0.11 of 3
    rows = rows.replace(lookup=rows.lookup.replace(deciding_rate_B=rates,
                                                   hit_rate_B=rates[::-1].copy()))
    _, out = programs.speculate(rows, params, None, pages_BN, config=config, n_steps=1,
                                spec=spec, verify=True, strategy=Strategy(False, False), top=0,
                                placement=None)
    drafted = np.asarray(out.drafted_B)
    assert drafted[0] > 0 and drafted[1] == 0


def test_a_servers_draft_must_share_the_vocabulary_and_one_device(models):
    from llama_jax.config import MeshConfig
    from llama_jax.parallel import sharding

    config, params = models["gqa"]
    other = dataclasses.replace(config, vocab_size=config.vocab_size + 1)
    with pytest.raises(GenerateError, match="draft model's vocabulary"):
        Engine(config, params, draft=(other, llama_jax.init_params(other, jax.random.key(2))))
    mesh = sharding.make_mesh(MeshConfig(data=len(jax.devices())))
    on_mesh = jax.device_put(params, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    with pytest.raises(GenerateError, match="draft model decodes on one device"):
        Engine(config, on_mesh, draft=first_layers(config, params, 1))


@pytest.mark.parametrize("platform", ["cpu", "gpu", "metal"])
@pytest.mark.parametrize("batch, k", [(1, 2), (1, 8), (8, 4), (32, 15)])
def test_at_the_break_even_a_round_costs_per_token_what_plain_steps_cost(platform, batch, k):
    """Prompt lookup's `min_kept` makes a verify pass (costing `verify_cost` steps) cost one
    step per token it yields (1 + kept); a draft model's makes a round (the pass and k draft
    steps of r of the model) cost per token what a plain round does (a step and a draft
    step). A pass costs more with more rows and more guesses, and less on an accelerator,
    whose step reads weights, than on a CPU (an unknown platform is costed as a CPU)."""
    from llama_jax.decode.speculate import draft_break_even, verify_cost
    from llama_jax.plan.costs import param_counts

    pass_cost = verify_cost(batch, k, platform)
    lookup = speculation(TINY, "ngram", k, (1, 3), None, batch, platform=platform)
    assert pass_cost / (1 + lookup.min_kept) == pytest.approx(1.0)
    draft = dataclasses.replace(TINY, n_layers=1)
    r = param_counts(draft).total / param_counts(TINY).total
    kept = draft_break_even(TINY, draft, batch, k, platform)
    assert (pass_cost + k * r) / (1 + kept) == pytest.approx(1 + r)
    assert verify_cost(batch + 1, k, platform) > pass_cost < verify_cost(batch, k + 1, platform)
    assert verify_cost(batch, k, "gpu") <= pass_cost
    assert verify_cost(batch, k, "metal") == verify_cost(batch, k, "cpu") > verify_cost(
        batch, k, "gpu")
